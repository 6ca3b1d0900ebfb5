"""The inference engine. Handlers see it only through `Engine.generate()` (and abort, tokenizer, stats)."""

from runtime.engine.engine_config import EngineConfig
from runtime.engine.llm_engine import Engine
from runtime.engine.outputs import EngineStats, RequestOutput, TokenLogprob
from runtime.engine.sampling_params import InvalidParams, SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStats", "InvalidParams", "RequestOutput", "SamplingParams",
           "TokenLogprob"]
