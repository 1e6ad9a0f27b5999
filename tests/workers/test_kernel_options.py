"""Issue 33, fewer kernels per layer and token budgets on GPU: packed attention through torch's varlen kernel
equals the per-sequence loop; `use_torch_compile` log-probs equal eager; `use_liger` stops in preflight without
its package or CUDA; the "by the device" keys resolve to the old behaviour on CPU and to token budgets the
memory plan fits on a (pretend) 80 GB GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hflow.utils import packing
from hflow.utils.errors import ConfigError

BOUNDS = (0, 5, 6, 14, 21)  # sequences of 5, 1, 8 and 7 tokens


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """varlen_attn's contract written another way (one SDPA over the row with a block-diagonal causal mask), to
    run the glue on CPU, where torch's FlashAttention kernel does not exist."""
    assert window_size == (-1, 0), "the glue must ask for causal attention"
    n = q.shape[0]
    seq = torch.zeros(n, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu_q.tolist()[:-1], cu_q.tolist()[1:])):
        seq[a:b] = i
    pos = torch.arange(n)
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("has_gqa", [True, False])
def test_varlen_glue_equals_per_sequence_loop(has_gqa):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, BOUNDS[-1], 8, generator=gen)
    key, value = (torch.randn(1, 2, BOUNDS[-1], 8, generator=gen) for _ in range(2))
    starts = torch.tensor(BOUNDS, dtype=torch.int32)
    loop = packing.per_sequence_attention(query, key, value, BOUNDS, scaling=0.3)
    kernel = (reference_varlen, {"window_size": (-1, 0)}, has_gqa)
    fused = packing.varlen_attention(kernel, query, key, value, starts, 8, scaling=0.3)
    assert fused.shape == loop.shape == (1, BOUNDS[-1], 4, 8)
    torch.testing.assert_close(fused, loop, atol=1e-5, rtol=1e-5)


def test_varlen_kernel_found_but_the_loop_runs_on_cpu():
    kernel = packing.varlen_kernel()
    assert kernel is not None, f"torch {torch.__version__} should have torch.nn.attention.varlen.varlen_attn"
    assert kernel[1] in ({"window_size": (-1, 0)}, {"is_causal": True})
    assert not packing.uses_varlen_kernel(torch.zeros(1, 2, 3, 4))  # CPU fp32: the per-sequence loop
    assert not packing.uses_varlen_kernel(torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_varlen_kernel_equals_per_sequence_loop_on_cuda():
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 12, BOUNDS[-1], 128, generator=gen).cuda().bfloat16()
    key, value = (torch.randn(1, 2, BOUNDS[-1], 128, generator=gen).cuda().bfloat16() for _ in range(2))
    assert packing.uses_varlen_kernel(query)
    fused = packing.varlen_attention(packing.varlen_kernel(), query, key, value,
                                     torch.tensor(BOUNDS, dtype=torch.int32, device="cuda"), 8)
    loop = packing.per_sequence_attention(query, key, value, BOUNDS)
    torch.testing.assert_close(fused.float(), loop.float(), atol=2e-2, rtol=2e-2)


def test_torch_compile_per_layer_log_probs_equal_eager(monkeypatch):
    """Packed micro-batches of different lengths and numbers of sequences through compiled layers (the
    aot_eager backend: the graphs, dynamic shapes and the attention's graph break, without minutes of C++)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hflow.workers.fsdp.kernels import compile_decoder_layers

    monkeypatch.setattr(torch._dynamo.config, "disable", False)  # tests/conftest.py disables TorchDynamo
    torch._dynamo.reset()
    config = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    eager = Qwen2ForCausalLM._from_config(config, attn_implementation=packing.SDPA_VARLEN)
    compiled = Qwen2ForCausalLM._from_config(config, attn_implementation=packing.SDPA_VARLEN)
    compiled.load_state_dict(eager.state_dict())
    assert compile_decoder_layers(compiled, backend="aot_eager") == 2
    gen = torch.Generator().manual_seed(1)
    for lengths in ([9, 14], [5, 12, 7], [16]):
        rows, width = len(lengths), max(lengths)
        ids = torch.randint(1, 64, (rows, width), generator=gen)
        mask = (torch.arange(width) >= width - torch.tensor(lengths)[:, None]).long()  # left padding
        batch = packing.pack_micro_batch(ids, mask, 3)
        want = batch.forward(eager, use_cache=False).logits.log_softmax(-1)
        got = batch.forward(compiled, use_cache=False).logits.log_softmax(-1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert compiled.model.layers[0]._compiled_call_impl is not None


def test_use_liger_stops_in_preflight_naming_the_key_and_package():
    from omegaconf import OmegaConf

    from hflow.workers.config import check_kernel_options

    model = OmegaConf.create({"use_liger": True})
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.use_liger=true .*liger-kernel.*CUDA"):
        check_kernel_options(model, "actor_rollout_ref.model", cuda=False)
    check_kernel_options(OmegaConf.create({"use_liger": False}), "actor_rollout_ref.model", cuda=False)


def tiny_qwen2(seed: int = 0, device: str = "cpu"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=64, max_position_embeddings=64)
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")


def test_use_liger_with_use_torch_compile_stops_in_preflight():
    from omegaconf import OmegaConf

    from hflow.workers.config import check_kernel_options

    both = OmegaConf.create({"use_liger": True, "use_torch_compile": True})
    with pytest.raises(ConfigError, match=r"critic\.model\.use_liger=true and critic\.model\.use_torch_compile=true"):
        check_kernel_options(both, "critic.model", cuda=True)


def test_liger_patches_stay_in_the_instance(monkeypatch):
    """Liger's apply functions also rebind names in the family's modeling module (its RMSNorm and MLP
    classes, the rotary function), which every later model of the family would pick up: a plain-loop arm
    of bench/actor_speed.py ran Liger's kernels after a Liger arm on the H100. A stand-in for the package
    (it needs CUDA) patches the way liger-kernel 0.8.5 does; hflow must leave the module as it found it and
    ask for no rotary patch, while the instance keeps its patched MLPs."""
    import sys
    import types

    from transformers.models.qwen2 import modeling_qwen2

    from hflow.workers.fsdp.kernels import apply_kernel_options

    calls = []

    def liger_like_apply(model, **options):
        calls.append(options)
        modeling_qwen2.Qwen2MLP = type("LigerSwiGLUMLP", (torch.nn.Module,), {})
        modeling_qwen2.Qwen2RMSNorm = type("LigerRMSNorm", (torch.nn.Module,), {})
        modeling_qwen2.apply_rotary_pos_emb = lambda *args, **kwargs: 1 / 0
        modeling_qwen2.liger_added_name = True
        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(lambda self, x: torch.zeros_like(x), layer.mlp)

    package = types.ModuleType("liger_kernel")
    package.transformers = types.ModuleType("liger_kernel.transformers")
    package.transformers.apply_liger_kernel_to_instance = liger_like_apply
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", package.transformers)
    before = dict(vars(modeling_qwen2))

    patched, other = tiny_qwen2(), tiny_qwen2()
    apply_kernel_options(patched, use_liger=True)

    assert calls and calls[0]["rope"] is False and calls[0]["fused_linear_cross_entropy"] is False
    after = vars(modeling_qwen2)
    assert after.keys() == before.keys(), f"names left behind: {sorted(after.keys() - before.keys())}"
    assert [k for k in before if after[k] is not before[k]] == []
    x = torch.randn(1, 3, 32)
    assert torch.equal(patched.model.layers[0].mlp(x), torch.zeros_like(x))  # the instance keeps its patch
    later = tiny_qwen2()
    assert type(later.model.layers[0].mlp).__name__ == "Qwen2MLP" and not torch.equal(later.model.layers[0].mlp(x), 0 * x)
    ids = torch.randint(0, 64, (2, 7))
    assert torch.isfinite(other(ids).logits).all()  # the rotary function was put back: it would divide by zero


@pytest.mark.gpu
def test_real_liger_on_cuda_stays_in_the_instance_and_matches_eager():
    pytest.importorskip("liger_kernel", reason="carry liger-kernel in .gpu_wheels/ (scripts/gpu_wheels.sh)")
    from transformers.models.qwen2 import modeling_qwen2

    from hflow.workers.fsdp.kernels import apply_kernel_options

    before = dict(vars(modeling_qwen2))
    eager, patched = tiny_qwen2(device="cuda"), tiny_qwen2(device="cuda")
    apply_kernel_options(patched, use_liger=True)
    assert [k for k in set(before) | set(vars(modeling_qwen2)) if vars(modeling_qwen2).get(k) is not before.get(k)] == []
    mlp = patched.model.layers[0].mlp
    assert mlp.forward.__func__ is not type(mlp).forward  # Liger's SwiGLU, bound to this instance
    ids = torch.randint(0, 64, (2, 9), device="cuda")
    torch.testing.assert_close(patched(ids).logits, eager(ids).logits, atol=1e-4, rtol=1e-4)


# ---- "by the device" keys ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builtin_config():
    from hflow.tasks.defaults import fill_builtin_defaults
    from hflow.trainer.config import default_config, validate_config

    config = validate_config(default_config())
    fill_builtin_defaults(config, frozenset())
    # mini-batches of more sequences than the largest budget's micro-batch, so the budgets differ in size
    config.data.train_batch_size = config.actor_rollout_ref.actor.ppo_mini_batch_size = 256
    return config


def test_cpu_keeps_padded_micro_batches_by_count(builtin_config):
    from hflow.trainer.memory.defaults import resolve_for_run

    config = builtin_config.copy()
    resolve_for_run(config, target="cpu")
    arr = config.actor_rollout_ref
    assert arr.model.use_remove_padding is False and arr.actor.use_dynamic_bsz is False
    assert arr.actor.ppo_max_token_len_per_gpu == 16384
    assert arr.rollout.log_prob_use_dynamic_bsz is False and config.critic.use_dynamic_bsz is False
    assert arr.rollout.weight_bucket_mb == 16.0  # the weight sync's bucket, as measured on CPU


def test_pretend_80gb_gpu_gets_token_budgets_the_memory_plan_fits(builtin_config, capsys):
    from hflow.trainer.memory.defaults import BUDGET_PHASES, plan_token_budget, resolve_for_run
    from hflow.trainer.memory.plan import plan_memory
    from hflow.workers.config import GPU_TOKEN_BUDGETS

    gib = 2**30
    config = builtin_config.copy()
    resolve_for_run(config, target="cuda", device_bytes=80 * gib)
    arr = config.actor_rollout_ref
    assert arr.model.use_remove_padding is True and arr.actor.use_dynamic_bsz is True
    assert arr.actor.ppo_max_token_len_per_gpu == GPU_TOKEN_BUDGETS[0] >= 16384
    assert arr.ref.log_prob_max_token_len_per_gpu == GPU_TOKEN_BUDGETS[0]
    assert config.critic.model.use_remove_padding is True
    assert arr.rollout.weight_bucket_mb == 1024.0  # GPU-sized buckets for the weight sync
    assert "device defaults (cuda" in capsys.readouterr().out
    # A device too small for the largest budget's passes but big enough for the next: the plan decides.
    figures = {}
    for budget in GPU_TOKEN_BUDGETS[:2]:
        trial = builtin_config.copy()
        resolve_for_run(trial, target="cpu")
        trial.actor_rollout_ref.model.use_remove_padding = True
        trial.actor_rollout_ref.actor.use_dynamic_bsz = True
        trial.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = budget
        plan = plan_memory(trial, "cuda", 80 * gib)
        figures[budget] = max(p.total for p in plan.phases if p.name in BUDGET_PHASES)
    big, next_ = GPU_TOKEN_BUDGETS[0], GPU_TOKEN_BUDGETS[1]
    assert figures[big] > figures[next_]
    between = (figures[big] + figures[next_]) / 2
    assert plan_token_budget(builtin_config.copy(), "cuda", between)[0] == next_
