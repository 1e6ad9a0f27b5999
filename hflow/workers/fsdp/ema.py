"""An exponential moving average of a model's weights, kept beside an FSDP2-sharded model.

DeepSpeed-Chat keeps an EMA copy of the actor (decay 0.992) and reports that the EMA weights
often answer better than the final ones. After every optimizer step k the average is

    ema_k = decay * ema_{k-1} + (1 - decay) * param_k,     ema_0 = the initial weights,

so ema_k = decay^k * param_0 + (1 - decay) * sum_{j=1..k} decay^(k-j) * param_j.

Each rank averages only its own shards (the local tensors of the parameters' DTensors), in fp32,
so the EMA costs one fp32 copy of the rank's shards and no communication. `state_dict()` gives the
averages as DTensors with the parameters' placements, so `torch.distributed.checkpoint` saves them
beside the model and loads them at any world size; `iter_full()` gathers them one tensor at a time
under the model's Hugging Face names, for an export that `save_hf_model` writes like the model's own.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hflow.utils import device as device_utils
from hflow.workers.fsdp.params import checkpoint_layout, clean_param_name, local_tensor, named_weights

__all__ = ["ParamEMA"]


class ParamEMA:
    """EMA of `model`'s parameters with `decay`, starting at their current values.

    `device`: where the averages live (None: beside each parameter shard; "cpu" when the parameters are
    offloaded between phases, so that the averages never take device memory).
    """

    def __init__(self, model: nn.Module, decay: float, device: torch.device | str | None = None) -> None:
        if not 0.0 <= float(decay) < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.model = model
        self.decay = float(decay)
        self.device = device
        self.averages: dict[str, torch.Tensor] = {}
        for name, param in self._params():
            target = torch.device(device) if device is not None else local_tensor(param).device
            average = local_tensor(param).detach().to(torch.float32, copy=True)
            if isinstance(param, DTensor):
                average = DTensor.from_local(average, param.device_mesh, param.placements, run_check=False,
                                             shape=param.shape, stride=param.stride())
            if local_tensor(average).device != target:  # from_local puts host shards on the mesh's device
                average = average.to(target)
            self.averages[name] = average

    def _params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():  # tied parameters once, as the HF export
            yield clean_param_name(name), param

    @torch.no_grad()
    def update(self) -> None:
        """ema = decay * ema + (1 - decay) * param, shard by shard (call after each optimizer step)."""
        for name, param in self._params():
            average = local_tensor(self.averages[name])
            average.mul_(self.decay).add_(local_tensor(param).to(average.device, torch.float32), alpha=1.0 - self.decay)

    @torch.no_grad()
    def reset(self) -> None:
        """Restart the average at the current weights (a checkpoint written without an EMA)."""
        for name, param in self._params():
            local_tensor(self.averages[name]).copy_(local_tensor(param))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages themselves (DTensors when sharded): a checkpoint loader fills them in place."""
        return dict(self.averages)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self.averages) - set(state)
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}... ({len(missing)} parameters)")
        for name, average in self.averages.items():
            if state[name] is not average:
                local_tensor(average).copy_(local_tensor(state[name]))

    @torch.no_grad()
    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) as `params.iter_full_params` yields the model's, with the averages in
        place of the parameters, in the parameters' dtype; buffers are the model's. A collective: every
        rank must consume it in the same order."""
        compute_device = device_utils.get_device()
        for name, tensor in named_weights(self.model):
            if name in self.averages:
                average = self.averages[name]
                full = average.to(compute_device).full_tensor() if isinstance(average, DTensor) else average
                yield from checkpoint_layout(self.model, name, full.to(tensor.dtype))
            else:
                yield from checkpoint_layout(self.model, name, tensor.detach())
