"""The device helper's precision choices, for GPUs this machine does not have: the decisions take the
device's kind and compute capability as arguments, and the helper is made to answer as such a GPU would."""

from __future__ import annotations

import pytest
import torch

from hflow.utils import device
from hflow.workers.fsdp import default_mixed_precision

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(("capability", "compute", "rollout"), [
    ((9, 0), BF16, BF16),  # H100
    ((8, 0), BF16, BF16),  # A100
    ((8, 6), BF16, BF16),  # RTX 30xx, A10
    ((7, 5), FP32, FP16),  # T4: no bf16
    ((7, 0), FP32, FP16),  # V100
    ((6, 0), FP32, FP16),  # P100
])
def test_bf16_only_on_gpus_that_have_it(capability, compute, rollout):
    """Training computes in bf16 from Ampere (8.0) on and in fp32 before it (fp16 there would need a loss
    scaler); vLLM, which has no backward, generates in fp16 where bf16 is missing."""
    assert device.compute_dtype_for(True, capability) == compute
    assert device.rollout_dtype_for(True, capability) == rollout


def test_cpu_computes_and_generates_in_fp32():
    assert device.compute_dtype_for(False, None) == device.rollout_dtype_for(False, None) == FP32
    if not device.is_cuda():
        assert device.compute_dtype() == device.rollout_dtype() == FP32
        assert default_mixed_precision().param_dtype is None  # plain fp32


@pytest.mark.parametrize(("capability", "param_dtype", "rollout"), [((9, 0), BF16, BF16), ((7, 0), None, FP16)])
def test_this_gpus_capability_reaches_mixed_precision_and_the_rollout(monkeypatch, capability, param_dtype, rollout):
    """On a GPU without bf16 the FSDP default is plain fp32 (no param_dtype) and the engine's default fp16."""
    monkeypatch.setattr(device, "device_name", lambda: "cuda")
    monkeypatch.setattr(device, "cuda_capability", lambda: capability)
    policy = default_mixed_precision()
    assert policy.param_dtype == param_dtype
    assert policy.reduce_dtype == (FP32 if param_dtype else None)
    assert device.rollout_dtype() == rollout
