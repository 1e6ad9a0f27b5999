"""An exact copy of one trainable model's state in host memory, restored in place.

The health watch (`trainer.health`) keeps the last healthy state of the actor and the critic this way:
every step it copies what an update changes (this rank's shards of the trainable parameters, the
optimizer state, the scheduler and the optimizer's hyperparameters, and extra tensors such as an EMA of
the weights) into host buffers it reuses, and a rollback copies them back into the live tensors. Frozen
parameters (a LoRA model's base weights) never change, so they are not copied. Nothing on the device is
reallocated, so a restore leaves FSDP's sharded parameters, the optimizer's references to them and any
offloading exactly as they were.
"""

from __future__ import annotations

import copy
from typing import Iterator

import torch
from torch.optim import Optimizer

from hflow.utils import device
from hflow.workers.fsdp.params import local_tensor


class HostSnapshot:
    """`take()` copies the state of `module` (+ `optimizer`, `scheduler`, `extra` tensors) to host memory;
    `restore()` writes the copy back, bit for bit. Call both on every rank (each copies its own shards)."""

    def __init__(self, module: torch.nn.Module, optimizer: Optimizer | None = None, scheduler=None,
                 extra: dict[str, torch.Tensor] | None = None):
        self.module = module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.extra = extra or {}
        self._host: dict[str, torch.Tensor] = {}  # host buffers, allocated at the first take and reused
        self._optim_params_with_state: list[bool] = []
        self._optim_other: dict[int, dict] = {}  # non-tensor optimizer state entries
        self._param_groups: list[dict] = []
        self._scheduler_state: dict | None = None
        self.taken = False

    def _optim_params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]] if self.optimizer else []

    def _live(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, this rank's live tensor) of everything a training step changes."""
        for name, param in self.module.named_parameters():
            if param.requires_grad:
                yield f"param/{name}", local_tensor(param)
        for i, param in enumerate(self._optim_params()):
            for key, value in self.optimizer.state.get(param, {}).items():
                if torch.is_tensor(value):
                    yield f"optim/{i}/{key}", local_tensor(value)
        for name, tensor in self.extra.items():
            yield f"extra/{name}", local_tensor(tensor)

    @torch.no_grad()
    def take(self) -> None:
        pin = device.is_cuda()
        for key, live in self._live():
            host = self._host.get(key)
            if host is None or host.shape != live.shape or host.dtype != live.dtype:
                host = self._host[key] = torch.empty(live.shape, dtype=live.dtype, device="cpu", pin_memory=pin)
            host.copy_(live, non_blocking=pin)
        params = self._optim_params()
        self._optim_params_with_state = [param in self.optimizer.state and bool(self.optimizer.state[param])
                                         for param in params]
        self._optim_other = {i: {k: copy.deepcopy(v) for k, v in self.optimizer.state[p].items() if not torch.is_tensor(v)}
                             for i, p in enumerate(params) if self._optim_params_with_state[i]}
        self._param_groups = [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
                              for group in (self.optimizer.param_groups if self.optimizer else [])]
        self._scheduler_state = copy.deepcopy(self.scheduler.state_dict()) if self.scheduler is not None else None
        device.synchronize()  # the copies are complete before the next update writes the live tensors
        self.taken = True

    @torch.no_grad()
    def restore(self) -> None:
        if not self.taken:
            raise RuntimeError("HostSnapshot.restore() before any take()")
        params = self._optim_params()
        for i, param in enumerate(params):  # state the optimizer created after the snapshot goes
            if not self._optim_params_with_state[i]:
                self.optimizer.state.pop(param, None)
        for key, live in self._live():
            host = self._host.get(key)
            if host is None:
                raise RuntimeError(f"HostSnapshot: {key} appeared after the snapshot was taken; cannot restore it")
            live.copy_(host, non_blocking=True)
        for i, other in self._optim_other.items():
            self.optimizer.state[params[i]].update(copy.deepcopy(other))
        for group, saved in zip(self.optimizer.param_groups if self.optimizer else [], self._param_groups):
            group.update(copy.deepcopy(saved))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(self._scheduler_state))
        device.synchronize()
