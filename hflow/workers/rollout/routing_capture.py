"""The experts an in-process vLLM engine routes each token to: the sampler's side of router replay.

vLLM's own capture (`enable_return_routed_experts`) lives in its GPU model runner V2, which hflow does not
run (it pins V1 on every device: `vllm_env`). Its routers, though, take a capture callback on every backend (`BaseRouter.set_capture_fn`,
called with each forward's (tokens, k) top-k ids), and the engine runs in this process: `install` sets one
per MoE layer on the engine's worker (`collective_rpc`). At each forward the callback reads where the
step's tokens come from off the model runner (its batch's request ids, `query_start_loc` spans and
`positions`), so each request's experts are kept by token position; a token recomputed later (preemption,
a chunk) overwrites its own entry.

A request is found again by its tokens: a sample's prompt + response minus its last token are exactly the
tokens its request ran, so `take` keys every finished request by them (identical samples have identical
routing up to batch rounding, whichever they get). Prefix caching is off while recording (a cached block's
tokens run no forward, so their experts would be unknown).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

__all__ = ["install", "routed_experts_for", "take"]


class _EngineRouting:
    """Lives on the engine worker: per request id, token ids and experts by position."""

    def __init__(self, runner: Any, num_layers: int) -> None:
        self.runner = runner
        self.num_layers = num_layers
        self.tokens: dict[str, dict[int, int]] = defaultdict(dict)
        self.experts: dict[str, dict[int, np.ndarray]] = defaultdict(dict)
        self.step: list[tuple[str, np.ndarray, np.ndarray]] = []  # this forward's (request, rows, positions)
        self.layers: list[np.ndarray | None] = []

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if layer == 0:  # a new forward: where its tokens come from
            runner = self.runner
            num_reqs = runner.input_batch.num_reqs
            starts = runner.query_start_loc.np[: num_reqs + 1].copy()
            total = int(starts[-1])
            positions = runner.positions[:total].cpu().numpy()
            input_ids = runner.input_ids.cpu[:total].numpy()  # the step's token ids (a host buffer)
            self.step = [(req_id, np.arange(starts[i], starts[i + 1]), positions[starts[i]: starts[i + 1]])
                         for i, req_id in enumerate(runner.input_batch.req_ids[:num_reqs])]
            for req_id, rows, pos in self.step:
                self.tokens[req_id].update(zip(pos.tolist(), input_ids[rows].tolist()))
            self.layers = [None] * self.num_layers
        self.layers[layer] = topk_ids.detach().cpu().numpy()
        if layer == self.num_layers - 1:  # the forward's last MoE layer: store (tokens, R, k) by position
            experts = np.stack(self.layers, axis=1).astype(np.int16)
            for req_id, rows, pos in self.step:
                self.experts[req_id].update(zip(pos.tolist(), experts[rows]))

    def take(self) -> list[tuple[tuple[int, ...], np.ndarray]]:
        """(token ids, (len, R, k) experts) of every request seen, and forget them."""
        out = []
        for req_id, by_position in self.experts.items():
            length = max(by_position) + 1
            tokens = self.tokens[req_id]
            if len(by_position) != length or any(p not in tokens for p in range(length)):
                continue  # positions that ran no forward: cannot be replayed, the trainer routes them itself
            out.append((tuple(tokens[p] for p in range(length)), np.stack([by_position[p] for p in range(length)])))
        self.tokens.clear()
        self.experts.clear()
        return out


def _install(worker: Any) -> int:
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    runner = worker.model_runner
    missing = [name for name in ("input_batch", "query_start_loc", "positions", "input_ids") if not hasattr(runner, name)]
    if missing:  # GPU model runner V2 lays its batch out otherwise (and has enable_return_routed_experts)
        raise RuntimeError(f"router replay: {type(runner).__name__} has no {missing}; the capture reads vLLM's V1 "
                           "model runner (the CPU build's) and is not wired for this engine yet")
    moe = sorted((m for m in runner.get_model().modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)
    if not moe:
        raise ValueError("router replay: the engine's model has no MoE layer")
    monolithic = [m.layer_id for m in moe if getattr(getattr(m, "_quant_method", None), "is_monolithic", False)]
    if monolithic:  # such a kernel routes inside itself and never calls the router's capture callback
        raise RuntimeError(f"router replay: the engine's MoE layers {monolithic[:4]} run a monolithic expert kernel, "
                           "which routes without the router's capture callback; hflow cannot record their routing")
    routing = _EngineRouting(runner, len(moe))
    for index, module in enumerate(moe):
        module.router.set_capture_fn(lambda ids, index=index: routing.capture(index, ids))
    worker.hflow_routing = routing
    return len(moe)


def _take(worker: Any) -> list:
    return worker.hflow_routing.take()


def install(llm: Any) -> None:
    """Record routing on every worker of the in-process engine `llm`."""
    llm.collective_rpc(_install)


def take(llm: Any) -> dict[tuple[int, ...], list[np.ndarray]]:
    """Token ids -> the recorded experts of the requests that ran exactly them (this rank's engine)."""
    found: dict[tuple[int, ...], list[np.ndarray]] = defaultdict(list)
    for tokens, experts in llm.collective_rpc(_take)[0]:
        found[tokens].append(experts)
    return found


def routed_experts_for(found: dict, prompts: list[list[int]], responses: list[list[int]], width: int,
                       prompt_width: int, shape: tuple[int, int]) -> torch.Tensor:
    """(samples, width, R, k) int16 in the rollout's layout (prompt left-padded to `prompt_width`, then the
    response), -1 where nothing was recorded."""
    out = np.full((len(responses), width, *shape), -1, dtype=np.int16)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        ran = tuple(prompt) + tuple(response[:-1])
        candidates = found.get(ran)
        if not candidates:
            continue
        experts = candidates.pop() if len(candidates) > 1 else candidates[0]
        start = prompt_width - len(prompt)
        out[i, start: start + len(experts)] = experts
    return torch.from_numpy(out)
