"""Tests of hflow.utils.torch_functional against plain-loop references and hand-worked cases."""

import math

import pytest
import torch

from hflow.utils import torch_functional as tf


def _rand_mask(gen: torch.Generator, shape: tuple[int, ...], p: float = 0.6) -> torch.Tensor:
    return (torch.rand(shape, generator=gen) < p).long()


# ------------------------------------------------------------------ masked statistics


def test_masked_mean_hand_cases():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.tensor([1, 0, 0, 1])
    assert tf.masked_mean(values, mask).item() == pytest.approx(2.5)
    values[1] = float("nan")  # outside the mask: ignored
    assert tf.masked_mean(values, mask).item() == pytest.approx(2.5)
    values[0] = float("nan")  # inside the mask: propagates
    assert math.isnan(tf.masked_mean(values, mask).item())


def test_masked_mean_axis_and_empty_rows():
    values = torch.tensor([[1.0, 2.0, 3.0], [float("inf"), 5.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    out = tf.masked_mean(values, mask, axis=-1)
    assert torch.equal(out, torch.tensor([1.5, 0.0]))
    assert tf.masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_masked_sum_ignores_nan_and_inf_outside_mask():
    values = torch.tensor([[1.0, float("nan")], [float("-inf"), 2.0]])
    mask = torch.tensor([[1, 0], [0, 1]])
    assert tf.masked_sum(values, mask).item() == 3.0
    assert torch.equal(tf.masked_sum(values, mask, axis=0), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_matches_loop(seed, unbiased):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = _rand_mask(gen, (5, 7))
    values[mask == 0] = float("nan")
    kept = [values[i, j].item() for i in range(5) for j in range(7) if mask[i, j]]
    mean = sum(kept) / len(kept)
    ref = sum((x - mean) ** 2 for x in kept) / (len(kept) - 1 if unbiased else len(kept))
    assert tf.masked_var(values, mask, unbiased=unbiased).item() == pytest.approx(ref, rel=1e-12)


def test_masked_var_needs_enough_elements():
    values = torch.tensor([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="no element"):
        tf.masked_var(values, torch.zeros(3))
    with pytest.raises(ValueError, match="two"):
        tf.masked_var(values, torch.tensor([0, 1, 0]))
    assert tf.masked_var(values, torch.tensor([0, 1, 0]), unbiased=False).item() == 0.0


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_loop_and_nan_outside_cannot_leak(shift_mean):
    gen = torch.Generator().manual_seed(3)
    values = 3 + 2 * torch.randn(4, 6, generator=gen, dtype=torch.float64)
    mask = _rand_mask(gen, (4, 6))
    kept = [values[i, j].item() for i in range(4) for j in range(6) if mask[i, j]]
    mean = sum(kept) / len(kept)
    var = sum((x - mean) ** 2 for x in kept) / (len(kept) - 1)
    poisoned = values.masked_fill(mask == 0, float("nan"))
    out = tf.masked_whiten(poisoned, mask, shift_mean=shift_mean)
    for i in range(4):
        for j in range(6):
            if mask[i, j]:
                ref = (values[i, j].item() - mean) / math.sqrt(var + 1e-8) + (0 if shift_mean else mean)
                assert out[i, j].item() == pytest.approx(ref, rel=1e-10)


# ------------------------------------------------------------------ entropy and log-probs


def test_entropy_from_logits_matches_loop():
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(3, 4, 9, generator=gen, dtype=torch.float64)
    out = tf.entropy_from_logits(logits)
    for idx in [(0, 0), (1, 2), (2, 3)]:
        row = logits[idx].tolist()
        z = sum(math.exp(x) for x in row)
        ref = -sum((math.exp(x) / z) * (x - math.log(z)) for x in row)
        assert out[idx].item() == pytest.approx(ref, rel=1e-10)
    assert tf.entropy_from_logits(torch.zeros(7)).item() == pytest.approx(math.log(7))


def _naive_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 3 rows of 11 logits: several blocks and a ragged last one on small inputs."""
    monkeypatch.setattr(tf, "_CHUNK_ELEMENTS", 33)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logprobs_from_logits_matches_naive_value_and_grad(small_blocks, dtype):
    gen = torch.Generator().manual_seed(1)
    base = (4 * torch.randn(3, 9, 11, generator=gen, dtype=dtype)).requires_grad_()
    labels = torch.randint(0, 11, (3, 9), generator=gen)
    weights = torch.randn(3, 6, generator=gen, dtype=dtype)
    results = []
    for fn in (tf.logprobs_from_logits, _naive_logprobs):
        logits = base[:, 2:8]  # non-contiguous slice, as the actor takes logits[:, -L-1:-1]
        out = fn(logits, labels[:, 2:8])
        (grad,) = torch.autograd.grad((out * weights).sum(), base)
        results.append((out, grad))
    (out, grad), (ref_out, ref_grad) = results
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol)


def test_logprobs_from_logits_gradcheck(small_blocks):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    assert torch.autograd.gradcheck(lambda z: tf.logprobs_from_logits(z, labels), (logits,))


def test_logprobs_from_logits_half_precision_computes_in_fp32():
    gen = torch.Generator().manual_seed(4)
    logits = (5 * torch.randn(4, 50, generator=gen)).bfloat16().requires_grad_()
    labels = torch.randint(0, 50, (4,), generator=gen)
    out = tf.logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _naive_logprobs(logits.float(), labels), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_logprobs_from_logits_shape_mismatch():
    with pytest.raises(ValueError, match="do not match"):
        tf.logprobs_from_logits(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def _naive_entropy(logits: torch.Tensor) -> torch.Tensor:
    return -(torch.softmax(logits, dim=-1) * torch.log_softmax(logits, dim=-1)).sum(dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_entropy_from_logits_matches_naive_value_and_grad(small_blocks, dtype):
    gen = torch.Generator().manual_seed(5)
    base = (4 * torch.randn(3, 9, 11, generator=gen, dtype=dtype)).requires_grad_()
    weights = torch.randn(3, 6, generator=gen, dtype=dtype)
    results = []
    for fn in (tf.entropy_from_logits, _naive_entropy):
        out = fn(base[:, 2:8])  # non-contiguous slice, as the actor's logits can be
        (grad,) = torch.autograd.grad((out * weights).sum(), base)
        results.append((out, grad))
    (out, grad), (ref_out, ref_grad) = results
    assert out.dtype == dtype and out.shape == (3, 6)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol)


def test_entropy_from_logits_gradcheck(small_blocks):
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(6), dtype=torch.float64,
                         requires_grad=True)
    assert torch.autograd.gradcheck(tf.entropy_from_logits, (logits,))


def test_entropy_from_logits_half_precision_computes_in_fp32():
    logits = (5 * torch.randn(4, 50, generator=torch.Generator().manual_seed(7))).bfloat16().requires_grad_()
    out = tf.entropy_from_logits(logits)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _naive_entropy(logits.float()), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


class _NewTensorSizes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every tensor an op creates (outputs that are neither an input nor a view of one)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        inputs = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        self.sizes += [t.untyped_storage().nbytes() for t in leaves(out)
                       if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        return out


def test_entropy_from_logits_temporaries_are_bounded_by_one_block(monkeypatch):
    rows, vocab, block_rows = 64, 4096, 4
    monkeypatch.setattr(tf, "_CHUNK_ELEMENTS", block_rows * vocab)
    logits = torch.randn(4, rows // 4, vocab, generator=torch.Generator().manual_seed(8)).requires_grad_()
    full, block = rows * vocab * 4, block_rows * vocab * 4  # bytes in fp32

    def sizes(fn):
        with _NewTensorSizes() as forward:
            out = fn(logits)
        with _NewTensorSizes() as backward:
            out.sum().backward()
        return sorted(forward.sizes), sorted(backward.sizes)

    naive_forward, _ = sizes(_naive_entropy)
    assert naive_forward[-1] == full  # the plain formula builds whole (N, V) tensors
    forward, backward = sizes(tf.entropy_from_logits)
    assert forward[-1] <= block
    assert backward[-1] == full and backward[-2] <= block  # the gradient itself, then one block at most


# ------------------------------------------------------------------ masks, positions, padding


def test_get_response_mask():
    ids = torch.tensor([[5, 6, 2, 7, 2], [2, 4, 4, 4, 4], [5, 6, 7, 8, 9], [5, 9, 6, 3, 3]])
    assert tf.get_response_mask(ids, eos_token=2).tolist() == [
        [1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
    ]
    mask = tf.get_response_mask(ids, eos_token=[9, 2], dtype=torch.float32)
    assert mask.dtype == torch.float32
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


def test_compute_position_id_with_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert tf.compute_position_id_with_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def test_pad_helpers():
    x = torch.tensor([[1, 2], [3, 4]])
    assert tf.pad_sequence_to_length(x, 4, 0).tolist() == [[1, 2, 0, 0], [3, 4, 0, 0]]
    assert tf.pad_sequence_to_length(x, 3, 9, left_pad=True).tolist() == [[9, 1, 2], [9, 3, 4]]
    assert tf.pad_sequence_to_length(x, 1, 0) is x
    assert tf.pad_2d_list_to_length([[1], [2, 3, 4]], pad_token_id=0).tolist() == [[1, 0, 0], [2, 3, 4]]
    assert tf.pad_2d_list_to_length([[1]], pad_token_id=7, max_length=3).tolist() == [[1, 7, 7]]


# ------------------------------------------------------------------ learning-rate schedules


def _lrs(make_scheduler, steps: int = 5) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = make_scheduler(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_constant_schedule_with_warmup():
    lrs = _lrs(lambda opt: tf.get_constant_schedule_with_warmup(opt, num_warmup_steps=2))
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 1e-3, 1e-3])


def test_cosine_schedule_with_warmup():
    lrs = _lrs(
        lambda opt: tf.get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=5, min_lr_ratio=0.1)
    )
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 7.75e-4, 3.25e-4])
    tail = _lrs(lambda opt: tf.get_cosine_schedule_with_warmup(opt, 0, 10, min_lr_ratio=0.2), steps=11)
    assert tail[0] == pytest.approx(1e-3) and tail[-1] == pytest.approx(2e-4)
    assert all(a >= b for a, b in zip(tail, tail[1:]))
