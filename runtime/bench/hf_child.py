"""The outside baseline, run as its own process: plain Hugging Face transformers, timed from the spawn.

    python -m runtime.bench.hf_child < {"model": DIR, "device": "cuda", "dtype": "auto", "prompt_ids": [...]}

prints the timeline (runtime.timeline's JSON form) as one line on stdout: runtime_init (importing torch and
transformers), tokenizer, weights (from_pretrained and the move to the device: structure and weights
together, as transformers does them) and first_token (generate with max_new_tokens=1).
"""

from __future__ import annotations

import json
import sys

from runtime import timeline as stages
from runtime.timeline import Timeline


def main() -> int:
    timeline = Timeline()  # origin: THAWLLM_SPAWN_TIME, set by the bench just before the spawn
    job = json.loads(sys.stdin.read())
    import torch
    import transformers

    timeline.mark(stages.RUNTIME_INIT)
    device = job["device"] if job["device"] != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[job["dtype"]]
    with timeline.stage(stages.TOKENIZER):
        transformers.AutoTokenizer.from_pretrained(job["model"])
    # transformers 5 renamed torch_dtype to dtype
    dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    with timeline.stage(stages.WEIGHTS):
        model = transformers.AutoModelForCausalLM.from_pretrained(job["model"], **{dtype_arg: dtype})
        model = model.to(device).eval()
        _synchronize(torch, device)
    with timeline.stage(stages.FIRST_TOKEN):
        ids = torch.tensor([job["prompt_ids"]], device=device)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        _synchronize(torch, device)
    print(json.dumps(timeline.as_json()))
    return 0


def _synchronize(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
