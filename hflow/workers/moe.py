"""Mixture-of-experts models in the trainer: finding the routers, router replay, the load-balancing loss and
expert-load metrics.

A Hugging Face MoE block (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) calls its router on the flattened tokens of
the forward, (N, hidden) -> (router_logits (N, E), weights (N, k), indices (N, k)). Everything here works by
forward hooks on those routers, so no model code is copied or patched:

* **Router replay** (`actor.router_replay`, "R3"): the sampler records, for every token it ran, the k experts
  each MoE layer chose (`routed_experts`, (B, T, R, k) int16 in the rollout's (B, T) layout; -1 where it ran
  no forward: padding, and a response's last token). The actor's forward then routes each recorded token to
  those experts instead of its own top-k, so the trainer scores the policy that sampled even where a small
  weight change (or a kernel's rounding) would flip a router's choice. The mixing weights are the softmax of
  the trainer's own logits, taken at the replayed experts (renormalised over them where the model
  renormalises its top-k), so the router still gets its gradient.
* **The load-balancing loss** (Switch Transformer, as transformers computes it for these models, so the
  model's own `router_aux_loss_coef` means the same): with f_e the share of the N valid tokens' top-k slots
  routed to expert e and P_e the mean router probability of e, both averaged over the R MoE layers,

      aux = E * sum_e f_e * P_e          (k when routing and probabilities are uniform; at most E)

  f_e counts the experts the forward used (the replayed ones under replay); the gradient flows through P_e.
* **Expert load** per MoE layer: load_e = f_e / sum f (a share, summing to 1); `expert_load_max` / `_min` are
  E * max_e / min_e load_e, averaged over layers (1 = perfectly balanced, E = all on one expert).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NOT_ROUTED", "RouterTrace", "RoutingRecorder", "check_moe_settings", "is_moe_config", "moe_routers",
           "route_and_trace"]

NOT_ROUTED = -1  # a (token, layer) the sampler ran no forward for: the trainer routes it itself


def is_moe_config(hf_config: Any) -> bool:
    """The model config describes a mixture of experts (top-k routing over several experts)."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    return bool(experts) and int(experts) > 1 and bool(getattr(hf_config, "num_experts_per_tok", None))


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers of `model`, in layer order: modules with `top_k`, `num_experts` and a `weight`
    whose forward returns (logits, weights, indices) (transformers' `*TopKRouter` classes)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")]


@dataclass
class RouterTrace:
    """What one forward's routers did, layer by layer (each (N, ...) in the forward's token order)."""

    logits: list[torch.Tensor] = field(default_factory=list)  # (N, E), with their graph
    used: list[torch.Tensor] = field(default_factory=list)  # (N, k) the experts the forward routed to
    own: list[torch.Tensor] = field(default_factory=list)  # (N, k) the router's own top-k

    def aux_loss(self, valid: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss (module docstring) over the tokens where `valid` (N,) is true."""
        num_experts = self.logits[0].shape[-1]
        weight = valid.float()
        count = weight.sum().clamp(min=1.0) * len(self.logits)
        slots = torch.zeros(num_experts, device=weight.device)
        prob = torch.zeros(num_experts, device=weight.device)
        for logits, used in zip(self.logits, self.used):
            top_k = used.shape[-1]
            slots = slots.scatter_add(0, used.reshape(-1), weight.repeat_interleave(top_k))
            prob = prob + (F.softmax(logits.float(), dim=-1) * weight[:, None]).sum(0)
        return num_experts * ((slots / count) * (prob / count)).sum()

    @torch.no_grad()
    def expert_load(self, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """`expert_load_max` / `expert_load_min` (module docstring), layer means."""
        num_experts = self.logits[0].shape[-1]
        highs, lows = [], []
        for used in self.used:
            slots = torch.bincount(used[valid].reshape(-1), minlength=num_experts).float()
            load = slots / slots.sum().clamp(min=1.0)
            highs.append(load.max() * num_experts)
            lows.append(load.min() * num_experts)
        return {"expert_load_max": torch.stack(highs).mean(), "expert_load_min": torch.stack(lows).mean()}

    @torch.no_grad()
    def routing_match(self, replayed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(matching, recorded): how many recorded (token, layer) pairs of `replayed` (N, R, k) the
        router's own top-k agrees with (as a set), and how many were recorded."""
        matching = torch.zeros((), device=replayed.device)
        recorded = torch.zeros((), device=replayed.device)
        for layer, own in enumerate(self.own):
            want = replayed[:, layer].to(own.device, torch.long)
            has = (want >= 0).all(-1)
            same = (own.sort(-1).values == want.sort(-1).values).all(-1)
            matching = matching + (same & has).sum()
            recorded = recorded + has.sum()
        return matching, recorded


@contextmanager
def route_and_trace(model: nn.Module, replay: torch.Tensor | None = None) -> Iterator[RouterTrace]:
    """Trace the routers of `model` for one forward; with `replay` (N, R, k) in the forward's token order,
    route every recorded token (no -1 in its row) to the recorded experts.

    The hooks are removed on exit; a recomputation under activation checkpointing must run inside the same
    block (the trainer keeps it open over backward) so that it routes as the forward did."""
    routers = moe_routers(model)
    if replay is not None and replay.shape[1] != len(routers):
        raise ValueError(f"routed_experts has {replay.shape[1]} MoE layers, the model {len(routers)} routers")
    trace = RouterTrace()
    layer_of = {id(router): layer for layer, router in enumerate(routers)}

    def hook(router: nn.Module, args: Any, output: tuple) -> tuple | None:
        logits, weights, own = output
        layer = layer_of[id(router)]
        used, out = own, None
        if replay is not None:
            want = replay[:, layer].to(own.device, torch.long)
            used = torch.where((want >= 0).all(-1, keepdim=True), want, own)
            mixing = F.softmax(logits.float(), dim=-1).gather(-1, used)
            if getattr(router, "norm_topk_prob", True):  # Mixtral's router always renormalises
                mixing = mixing / mixing.sum(-1, keepdim=True)
            out = (logits, mixing.to(weights.dtype), used)
        if len(trace.logits) < len(routers):  # a checkpointed layer's recomputation traces nothing new
            trace.logits.append(logits)
            trace.used.append(used.detach())
            trace.own.append(own.detach())
        return out

    handles = [router.register_forward_hook(hook) for router in routers]
    try:
        yield trace
    finally:
        for handle in handles:
            handle.remove()


class RoutingRecorder:
    """Records the experts a model's routers choose while HF `generate` runs (the HF rollout's sampler side
    of router replay). Every forward call of a router sees the (rows, new columns) of that step: the prompt
    columns at prefill, then one column per decoding step."""

    def __init__(self, model: nn.Module, rows: int) -> None:
        self.routers = moe_routers(model)
        self.steps: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.rows = rows  # the batch rows generate runs (prompts x samples)
        self.handles: list[Any] = []

    def __enter__(self) -> RoutingRecorder:
        layer_of = {id(router): layer for layer, router in enumerate(self.routers)}

        def hook(router: nn.Module, args: Any, output: tuple) -> None:
            indices = output[2].detach()
            self.steps[layer_of[id(router)]].append(indices.reshape(self.rows, -1, indices.shape[-1]).cpu())

        self.handles = [router.register_forward_hook(hook) for router in self.routers]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()

    def routed_experts(self, rows: int, columns: int) -> torch.Tensor:
        """(rows, columns, R, k) int16: the recorded experts of the first `columns` columns (-1 where no
        forward ran)."""
        layers = [torch.cat(steps, dim=1) for steps in self.steps]
        recorded = torch.stack(layers, dim=2).to(torch.int16)[:, :columns]
        out = torch.full((rows, columns, *recorded.shape[2:]), NOT_ROUTED, dtype=torch.int16)
        out[:, : recorded.shape[1]] = recorded
        return out


def check_moe_settings(config: Any) -> None:
    """`actor.router_replay` and a set `actor.router_aux_loss_coef` need an MoE model (read from its
    config.json); replay needs a rollout that records routing: one-turn generation with the whole batch
    under one policy (no multi-turn, continuous admission, partial rollouts or updates in flight)."""
    import json
    from pathlib import Path

    from hflow.utils.errors import ConfigError

    arr = config.actor_rollout_ref
    actor, rollout, prefix = arr.actor, arr.rollout, "actor_rollout_ref.actor"
    asked = [key for key, on in (("router_replay", bool(actor.router_replay)),
                                 ("router_aux_loss_coef", bool(actor.router_aux_loss_coef))) if on]
    if not asked:
        return
    model_config = json.loads((Path(str(arr.model.path)).expanduser() / "config.json").read_text())

    class _Config:  # the config.json's keys as attributes, for is_moe_config
        def __init__(self, values: dict) -> None:
            self.__dict__.update(values.get("text_config") or values)

    if not is_moe_config(_Config(model_config)):
        raise ConfigError(
            f"{prefix}.{asked[0]} is for mixture-of-experts models, but {arr.model.path} is dense "
            f"({model_config.get('model_type')}: no num_experts / num_experts_per_tok); remove it "
            f"(router_replay=false, router_aux_loss_coef=null)")
    if actor.router_replay:
        unsupported = [(rollout.multi_turn.enable, "actor_rollout_ref.rollout.multi_turn.enable=true"),
                       (rollout.admission == "continuous", "actor_rollout_ref.rollout.admission=continuous"),
                       (rollout.partial_rollout, "actor_rollout_ref.rollout.partial_rollout=true"),
                       (int(config.trainer.async_steps) >= 2, "trainer.async_steps >= 2")]
        for on, key in unsupported:
            if on:
                raise ConfigError(f"{prefix}.router_replay=true records routing only for one-turn generation under "
                                  f"one policy; it cannot be combined with {key} yet")
        if rollout.name == "vllm" and rollout.enforce_eager is False:
            raise ConfigError(f"{prefix}.router_replay=true records routing with a host callback in every MoE layer's "
                              "forward, which CUDA graphs and vLLM's compiled model do not run: leave "
                              "actor_rollout_ref.rollout.enforce_eager null (eager while recording) or set it true")
