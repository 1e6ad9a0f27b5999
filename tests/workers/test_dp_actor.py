"""DataParallelPPOActor: log-probs against a plain HF forward, and an update that does not depend on how
the mini-batch is cut (micro-batches, token budget, number of ranks)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import Qwen2Config, Qwen2ForCausalLM

from hflow.config_schema import default_config
from hflow.protocol import DataProto
from hflow.workers.fsdp import load_causal_lm
from hflow.workers.seqlen_balancing import rearrange_micro_batches
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.workers.actor import DataParallelPPOActor
from hflow.workers.config import resolved_copy
from tests.ranks import free_port, spawn_ranks

PROMPT_LEN, RESPONSE_LEN, VOCAB = 6, 5, 100
LR = 0.5  # plain SGD: parameter changes are proportional to the gradient, so any mis-scaling shows


def build_model_dir(path: Path) -> Path:
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("qwen2-actor"))


def make_batch(n: int, seed: int = 0, temperature: float = 1.0) -> DataProto:
    """Left-padded prompts of 2..P tokens, right-padded responses of 1..L tokens: token counts vary a lot
    between rows, so any per-micro-batch normalisation would weigh tokens unequally."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, PROMPT_LEN + 1, (n,), generator=gen)
    response_lens = torch.randint(1, RESPONSE_LEN + 1, (n,), generator=gen)
    prompt_mask = (torch.arange(PROMPT_LEN) >= PROMPT_LEN - prompt_lens[:, None]).long()
    response_mask = (torch.arange(RESPONSE_LEN) < response_lens[:, None]).long()
    prompts = torch.randint(1, VOCAB, (n, PROMPT_LEN), generator=gen) * prompt_mask
    responses = torch.randint(1, VOCAB, (n, RESPONSE_LEN), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=-1)
    tensors = {
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "responses": responses,
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask,
        "advantages": torch.randn(n, RESPONSE_LEN, generator=gen) * response_mask,
    }
    return DataProto.from_dict(tensors, meta_info={"temperature": temperature})


def actor_config(**overrides) -> DictConfig:
    """`actor_rollout_ref.actor` at the schema's defaults as a worker normalises it (with the derived
    `ppo_mini_batch_size_per_rank`, in sequences), with this module's settings and `overrides`."""
    config = resolved_copy(default_config().actor_rollout_ref.actor)
    settings = {"ppo_mini_batch_size_per_rank": 8, "ppo_micro_batch_size_per_gpu": 8, "shuffle": False, "grad_clip": 1e6}
    for key, value in {**settings, **overrides}.items():
        OmegaConf.update(config, key, value)
    return config


def add_old_log_probs(actor: DataParallelPPOActor, data: DataProto, noise: float, seed: int = 1) -> None:
    """old_log_probs from the actor itself, optionally perturbed so that clipping is active."""
    data.meta_info["micro_batch_size"] = 4
    old, _ = actor.compute_log_prob(data)
    gen = torch.Generator().manual_seed(seed)
    data.batch["old_log_probs"] = old + noise * torch.randn(old.shape, generator=gen)
    data.batch["ref_log_prob"] = old + noise * torch.randn(old.shape, generator=gen)


def train(model_dir: Path, data: DataProto, **overrides) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
    model = load_causal_lm(str(model_dir))
    actor = DataParallelPPOActor(actor_config(**overrides), model, torch.optim.SGD(model.parameters(), lr=LR))
    metrics = actor.update_policy(data)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, metrics


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]):
    assert a.keys() == b.keys()
    moved = max((a[k] - reference[k]).abs().max().item() for k in a)
    assert moved > 1e-3, "the update did not change the parameters; the comparison would be vacuous"
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0, msg=key)


# ------------------------------------------------------------------ log-probs


def full_logits_log_probs(model, data: DataProto, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: logits of every position, then log_softmax / gather over the response window."""
    b = data.batch
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    logits = logits[:, -RESPONSE_LEN - 1 : -1] / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    picked = log_probs.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return picked, entropy


def test_compute_log_prob_matches_full_logits_forward(model_dir: Path):
    model = load_causal_lm(str(model_dir))
    actor = DataParallelPPOActor(OmegaConf.create({}), model)  # a reference policy: no optimizer
    data = make_batch(6, temperature=0.7)
    data.meta_info["micro_batch_size"] = 4
    log_probs, entropys = actor.compute_log_prob(data, calculate_entropy=True)
    expected_lp, expected_ent = full_logits_log_probs(model, data, temperature=0.7)
    torch.testing.assert_close(log_probs, expected_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropys, expected_ent, atol=1e-5, rtol=0)
    # the temperature really is applied
    assert (full_logits_log_probs(model, data, temperature=1.0)[0] - log_probs).abs().max() > 1e-2


def test_compute_log_prob_requires_temperature(model_dir: Path):
    actor = DataParallelPPOActor(OmegaConf.create({}), load_causal_lm(str(model_dir)))
    data = make_batch(2)
    data.meta_info = {"micro_batch_size": 2}
    with pytest.raises(KeyError, match="temperature"):
        actor.compute_log_prob(data)


def test_dynamic_bsz_log_probs_and_entropys_keep_row_order(model_dir: Path):
    actor = DataParallelPPOActor(OmegaConf.create({}), load_causal_lm(str(model_dir)))
    data = make_batch(8, seed=3)
    budget = 2 * (PROMPT_LEN + RESPONSE_LEN)
    _, groups = rearrange_micro_batches(data.batch, budget)
    assert [i for g in groups for i in g] != list(range(8)), "the balancing must reorder rows for this test"

    data.meta_info.update(micro_batch_size=2)
    fixed_lp, fixed_ent = actor.compute_log_prob(data, calculate_entropy=True)
    data.meta_info.update(use_dynamic_bsz=True, max_token_len=budget)
    dyn_lp, dyn_ent = actor.compute_log_prob(data, calculate_entropy=True)
    torch.testing.assert_close(dyn_lp, fixed_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(dyn_ent, fixed_ent, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ update


def test_first_mini_batch_on_fresh_old_log_probs_has_zero_kl_and_clipfrac(model_dir: Path):
    model = load_causal_lm(str(model_dir))
    config = actor_config(ppo_mini_batch_size_per_rank=4, ppo_micro_batch_size_per_gpu=2)
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=LR))
    data = make_batch(8, seed=5)
    add_old_log_probs(actor, data, noise=0.0)
    metrics = actor.update_policy(data)
    assert len(metrics["actor/ppo_kl"]) == 2
    assert abs(metrics["actor/ppo_kl"][0]) <= 1e-7
    assert abs(metrics["actor/pg_clipfrac"][0]) <= 1e-7
    assert abs(metrics["actor/pg_clipfrac_lower"][0]) <= 1e-7
    assert abs(metrics["actor/ppo_kl"][1]) > 1e-5  # the first step moved the policy
    assert metrics["actor/grad_norm"][0] > 0


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum"])
def test_update_does_not_depend_on_micro_batching(model_dir: Path, loss_agg_mode: str):
    data = make_batch(8, seed=7)
    actor = DataParallelPPOActor(actor_config(), load_causal_lm(str(model_dir)))
    add_old_log_probs(actor, data, noise=0.3)
    common = dict(loss_agg_mode=loss_agg_mode, entropy_coeff=0.01, use_kl_loss=True, clip_ratio_high=0.28)
    initial = {k: v.clone() for k, v in load_causal_lm(str(model_dir)).state_dict().items()}

    one, m_one = train(model_dir, data, ppo_micro_batch_size_per_gpu=8, **common)
    four, m_four = train(model_dir, data, ppo_micro_batch_size_per_gpu=2, **common)
    dynamic, m_dyn = train(model_dir, data, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=25, **common)

    assert_same_params(one, four, initial)
    assert_same_params(one, dynamic, initial)
    assert m_one["actor/pg_clipfrac"][0] > 0  # clipping is active, so the clipped branch is compared too
    for key in (
        "actor/grad_norm",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/kl_loss",
    ):
        assert m_four[key] == pytest.approx(m_one[key], rel=1e-5, abs=1e-7), key
        assert m_dyn[key] == pytest.approx(m_one[key], rel=1e-5, abs=1e-7), key


def test_reference_policy_cannot_update(model_dir: Path):
    actor = DataParallelPPOActor(OmegaConf.create({}), load_causal_lm(str(model_dir)))
    with pytest.raises(RuntimeError, match="no optimizer"):
        actor.update_policy(make_batch(2))


# ------------------------------------------------------------------ two ranks == one rank

GLOBAL_N, GLOBAL_MINI = 16, 8  # two optimizer steps of 8 sequences
TOKEN_BUDGET = 14  # dynamic micro-batches of one or two sequences
# loss_agg_mode and how each rank cuts its mini-batch; the one-rank reference uses one micro-batch
RANK_RUNS = {
    "token-mean": {"ppo_micro_batch_size_per_gpu": 2},
    "seq-mean-token-sum": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": TOKEN_BUDGET},
}


def rank_rows(rank: int, world_size: int) -> torch.Tensor:
    """The rows of rank `rank`: its share of every global mini-batch, so that mini-batch j of every
    rank together is global mini-batch j."""
    per_rank = GLOBAL_MINI // world_size
    starts = [j * GLOBAL_MINI + rank * per_rank for j in range(GLOBAL_N // GLOBAL_MINI)]
    return torch.cat([torch.arange(s, s + per_rank) for s in starts])


def _rank_main(rank: int, world_size: int, port: int, model_path: str, workdir: str) -> None:
    os.environ.update(HFLOW_DEVICE="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from hflow.utils.device import dist_backend
    from hflow.workers.fsdp import apply_fsdp2, build_device_mesh, iter_full_params

    # a collective that one rank skips fails the test within a minute instead of hanging it
    dist.init_process_group(dist_backend(), rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        saved = torch.load(Path(workdir) / "batch.pt")
        rows = rank_rows(rank, world_size)
        data = DataProto.from_dict({k: v[rows] for k, v in saved.items()}, meta_info={"temperature": 1.0})
        mesh = build_device_mesh(world_size)
        results = {}
        for mode, cut in RANK_RUNS.items():
            model = apply_fsdp2(load_causal_lm(model_path), mesh)
            config = actor_config(
                loss_agg_mode=mode, ppo_mini_batch_size_per_rank=GLOBAL_MINI // world_size, use_kl_loss=True, **cut
            )
            actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=LR))
            metrics = actor.update_policy(data)
            results[mode] = ({name: t.clone() for name, t in iter_full_params(model)}, metrics)
        torch.save(results, Path(workdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_match_one_rank(model_dir: Path, tmp_path: Path):
    data = make_batch(GLOBAL_N, seed=11)
    add_old_log_probs(DataParallelPPOActor(actor_config(), load_causal_lm(str(model_dir))), data, noise=0.3)
    torch.save(dict(data.batch.items()), tmp_path / "batch.pt")
    # the ranks need different numbers of dynamic micro-batches on their own, so they must agree on one
    own_counts = [len(rearrange_micro_batches(data.batch[rank_rows(r, 2)][:4], TOKEN_BUDGET)[0]) for r in range(2)]
    assert own_counts[0] != own_counts[1], own_counts

    spawn_ranks(_rank_main, 2, 2, free_port(), str(model_dir), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    initial = load_causal_lm(str(model_dir)).state_dict()

    for mode in RANK_RUNS:
        single, m_single = train(
            model_dir,
            data,
            loss_agg_mode=mode,
            ppo_mini_batch_size_per_rank=GLOBAL_MINI,
            ppo_micro_batch_size_per_gpu=GLOBAL_MINI,
            use_kl_loss=True,
        )
        for params, _ in (r[mode] for r in ranks):
            assert_same_params(params, single, initial)
        metrics = [r[mode][1] for r in ranks]
        # every rank sees the global norm; per-rank shares of a loss average to the global value
        for m in metrics:
            assert m["actor/grad_norm"] == pytest.approx(m_single["actor/grad_norm"], rel=1e-5)
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss"):
            averaged = [(a + b) / 2 for a, b in zip(metrics[0][key], metrics[1][key], strict=True)]
            assert averaged == pytest.approx(m_single[key], rel=1e-5, abs=1e-7), (mode, key)
