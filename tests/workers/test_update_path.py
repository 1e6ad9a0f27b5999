"""The actor's update path under the GPU's configuration (bf16 compute, fp32 master weights), checked on CPU.

Two kinds of tests (issue 33):

* **Operator counts**, a proxy for the host time that made the H100 update launch-bound: the aten operators
  that one update and one log-prob pass dispatch, counted by a `TorchDispatchMode`, against a plain PyTorch
  loop over the same model and batch (fp32 weights, bf16 autocast, log-softmax + gather, AdamW), on one rank
  (no FSDP2: compute copies cast once per pass) and on two (FSDP2 over gloo, gathered once per update). Each
  count may exceed what was measured by less than one operator per layer in every micro-batch's forward
  (`SLACK`): an operator added to each layer's forward fails them.
* **Equal results** of each new path and the old one: the fused LM head against the blocked log-prob and
  entropy of the full logits, the one-rank compute copies against FSDP2's mixed precision, gathering once
  per update against gathering per micro-batch, fused AdamW against foreach.
"""

from __future__ import annotations

import os
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from hflow.protocol import DataProto
from hflow.utils import device
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.workers.actor import DataParallelPPOActor
from hflow.workers.fsdp import build_optimizer, load_causal_lm
from tests.ranks import free_port, spawn_ranks
from tests.workers.test_dp_actor import actor_config, make_batch

BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}  # the GPU's default mixed precision
PROMPT, RESPONSE, ROWS, MICRO = 8, 8, 8, 2  # 4 micro-batches of 2 sequences
LAYERS = 8

# hflow's operators minus the plain loop's, as measured (torch 2.13.0, transformers 5.19.0; the counts do not
# depend on the load or on the data): one rank, update 8958 vs 9192 (0.975x), log-prob 2739 vs 3080 (0.889x);
# two ranks, update 9708 vs 9192 (1.056x), log-prob 2972 vs 3080 (0.965x). Differences, not counts: a
# library upgrade that changes the model's own operators moves both sides alike.
MEASURED_EXCESS = {"one rank": {"update": 8958 - 9192, "log_prob": 2739 - 3080},
                   "two ranks": {"update": 9708 - 9192, "log_prob": 2972 - 3080}}
# Half an operator per layer in each micro-batch's forward: one more per layer adds 8 x 4 = 32 to the log-prob
# pass (and at least as many to the update), and fails; the old bound of 1.2x let through 600 more.
SLACK = LAYERS * (ROWS // MICRO) // 2


def assert_within_measured(where: str, update: int, log_prob: int, plain_update: int, plain_lp: int) -> None:
    excess = {"update": update - plain_update, "log_prob": log_prob - plain_lp}
    print(f"{where}: update {update} ops vs plain {plain_update}; log-prob {log_prob} vs {plain_lp}")
    for pass_, measured in MEASURED_EXCESS[where].items():
        assert excess[pass_] <= measured + SLACK, (where, pass_, excess[pass_], measured, SLACK)


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight layers, so that per-layer costs (what the H100's 28 layers pay) dominate the fixed ones."""
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=128, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("qwen2-deep")
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def full_batch(n: int = ROWS, seed: int = 0) -> DataProto:
    """Full rows (no padding), as the plain loop takes them; advantages and old log-probs given."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (n, PROMPT + RESPONSE), generator=gen)
    mask = torch.ones_like(ids)
    return DataProto.from_dict({
        "input_ids": ids, "responses": ids[:, PROMPT:], "attention_mask": mask,
        "position_ids": compute_position_id_with_mask(mask), "response_mask": mask[:, PROMPT:],
        "advantages": torch.randn(n, RESPONSE, generator=gen),
        "old_log_probs": -torch.rand(n, RESPONSE, generator=gen) - 4.0,
    }, meta_info={"temperature": 1.0, "micro_batch_size": MICRO})


class OpCounter(TorchDispatchMode):
    """Counts every aten operator dispatched while active (forward, backward and optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def counted(fn) -> OpCounter:
    fn()  # warm: optimizer state, caches
    with OpCounter() as counter:
        fn()
    return counter


def plain_loop_counts(model_path: str, data: DataProto) -> tuple[int, int]:
    """(update, log-prob pass) operator counts of the plain loop: fp32 weights under bf16 autocast, the
    full logits' log-softmax + gather, AdamW as the device helper picks it (foreach here, fused on a GPU)."""
    model = load_causal_lm(model_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    ids, adv = data.batch["input_ids"], data.batch["advantages"]

    def log_probs(rows: slice) -> torch.Tensor:
        with torch.autocast(device.device_name(), dtype=torch.bfloat16):
            logits = model(input_ids=ids[rows]).logits[:, PROMPT - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[rows, PROMPT:, None]).squeeze(-1)

    def update() -> None:
        for start in range(0, ROWS, MICRO):
            rows = slice(start, start + MICRO)
            (-(log_probs(rows) * adv[rows]).mean() / (ROWS // MICRO)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def log_prob_pass() -> None:
        with torch.no_grad():
            for start in range(0, ROWS, MICRO):
                log_probs(slice(start, start + MICRO))

    return counted(update).total, counted(log_prob_pass).total


def hflow_counts(model, data: DataProto) -> tuple[OpCounter, OpCounter]:
    """(update, log-prob pass) operators of hflow's actor, its log-prob blocks sized as on a GPU."""
    config = actor_config(ppo_mini_batch_size_per_rank=data.batch.batch_size[0], ppo_micro_batch_size_per_gpu=MICRO,
                          logit_block_elements=device.LOGIT_BLOCK_ELEMENTS["cuda"])
    actor = DataParallelPPOActor(config, model, build_optimizer(model.parameters(), config.optim))
    return counted(lambda: actor.update_policy(data)), counted(lambda: actor.compute_log_prob(data))


def bf16_actor_model(model_path: str, mesh):
    from hflow.workers.fsdp import apply_fsdp2

    return apply_fsdp2(load_causal_lm(model_path), mesh, mixed_precision=BF16)


def test_one_rank_update_dispatches_no_more_than_measured_against_the_plain_loop(deep_model_dir: Path, world_of_one):
    data = full_batch()
    plain_update, plain_lp = plain_loop_counts(str(deep_model_dir), data)
    model = bf16_actor_model(str(deep_model_dir), world_of_one)
    update_ops, log_prob_ops = hflow_counts(model, data)
    update, log_prob = update_ops.total, log_prob_ops.total
    # no FSDP2 on one rank: none of its operators (its gradient reduction's chunk_cat, its copy-in)
    fsdp_ops = {name: n for name, n in (update_ops.ops + log_prob_ops.ops).items() if name.startswith("fsdp.")}
    assert not fsdp_ops, fsdp_ops
    assert_within_measured("one rank", update, log_prob, plain_update, plain_lp)


def _two_rank_counts(rank: int, port: int, model_path: str, out: str) -> None:
    os.environ.update(HFLOW_DEVICE="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from hflow.workers.fsdp import build_device_mesh

    dist.init_process_group(device.dist_backend(), rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        data = full_batch(seed=rank)
        model = bf16_actor_model(model_path, build_device_mesh(2))
        counts = tuple(counter.total for counter in hflow_counts(model, data))
        if rank == 0:
            torch.save({"hflow": counts, "plain": plain_loop_counts(model_path, data)}, out)
    finally:
        dist.destroy_process_group()


def test_two_rank_update_dispatches_no_more_than_measured_against_the_plain_loop(deep_model_dir: Path, tmp_path: Path):
    out = tmp_path / "counts.pt"
    spawn_ranks(_two_rank_counts, 2, free_port(), str(deep_model_dir), str(out))
    counts = torch.load(out)
    (update, log_prob), (plain_update, plain_lp) = counts["hflow"], counts["plain"]
    assert_within_measured("two ranks", update, log_prob, plain_update, plain_lp)


# ------------------------------------------------------------------ each new path equals the old one


def forward_and_grads(model, data: DataProto, temperature: float, **overrides):
    """Log-probs, entropies and the gradients of sum(a * log p) + sum(b * H) over every parameter, through the
    actor's forward (padded rows, or packed with `use_remove_padding`)."""
    actor = DataParallelPPOActor(actor_config(**overrides), model)
    batch = data.batch
    model.zero_grad(set_to_none=True)
    log_probs, entropy = actor._forward_micro_batch(batch, temperature, calculate_entropy=True)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(log_probs.shape, generator=gen), torch.randn(entropy.shape, generator=gen)
    mask = batch["response_mask"]
    ((log_probs * a * mask).sum() + (entropy * b * mask).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return log_probs.detach() * mask, entropy.detach() * mask, grads


@pytest.mark.parametrize("packed", [False, True])
def test_fused_lm_head_equals_the_full_logits_path(deep_model_dir: Path, packed: bool):
    """fp32, temperature 0.7, blocks of 3 rows: log-probs, entropies and every gradient within 1e-5."""
    data = make_batch(6, seed=4)
    model = load_causal_lm(str(deep_model_dir))
    common = dict(use_remove_padding=packed, logit_block_elements=3 * 128)
    reference = forward_and_grads(model, data, 0.7, **common)
    fused = forward_and_grads(model, data, 0.7, fused_lm_head=True, **common)
    for old, new in zip(reference[:2], fused[:2], strict=True):
        torch.testing.assert_close(new, old, atol=1e-5, rtol=1e-5)
    for name, grad in reference[2].items():
        torch.testing.assert_close(fused[2][name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_fused_lm_head_refuses_a_head_it_cannot_stand_in_for(deep_model_dir: Path):
    from hflow.utils.lm_head import output_layer

    model = load_causal_lm(str(deep_model_dir))
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="fused_lm_head=false"):
        output_layer(model)


def _mixed_update(model, data: DataProto) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of a no-grad pass, then the parameters after one SGD step of an update in four
    micro-batches (SGD: the change is lr x the accumulated gradient)."""
    from hflow.workers.fsdp import iter_full_params

    actor = DataParallelPPOActor(actor_config(ppo_mini_batch_size_per_rank=ROWS, ppo_micro_batch_size_per_gpu=MICRO,
                                              entropy_coeff=0.01),
                                 model, torch.optim.SGD(model.parameters(), lr=0.5))
    log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
    actor.update_policy(data)
    return {name: t.clone() for name, t in iter_full_params(model)}, log_probs, entropy


def test_one_rank_compute_copies_equal_fsdp2_mixed_precision(deep_model_dir: Path, world_of_one):
    """bf16 compute, fp32 master weights: the plain model with compute copies (cast once per pass, gradients
    accumulated in fp32) steps exactly as FSDP2's one-rank mixed precision does."""
    from hflow.workers.fsdp import apply_fsdp2, compute_weights
    from torch.distributed.fsdp import FSDPModule

    data = full_batch()
    plain = bf16_actor_model(str(deep_model_dir), world_of_one)
    assert not isinstance(plain, FSDPModule)
    assert all(p.dtype == torch.float32 for p in plain.parameters())  # masters: what checkpoints read
    with compute_weights(plain, accumulate_grads=False):
        assert all(p.dtype == torch.bfloat16 for p in plain.parameters())
    wrapped = apply_fsdp2(load_causal_lm(str(deep_model_dir)), world_of_one, mixed_precision=BF16,
                          fsdp_on_one_rank=True)
    params, log_probs, entropy = _mixed_update(plain, data)
    fsdp_params, fsdp_log_probs, fsdp_entropy = _mixed_update(wrapped, data)
    torch.testing.assert_close(log_probs, fsdp_log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, fsdp_entropy, atol=1e-5, rtol=1e-5)
    initial = load_causal_lm(str(deep_model_dir)).state_dict()
    for name, value in fsdp_params.items():
        assert not torch.equal(value, initial[name]), name  # every weight moved
        torch.testing.assert_close(params[name], value, atol=1e-5, rtol=1e-5, msg=name)


def _gather_once_main(rank: int, port: int, model_path: str, out: str) -> None:
    os.environ.update(HFLOW_DEVICE="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from hflow.workers.fsdp import apply_fsdp2, build_device_mesh, iter_full_params

    dist.init_process_group(device.dist_backend(), rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        data = full_batch(seed=rank)
        results = {}
        for once in (False, True):
            model = apply_fsdp2(load_causal_lm(model_path), build_device_mesh(2), gather_once_per_update=once)
            config = actor_config(ppo_mini_batch_size_per_rank=ROWS, ppo_micro_batch_size_per_gpu=MICRO)
            actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=0.5))
            metrics = actor.update_policy(data)
            results[once] = ({name: t.clone() for name, t in iter_full_params(model)}, metrics["actor/grad_norm"])
            assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())  # resharded
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_gathering_once_per_update_equals_gathering_per_micro_batch(deep_model_dir: Path, tmp_path: Path):
    """fp32, two ranks, four micro-batches: one gather and one reduce-scatter per update step the weights as
    a gather and a reduce-scatter per micro-batch do."""
    out = tmp_path / "params.pt"
    spawn_ranks(_gather_once_main, 2, free_port(), str(deep_model_dir), str(out))
    results = torch.load(out)
    (per_micro, norm_per_micro), (once, norm_once) = results[False], results[True]
    assert norm_once == pytest.approx(norm_per_micro, rel=1e-5)
    initial = load_causal_lm(str(deep_model_dir)).state_dict()
    for name, value in per_micro.items():
        assert not torch.equal(value, initial[name]), name
        torch.testing.assert_close(once[name], value, atol=1e-5, rtol=1e-5, msg=name)


def test_optimizer_kernel_is_fused_on_gpu_foreach_elsewhere_and_both_step_alike(deep_model_dir: Path):
    from hflow.workers.config import OptimConfig
    from omegaconf import OmegaConf

    assert device.optimizer_kernel("cuda:0") == "fused"
    assert device.optimizer_kernel("cpu") == "foreach"
    assert device.optimizer_kernel("cuda:0", "foreach") == "foreach"
    with pytest.raises(ValueError, match="fused"):
        device.optimizer_kernel("cpu", "apex")
    stepped = {}
    for kernel in ("foreach", "fused"):
        model = load_causal_lm(str(deep_model_dir))
        optimizer = build_optimizer(model.parameters(), OmegaConf.structured(OptimConfig(lr=1e-2, kernel=kernel)))
        assert optimizer.defaults["fused"] == (kernel == "fused")
        for step in range(2):
            torch.manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            optimizer.step()
        stepped[kernel] = model.state_dict()
    for name, value in stepped["foreach"].items():
        torch.testing.assert_close(stepped["fused"][name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_logit_blocks_are_sized_for_the_device(monkeypatch):
    from hflow.utils import torch_functional

    assert device.logit_block_elements() == device.LOGIT_BLOCK_ELEMENTS["cpu"]
    monkeypatch.setattr(device, "device_name", lambda: "cuda")
    assert device.logit_block_elements() == 1 << 28
    assert torch_functional.block_elements_for(None) == 1 << 28
    assert torch_functional.block_elements_for(1000) == 1000
