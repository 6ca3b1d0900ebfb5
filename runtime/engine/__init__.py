"""The inference engine. Handlers see it only through `Engine.generate()` (and abort, tokenizer, stats)."""

from runtime.engine.engine_config import EngineConfig
from runtime.engine.outputs import EngineStats, RequestCut, RequestOutput, TokenLogprob
from runtime.engine.sampling_params import InvalidParams, SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStats", "InvalidParams", "RequestCut", "RequestOutput",
           "SamplingParams", "TokenLogprob"]


def __getattr__(name: str):
    # Engine pulls in torch (seconds). Imported on first use, so that the server can import the records
    # above and start listening (health answers 503) while the engine is still being built.
    if name == "Engine":
        from runtime.engine.llm_engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
