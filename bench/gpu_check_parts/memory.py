"""Part d, memory: what the actor's log-probs and entropy cost beyond the logits at a real vocabulary
(32 x 1024 x 151936 bf16 logits), without autograd (the log-prob pass) and with it (an update with an
entropy bonus): a naive log-softmax makes fp32 copies of the logits, several GiB each. Target: the forward
passes, and what autograd keeps for backward, need under 4 GiB; the backward's extra is reported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import GiB, Part, cuda_memory, gib, reset_peak, sync

TITLE = "log-prob + entropy memory, 32 x 1024 x 152k logits"
TARGET = "< 4 GiB extra (forward)"


def _actor_entropy_fn():
    """The entropy function the actor calls, whatever its name in hflow.utils.torch_functional today."""
    from hflow.workers.actor import dp_actor

    found = {name: fn for name, fn in vars(dp_actor).items()
             if "entropy" in name and callable(fn) and getattr(fn, "__module__", "") == "hflow.utils.torch_functional"}
    if not found:
        raise RuntimeError("hflow.workers.actor.dp_actor imports no entropy function from hflow.utils.torch_functional")
    name = sorted(found)[0]
    return name, found[name]


def run(part: Part, smoke: bool, workdir: Path) -> None:
    import torch

    from hflow.utils import device
    from hflow.utils.torch_functional import logprobs_from_logits

    entropy_name, entropy_fn = _actor_entropy_fn()
    b, l, v = (2, 16, 1000) if smoke else (32, 1024, 151936)
    dev = device.get_device()
    limit = 4 * GiB
    logits_bytes = b * l * v * 2
    part.details.append(
        f"logits {b} x {l} x {v} in bf16 ({logits_bytes / GiB:.2f} GiB); `logprobs_from_logits` and "
        f"`{entropy_name}` (what DataParallelPPOActor calls) on the same logits. Extra = peak allocated GPU memory "
        "minus what was allocated before the call (the logits); for backward, minus one logits-sized gradient too. "
        "Target: forward extra (peak, and what autograd keeps for backward) < 4 GiB; backward is reported")

    def measure(grad: bool) -> dict[str, int] | None:
        reset_peak()
        logits = torch.randn(b, l, v, device=dev, dtype=torch.bfloat16).requires_grad_(grad)
        labels = torch.randint(0, v, (b, l), device=dev)
        sync()
        reset_peak()
        base = cuda_memory()
        with torch.set_grad_enabled(grad):
            log_probs = logprobs_from_logits(logits, labels)
            entropy = entropy_fn(logits).float()
            sync()
            forward = cuda_memory()
            if grad:
                reset_peak()
                (log_probs.sum() + entropy.sum()).backward()
                sync()
        backward = cuda_memory()
        if base is None:  # CPU smoke: no allocator statistics
            return None
        entry = {"forward_peak_extra": forward[1] - base[0]}
        if grad:
            entry["held_for_backward"] = forward[0] - base[0]
            entry["backward_peak_extra"] = backward[1] - base[0] - logits_bytes
        return entry

    results: dict[str, Any] = {}
    for label, grad in (("no grad (compute_log_prob)", False), ("autograd (update with entropy_coeff != 0)", True)):
        out_of_memory = False
        try:
            results[label] = measure(grad)
        except torch.OutOfMemoryError:
            out_of_memory = True  # handled below, once the traceback (and the tensors it holds) is gone
        if out_of_memory:
            reset_peak()
            results[label] = "out of memory"
    part.data.update(results)
    ok, lines, forward_extras = True, [], []
    for label, entry in results.items():
        if entry is None:
            lines.append(f"- {label}: no allocator statistics on CPU")
            continue
        if entry == "out of memory":
            ok = False
            lines.append(f"- {label}: **out of memory**")
            continue
        for key, value in entry.items():
            if key != "backward_peak_extra":
                forward_extras.append(value)
                ok = ok and value < limit
        lines.append(f"- {label}: " + ", ".join(f"{k.replace('_', ' ')} {gib(val)}" for k, val in entry.items()))
        backward = entry.get("backward_peak_extra")
        if backward is not None and backward >= logits_bytes / 2:
            lines.append(f"  - backward holds about {1 + backward / logits_bytes:.1f} logits-sized gradients at "
                         "once: each function's backward builds its own, and autograd then adds them")
    part.details.append("\n".join(lines))
    part.result = (f"forward extra at most {gib(max(forward_extras))}" if forward_extras
                   else "no measurement" if not ok else "no allocator statistics on CPU")
    part.status = "PASS" if ok else "FAIL"

