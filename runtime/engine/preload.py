"""The kernels a first request launches, loaded while the weights stream in (PASK's proactive loading).

A CUDA context made at start (the process and cold paths) loads each kernel at its first launch, in the
thread that launches it. The decode graphs' kernels are loaded as the graphs are restored
(snapshots/cudagraph/kernels.py), but a first request also runs a prefill, whose kernels depend on its length
(cuBLAS picks its GEMM kernels by the number of tokens; PyTorch's gather and elementwise kernels; the prefill
attention's Triton kernel), and its sampler's kernels. Left to it, they made Qwen2-1.5B's first prefill take
0.08 s to launch after a process restore and its first sampling 0.01 s (greedy) to 0.09 s (with logprobs), on
the H200, where a warm prefill and sampling take a few milliseconds.

While the weights stream in, the host only waits, and those loads are mostly CPU-bound: `Preload` runs
throwaway prefills and samplings on a thread of its own then, most likely first, and stops when the weights
have landed, between two pieces, so that it never holds the start back by more than one piece. Its keys and
values go to block 0, before the engine serves (the reserved block of graph-padded rows, or one no request
holds yet); its logits and tokens are never read.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Callable

import torch

from runtime.cuda_driver.device import private_stream, use_device
from runtime.engine.sampling_params import SamplingParams
from runtime.engine.sequence import Sequence
from runtime.logs import get_logger

if TYPE_CHECKING:
    from runtime.engine.model_runner import ModelRunner
    from runtime.engine.sampler import Sampler

log = get_logger("engine.preload")

#: prefill lengths a first request's kernels are loaded for (clipped to what the engine takes in one step), and
#: those the warm-up before a gpu snapshot serves (runtime/engine/warm_up.py): cuBLAS picks its kernels by size
PROMPT_LENGTHS = (2, 5, 12, 30, 75, 190, 470, 1180, 2950)
#: the prompt length a first request most likely has (a chat turn in its template): the prefill lengths are
#: loaded nearest to it first
LIKELY_PROMPT = 200
#: longer prompts are left to load their own kernels: their prefill takes long enough that the loads matter
#: less, and their activations would stay cached on the preload's stream beside the engine's
LONGEST_PROMPT = 500
#: the sampler's paths in the order they are loaded: greedy, sampling at a temperature (OpenAI's default), and
#: the chosen token's log-probability with the most likely one's
SAMPLING_PATHS = (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
                  SamplingParams(temperature=0.0, logprobs=1))


def prefill_lengths(longest: int) -> list[int]:
    """PROMPT_LENGTHS up to LONGEST_PROMPT and `longest` tokens, nearest to LIKELY_PROMPT first (on a log
    scale)."""
    lengths = [n for n in PROMPT_LENGTHS if n <= min(LONGEST_PROMPT, longest)]
    return sorted(lengths, key=lambda n: abs(math.log(n / LIKELY_PROMPT)))


class Preload:
    """Throwaway prefills and samplings, `load()`ed on a thread of their own from `start()` until `stop()`,
    which returns what was loaded: a failure only costs the first request its own loads, so it is logged,
    never raised."""

    def __init__(self, runner: "ModelRunner", sampler: "Sampler", longest_prompt: int) -> None:
        self._runner, self._sampler = runner, sampler
        self._pieces = self._plan(prefill_lengths(longest_prompt))
        self._stop = threading.Event()
        self._done: list[tuple[str, float]] = []  # each piece loaded, and its seconds
        self._seconds = 0.0
        self._thread = threading.Thread(target=self.load, name="kernel-preload", daemon=True)

    def start(self) -> "Preload":
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop after the piece in progress and wait for the device to finish what was launched (its keys and
        values must land before a request may be given block 0); the stage detail of what was loaded."""
        stopping = time.perf_counter()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return {"pieces": len(self._done), "of": len(self._pieces), "seconds": round(self._seconds, 4),
                "stop_wait_s": round(time.perf_counter() - stopping, 4), "loaded": self._done}

    def _plan(self, lengths: list[int]) -> list[tuple[str, Callable[[], None]]]:
        """Each prefill length, then after the first one each sampling path on its logits."""
        logits: list[torch.Tensor] = []

        def prefill(n: int) -> Callable[[], None]:
            return lambda: logits.append(self._runner.run_prefill(n))

        def sample(params: SamplingParams, i: int) -> Callable[[], None]:
            return lambda: self._sample(logits[0], params, f"preload-{i}")

        pieces = [(f"prefill {n}", prefill(n)) for n in lengths]
        samplings = [(f"sampling {_path_name(p)}", sample(p, i)) for i, p in enumerate(SAMPLING_PATHS)]
        return pieces[:1] + samplings + pieces[1:] if pieces else []

    def _sample(self, logits: torch.Tensor, params: SamplingParams, request_id: str) -> None:
        self._sampler(logits, [Sequence(request_id, [0], params)])
        self._sampler.forget(request_id)  # a seeded path made a generator of its own

    def load(self) -> None:
        """Every piece in turn, on this thread, until stopped; then wait for the device to finish them."""
        started = time.perf_counter()
        try:
            device = self._runner.device
            use_device(device)
            stream = private_stream(device)  # not the legacy default stream: it would wait for the weight copies
            with torch.cuda.stream(stream), torch.inference_mode():
                for name, piece in self._pieces:
                    if self._stop.is_set():
                        break
                    began = time.perf_counter()
                    piece()
                    self._done.append((name, round(time.perf_counter() - began, 4)))
            stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - the first request loads what is missing itself
            log.warning("loading the first request's kernels ahead failed after %s: %s", self._done or "nothing", exc)
        self._seconds = time.perf_counter() - started


def _path_name(params: SamplingParams) -> str:
    if params.logprobs is not None:
        return "logprobs"
    return "greedy" if params.greedy else "temperature"
