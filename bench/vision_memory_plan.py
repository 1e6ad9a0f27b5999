"""The memory plan's vision-tower share (a trace on fake tensors, `hflow.trainer.memory.trace._run_vision`)
against the same pass run for real on CPU: the tiny Qwen2-VL's tower on two sequences of two 16-token images
each, no-grad and with backward, counted by the same tracker.

    OMP_NUM_THREADS=1 python bench/vision_memory_plan.py        # writes bench/results/vision_memory_plan.md

The real pass runs transformers' SDPA path (images split, one SDPA each, outputs concatenated); the plan counts
the attention as a varlen kernel's (no N x N scores), so it may fall short of the real pass where that path
keeps more for backward.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from hflow.tasks.tiny_vision import build_vision_lm
from hflow.trainer.memory.trace import PassSpec, _PlainMemTracker, _peak, _vision_inputs, trace_fake
from hflow.utils.vision import vision_tower

MODEL_STATE = ("Sharded Param", "Sharded Grad", "Buffer", "OptState", "Total")  # counted by the pass's own trace


def held(peak: dict[str, int]) -> int:
    return sum(v for k, v in peak.items() if k not in MODEL_STATE)


def main() -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText

    with tempfile.TemporaryDirectory() as tmp:
        raw = json.loads((build_vision_lm(Path(tmp) / "vl") / "config.json").read_text())
    text = json.dumps({k: v for k, v in raw.items() if k not in ("architectures", "transformers_version", "dtype")},
                      sort_keys=True)
    rows = ["| pass | plan (fake trace) | real run | plan / real |", "|---|---|---|---|"]
    for train in (False, True):
        spec = PassSpec(model="causal", model_config=text, world=1, batch=2, seq=80, response=16, train=train,
                        image_tokens=(16, 16))
        plan = held(trace_fake(spec))
        config = AutoConfig.for_model(**json.loads(text))
        torch.manual_seed(0)
        tower = vision_tower(AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa"))
        tower.train(train)
        tower.requires_grad_(train)
        inputs = _vision_inputs(spec, config.vision_config)
        tracker = _PlainMemTracker()
        tracker.track_external(tower)
        with tracker, torch.set_grad_enabled(train):
            pixels = torch.randn((inputs["patches"], inputs["channels"]))
            merged = tower(pixels, grid_thw=inputs["grid_thw"]).pooler_output
            if train:
                merged.float().sum().backward()
        real = held(_peak(tracker))
        rows.append(f"| {'forward + backward' if train else 'no-grad forward'} | {plan} B | {real} B | "
                    f"{plan / real:.2f} |")
    out = "\n".join(["# Vision tower: memory plan vs a real CPU pass", "",
                     "`OMP_NUM_THREADS=1 python bench/vision_memory_plan.py` (tiny Qwen2-VL: 2 vision blocks of 64, "
                     "2 sequences x two 16-token images, 256 patches; activations and pixels, not parameters)", "",
                     *rows, ""])
    Path(__file__).parent.joinpath("results", "vision_memory_plan.md").write_text(out)
    sys.stdout.write(out)


if __name__ == "__main__":
    main()
