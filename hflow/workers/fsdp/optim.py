"""The optimizer and learning-rate schedule of a worker's model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from hflow.utils import device
from hflow.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup



def build_optimizer(params: Iterable[nn.Parameter], optim_cfg: Any) -> Optimizer:
    """AdamW from the `optim` section (`lr`, `betas`, `weight_decay`, `kernel`; every key present: build one
    by hand from `hflow.trainer.config.default_config().actor_rollout_ref.actor.optim`). `kernel: auto` is
    fused where the parameters live on a GPU, foreach elsewhere (`device.optimizer_kernel`)."""
    params = list(params)
    betas = optim_cfg.betas
    where = params[0].device if params else device.get_device()
    kernel = device.optimizer_kernel(where, str(optim_cfg.kernel))
    return torch.optim.AdamW(
        params,
        lr=float(optim_cfg.lr),
        betas=(float(betas[0]), float(betas[1])),
        weight_decay=float(optim_cfg.weight_decay),
        fused=kernel == "fused",
        foreach=kernel == "foreach",
    )


def build_lr_scheduler(optimizer: Optimizer, optim_cfg: Any, total_steps: int) -> LambdaLR:
    """LR schedule of `optim.warmup_style` (`constant` or `cosine`) over `total_steps` optimizer-schedule
    steps. Warmup lasts `optim.lr_warmup_steps`, or when that is negative
    `int(optim.lr_warmup_steps_ratio * total_steps)`."""
    warmup = int(optim_cfg.lr_warmup_steps)
    if warmup < 0:
        warmup = int(float(optim_cfg.lr_warmup_steps_ratio) * total_steps)
    style = optim_cfg.warmup_style
    if style == "constant":
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    if style == "cosine":
        return get_cosine_schedule_with_warmup(
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=total_steps,
            min_lr_ratio=float(optim_cfg.min_lr_ratio),
            num_cycles=float(optim_cfg.num_cycles),
        )
    raise ValueError(f"optim.warmup_style={style!r} is not supported; use 'constant' or 'cosine'")
