"""PPO details of the seed systems, each against its definition: PPO-ptx (InstructGPT: + coef x the
language-modelling loss of pre-training text in every actor step), an EMA of the actor's weights
(DeepSpeed-Chat) and the critic's value head (zero at the start, or a reward model's head).

All single process on the tiny model, except one two-rank run that checks the ptx term's normalisation
over the ranks' tokens.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor

from hflow.config_schema import default_config
from hflow.protocol import DataProto
from hflow.trainer.main_ppo import CONFIG_DIR
from hflow.trainer.preflight import preflight_check
from hflow.workers.fsdp.checkpoint import FSDPCheckpointManager
from hflow.utils.dataset.ptx_dataset import PtxSampler
from hflow.workers.fsdp.ema import ParamEMA
from hflow.workers.fsdp import apply_fsdp2, clean_param_name, load_causal_lm, load_value_model
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.workers.actor import DataParallelPPOActor
from hflow.workers.config import ConfigError, check_value_head, resolved_copy
from hflow.workers.critic import DataParallelPPOCritic
from tests.ranks import free_port, spawn_ranks

PROMPT_LEN, RESPONSE_LEN = 5, 4
PTX_MAX_LENGTH = 24
# Texts of very different token counts (some cut at PTX_MAX_LENGTH): any per-row or per-rank mean
# would weigh the tokens unequally.
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "one",
    "A journey of a thousand miles begins with one step, and then many more steps after that one.",
    "12 + 30 = 42",
    "people work in the house near the water",
    "Question: what is 17 plus 25? Answer: 42",
    "go",
    "Let's think step by step. First, add the numbers. Then, multiply the result by two.",
]


@pytest.fixture(scope="module")
def ptx_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ptx") / "pretrain.parquet"
    pd.DataFrame({"text": TEXTS, "source": ["web"] * len(TEXTS)}).to_parquet(path)
    return path


def actor_config(**overrides) -> DictConfig:
    """`actor_rollout_ref.actor` at the schema's defaults as a worker normalises it, with `overrides`."""
    config = resolved_copy(default_config().actor_rollout_ref.actor)
    settings = {"ppo_mini_batch_size_per_rank": 4, "ppo_micro_batch_size_per_gpu": 4, "shuffle": False,
                "grad_clip": 1e6}
    for key, value in {**settings, **overrides}.items():
        OmegaConf.update(config, key, value)
    return config


def ppo_batch(n: int, seed: int = 0, zero_advantages: bool = False) -> DataProto:
    """Left-padded prompts, right-padded responses from the tiny vocabulary; zero advantages make the
    PPO loss's gradient exactly 0, so that an update is the ptx term's alone."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, PROMPT_LEN + 1, (n, 1), generator=gen)
    prompt_mask = (torch.arange(PROMPT_LEN) >= PROMPT_LEN - prompt_lens).long()
    response_mask = (torch.arange(RESPONSE_LEN) < torch.randint(1, RESPONSE_LEN + 1, (n, 1), generator=gen)).long()
    prompts = torch.randint(10, 400, (n, PROMPT_LEN), generator=gen) * prompt_mask
    responses = torch.randint(10, 400, (n, RESPONSE_LEN), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=-1)
    advantages = torch.zeros(n, RESPONSE_LEN) if zero_advantages else torch.randn(n, RESPONSE_LEN, generator=gen)
    return DataProto.from_dict({
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "responses": responses,
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask,
        "advantages": advantages * response_mask,
    }, meta_info={"temperature": 1.0})


def ptx_sampler(ptx_file: Path, tokenizer, rank: int = 0, seed: int = 4, batch_size: int = 4) -> PtxSampler:
    return PtxSampler(ptx_file, "text", tokenizer, batch_size=batch_size, max_length=PTX_MAX_LENGTH, seed=seed,
                      rank=rank)


def hand_nll(model, batches) -> torch.Tensor:
    """The plain next-token NLL, averaged over every text token of `batches` together (cross-entropy
    with padding ignored; right padding, so HF's own position ids are the right ones)."""
    total, count = 0.0, 0
    for batch in batches:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        labels = ids[:, 1:].masked_fill((mask[:, 1:] * mask[:, :-1]) == 0, -100)
        total = total + F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    return total / count


def sgd_step_by_hand(model_dir: Path, loss_fn, lr: float) -> dict[str, torch.Tensor]:
    model = load_causal_lm(str(model_dir))
    loss_fn(model).backward()
    return {name: (p - lr * p.grad).detach() for name, p in model.named_parameters()}


# ------------------------------------------------------------------ PPO-ptx


def test_ptx_term_is_coef_times_the_plain_nll_of_the_drawn_texts(tiny_model_dir, tiny_tokenizer, ptx_file):
    coef, lr = 0.5, 1.0
    model = load_causal_lm(str(tiny_model_dir))
    config = actor_config(**{"ptx.coef": coef, "ptx.batch_size_per_gpu": 4, "ptx.micro_batch_size_per_gpu": 2})
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=lr),
                                 ptx_sampler=ptx_sampler(ptx_file, tiny_tokenizer))
    metrics = actor.update_policy(ppo_batch(4, zero_advantages=True))

    drawn = ptx_sampler(ptx_file, tiny_tokenizer).next_batch()  # the same seed and rank: the same texts
    lengths = drawn["attention_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 1 and int(lengths.max()) == PTX_MAX_LENGTH  # uneven rows, one cut
    nll = hand_nll(load_causal_lm(str(tiny_model_dir)), [drawn]).item()
    assert metrics["actor/ptx_loss"] == pytest.approx([nll], rel=1e-5)

    expected = sgd_step_by_hand(tiny_model_dir, lambda m: coef * hand_nll(m, [drawn]), lr)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], atol=2e-6, rtol=0, msg=name)
    initial = load_causal_lm(str(tiny_model_dir)).state_dict()
    assert max((expected[n] - initial[n]).abs().max().item() for n in expected) > 1e-3, "a vacuous comparison"


def test_ptx_off_adds_nothing(tiny_model_dir, tiny_tokenizer, ptx_file):
    model = load_causal_lm(str(tiny_model_dir))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    actor = DataParallelPPOActor(actor_config(), model, torch.optim.SGD(model.parameters(), lr=1.0),
                                 ptx_sampler=ptx_sampler(ptx_file, tiny_tokenizer))  # ptx.coef: 0.0 by default
    metrics = actor.update_policy(ppo_batch(4, zero_advantages=True))
    assert "actor/ptx_loss" not in metrics
    assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items())


def test_ptx_draws_are_seeded_rank_distinct_and_resume(tiny_tokenizer, ptx_file):
    draws = [ptx_sampler(ptx_file, tiny_tokenizer).draw_indices() for _ in range(2)]
    assert draws[0] == draws[1]
    assert ptx_sampler(ptx_file, tiny_tokenizer, rank=1).draw_indices() != draws[0]
    assert ptx_sampler(ptx_file, tiny_tokenizer, seed=6).draw_indices() != draws[0]

    sampler = ptx_sampler(ptx_file, tiny_tokenizer)
    sampler.next_batch()
    state = sampler.state_dict()
    following = sampler.next_batch()
    resumed = ptx_sampler(ptx_file, tiny_tokenizer)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_batch()["input_ids"], following["input_ids"])
    # right-padded, at most max_length tokens, the tokenizer's own ids
    text = TEXTS[draws[0][0]]
    ids = tiny_tokenizer(text, truncation=True, max_length=PTX_MAX_LENGTH)["input_ids"]
    batch = ptx_sampler(ptx_file, tiny_tokenizer).next_batch()
    assert batch["input_ids"][0, : len(ids)].tolist() == ids and batch["attention_mask"][0].sum() == len(ids)


TWO_RANK_DECAY = 0.5


@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory) -> Path:
    """The tiny model with an MLP width of 509: split over two ranks its MLP weights have shards of
    different sizes, which the sharded EMA and its checkpoint must handle."""
    from hflow.tasks.tiny_models import build_causal_lm

    return build_causal_lm(tmp_path_factory.mktemp("qwen2-odd"), preset="tiny", intermediate_size=509)


def _two_rank_main(rank: int, world_size: int, port: int, model_path: str, ptx_path: str, workdir: str) -> None:
    """One PPO-ptx step with an EMA on FSDP2 over two ranks, then a checkpoint with the EMA's export."""
    os.environ["HFLOW_DEVICE"] = "cpu"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from hflow.workers.fsdp.checkpoint import save_hf_model
    from hflow.utils.device import dist_backend
    from hflow.workers.fsdp import build_device_mesh, iter_full_params

    dist.init_process_group(dist_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        model = apply_fsdp2(load_causal_lm(model_path), build_device_mesh(world_size))
        config = actor_config(**{"ppo_mini_batch_size_per_rank": 2, "ppo_micro_batch_size_per_gpu": 2,
                                 "ptx.coef": 0.5, "ptx.micro_batch_size_per_gpu": 1})
        sampler = ptx_sampler(Path(ptx_path), AutoTokenizer.from_pretrained(model_path), rank=rank)
        ema = ParamEMA(model, TWO_RANK_DECAY)
        actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=1.0), ptx_sampler=sampler,
                                     ema=ema)
        metrics = actor.update_policy(ppo_batch(2, seed=rank, zero_advantages=True))
        FSDPCheckpointManager(
            model, contents=["model", "hf_model"], sharded_state={"ema": ema},
            hf_exports={"ema_huggingface": lambda path: save_hf_model(model, path, weights=ema.iter_full())},
        ).save_checkpoint(Path(workdir) / "ckpt")
        params = {name: t.clone() for name, t in iter_full_params(model)}
        torch.save((params, metrics), Path(workdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_run(odd_model_dir, ptx_file, tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("two_ranks")
    spawn_ranks(_two_rank_main, 2, 2, free_port(), str(odd_model_dir), str(ptx_file), str(workdir))
    return workdir


def test_ptx_loss_is_normalised_over_the_tokens_of_all_ranks(two_rank_run, odd_model_dir, tiny_tokenizer, ptx_file):
    """Two ranks, each with its own draw (of different token counts) and micro-batches of one text: the
    update is the gradient of coef x the token mean over both ranks' texts together."""
    drawn = [ptx_sampler(ptx_file, tiny_tokenizer, rank=r).next_batch() for r in range(2)]
    tokens = [int((b["attention_mask"][:, 1:] * b["attention_mask"][:, :-1]).sum()) for b in drawn]
    assert tokens[0] != tokens[1], tokens  # a mean of per-rank means would differ from the global mean
    ranks = [torch.load(two_rank_run / f"rank{r}.pt") for r in range(2)]

    nll = hand_nll(load_causal_lm(str(odd_model_dir)), drawn).item()
    averaged = (ranks[0][1]["actor/ptx_loss"][0] + ranks[1][1]["actor/ptx_loss"][0]) / 2  # the driver's mean
    assert averaged == pytest.approx(nll, rel=1e-5)
    expected = sgd_step_by_hand(odd_model_dir, lambda m: 0.5 * hand_nll(m, drawn), lr=1.0)
    for params, _ in ranks:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, atol=2e-6, rtol=0, msg=name)


def preflight_files(root: Path) -> Path:
    """What preflight needs besides the ptx files: a model folder and prompt files (never loaded)."""
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    (root / "model" / "model.safetensors").write_bytes(b"")
    (root / "model" / "tokenizer_config.json").write_text("{}")
    for name in ("train.parquet", "val.parquet"):
        pd.DataFrame({"data_source": ["openai/gsm8k"]}).to_parquet(root / name)
    pd.DataFrame({"content": ["no text column here"]}).to_parquet(root / "other_column.parquet")
    pd.DataFrame({"text": pd.Series([], dtype=str)}).to_parquet(root / "empty.parquet")
    return root


@pytest.mark.parametrize("overrides,named", [
    (["actor_rollout_ref.actor.ptx.coef=0.1"], ["data.ptx_files", "actor_rollout_ref.actor.ptx.coef"]),
    (["actor_rollout_ref.actor.ptx.coef=0.1", "data.ptx_files={root}/missing.parquet"],
     ["data.ptx_files", "missing.parquet", "does not exist"]),
    (["actor_rollout_ref.actor.ptx.coef=0.1", "data.ptx_files=[{root}/other_column.parquet]"],
     ["data.ptx_files", "other_column.parquet", "'text'", "data.ptx_text_key"]),
    (["actor_rollout_ref.actor.ptx.coef=0.1", "data.ptx_files={root}/empty.parquet"],
     ["data.ptx_files", "empty.parquet", "no rows"]),
    (["actor_rollout_ref.actor.ptx.coef=0.1", "data.ptx_files={ptx}",
      "actor_rollout_ref.actor.ptx.batch_size_per_gpu=3", "actor_rollout_ref.actor.ptx.micro_batch_size_per_gpu=2"],
     ["ptx.micro_batch_size_per_gpu", "ptx.batch_size_per_gpu"]),
    (["actor_rollout_ref.actor.ema.enable=true", "actor_rollout_ref.actor.ema.decay=1.0"],
     ["actor_rollout_ref.actor.ema.decay"]),
    (["critic.model.value_head_init=uniform"], ["critic.model.value_head_init", "zero"]),
])
def test_preflight_stops_bad_settings_before_any_model_loads(tmp_path, ptx_file, overrides, named):
    root = preflight_files(tmp_path)
    base = [f"actor_rollout_ref.model.path={root / 'model'}", f"data.train_files={root / 'train.parquet'}",
            f"data.val_files={root / 'val.parquet'}", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        good = compose(config_name="ppo_trainer", overrides=base + [
            "actor_rollout_ref.actor.ptx.coef=0.1", f"data.ptx_files={ptx_file}",
            "actor_rollout_ref.actor.ema.enable=true"])
        bad = compose(config_name="ppo_trainer",
                      overrides=base + [o.format(root=root, ptx=ptx_file) for o in overrides])
    preflight_check(good)
    with pytest.raises(ConfigError) as err:
        preflight_check(bad)
    for word in named:
        assert word in str(err.value), f"{word!r} not in: {err.value}"


# ------------------------------------------------------------------ EMA of the actor


def full_params(model) -> dict[str, torch.Tensor]:
    return {clean_param_name(n): _full(p).detach().clone() for n, p in model.named_parameters()}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or EMA average whole: gathered from its shards, or as it is on a one-rank plain module."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def test_ema_after_k_steps_is_the_closed_form_of_the_parameter_history(world_of_one, tiny_model_dir, fsdp_on_one_rank):
    decay, k = 0.6, 3
    model = apply_fsdp2(load_causal_lm(str(tiny_model_dir)), world_of_one)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ema = ParamEMA(model, decay)
    history = [full_params(model)]
    optimizer.register_step_post_hook(lambda *_: history.append(full_params(model)))
    actor = DataParallelPPOActor(actor_config(ppo_micro_batch_size_per_gpu=2), model, optimizer, ema=ema)
    actor.update_policy(ppo_batch(4 * k, seed=1))
    assert len(history) == k + 1  # one optimizer step per mini-batch of 4

    for name, average in ema.state_dict().items():
        assert isinstance(average, DTensor) and average.to_local().dtype == torch.float32  # sharded, fp32
        # ema_k = d^k p_0 + (1 - d) sum_{j=1..k} d^(k-j) p_j
        expected = decay**k * history[0][name] + (1 - decay) * sum(decay ** (k - j) * history[j][name]
                                                                    for j in range(1, k + 1))
        torch.testing.assert_close(average.full_tensor(), expected, atol=1e-6, rtol=1e-6, msg=name)
    gap = max((ema.state_dict()[n].full_tensor() - history[-1][n]).abs().max().item() for n in history[-1])
    assert gap > 1e-4, "the EMA equals the final weights: the test would not tell them apart"


def test_a_two_rank_ema_is_exported_and_reloads_on_one_rank(two_rank_run, odd_model_dir):
    """Shards of uneven sizes: the export written by two ranks holds decay * p_0 + (1 - decay) * p_1, and
    the sharded checkpoint loads into a single process (DCP reshards the EMA like the model)."""
    from transformers import AutoModelForCausalLM

    initial = load_causal_lm(str(odd_model_dir)).state_dict()
    trained, _ = torch.load(two_rank_run / "rank0.pt")
    assert trained["model.layers.0.mlp.down_proj.weight"].shape[0] % 2 == 0  # (256, 509): its rows split evenly,
    assert trained["model.layers.0.mlp.up_proj.weight"].shape[0] % 2 == 1    # but these (509, 256) do not
    expected = {n: TWO_RANK_DECAY * initial[n] + (1 - TWO_RANK_DECAY) * trained[n] for n in trained}
    exported = AutoModelForCausalLM.from_pretrained(two_rank_run / "ckpt" / "ema_huggingface").state_dict()
    assert exported.keys() == expected.keys()
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)

    model = load_causal_lm(str(odd_model_dir))
    ema = ParamEMA(model, TWO_RANK_DECAY)
    FSDPCheckpointManager(model, contents=["model"], sharded_state={"ema": ema}).load_checkpoint(two_rank_run / "ckpt")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    for name, average in ema.state_dict().items():
        assert torch.equal(average, exported[name]), name


def test_a_checkpoint_without_an_ema_restarts_it_from_the_loaded_weights(world_of_one, tiny_model_dir, tmp_path):
    saved = apply_fsdp2(load_causal_lm(str(tiny_model_dir)), world_of_one)
    with torch.no_grad():
        for param in saved.parameters():
            param.add_(0.01)
    FSDPCheckpointManager(saved, contents=["model"]).save_checkpoint(tmp_path / "plain")

    model = apply_fsdp2(load_causal_lm(str(tiny_model_dir)), world_of_one)
    ema = ParamEMA(model, 0.9)
    FSDPCheckpointManager(model, contents=["model"], sharded_state={"ema": ema}).load_checkpoint(tmp_path / "plain")
    loaded = full_params(model)
    for name, average in ema.state_dict().items():
        assert torch.equal(_full(average), loaded[name]), name


def actor_worker_config(model_dir: Path, ptx_file: Path, *extra: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "actor_rollout_ref.actor.ema.enable=true",
            "actor_rollout_ref.actor.ema.decay=0.5",
            "actor_rollout_ref.actor.ptx.coef=0.1",
            f"data.ptx_files={ptx_file}",
            "actor_rollout_ref.actor.ptx.batch_size_per_gpu=2",
            "actor_rollout_ref.actor.ptx.micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.checkpoint.contents=[model,optimizer,extra,hf_model]",
            *extra,
        ])
    OmegaConf.resolve(config)
    return config.actor_rollout_ref


def test_actor_worker_checkpoints_resumes_and_exports_its_ema(world_of_one, tiny_model_dir, ptx_file, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hflow.workers.fsdp_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(actor_worker_config(tiny_model_dir, ptx_file), role="actor")
    worker.init_model()  # joins the world of one this module set up
    metrics = worker.update_actor(ppo_batch(2, seed=2)).meta_info["metrics"]
    assert metrics["actor/ptx_loss"][0] > 0

    ckpt = tmp_path / "global_step_1" / "actor"
    worker.save_checkpoint(str(ckpt), global_step=1)
    ema_at_save = {name: _full(t).clone() for name, t in worker.actor_ema.state_dict().items()}
    actor_at_save = full_params(worker.actor_module)

    # the export: a Hugging Face folder that transformers loads as it is, holding the EMA weights
    exported = AutoModelForCausalLM.from_pretrained(ckpt / "ema_huggingface").state_dict()
    assert exported.keys() == ema_at_save.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, ema_at_save[name]), name
    assert (ckpt / "ema_huggingface" / "tokenizer.json").is_file()
    actor_export = load_file(str(ckpt / "huggingface" / "model.safetensors"))
    assert max((actor_export[n] - ema_at_save[n]).abs().max().item() for n in ema_at_save) > 1e-5
    worker.save_ema_hf_model(str(tmp_path / "ema_only"))
    again = load_file(str(tmp_path / "ema_only" / "model.safetensors"))
    assert all(torch.equal(again[n], ema_at_save[n]) for n in ema_at_save)

    # resume: another step moves weights and EMA on; loading the checkpoint brings both back
    worker.update_actor(ppo_batch(2, seed=3))
    assert not all(torch.equal(_full(worker.actor_ema.state_dict()[n]), ema_at_save[n]) for n in ema_at_save)
    worker.load_checkpoint(str(ckpt))
    for name, average in worker.actor_ema.state_dict().items():
        assert torch.equal(_full(average), ema_at_save[name]), name
    assert all(torch.equal(t, actor_at_save[n]) for n, t in full_params(worker.actor_module).items())


# ------------------------------------------------------------------ the critic's value head


def critic_config() -> DictConfig:
    config = resolved_copy(default_config().critic)
    for key, value in {"ppo_mini_batch_size_per_rank": 4, "ppo_micro_batch_size_per_gpu": 4, "shuffle": False}.items():
        OmegaConf.update(config, key, value)
    return config


def compute_values(model, data: DataProto) -> torch.Tensor:
    critic = DataParallelPPOCritic(critic_config(), model, torch.optim.SGD(model.parameters(), lr=0.1))
    data.meta_info["micro_batch_size"] = 2
    return critic.compute_values(data)


def test_zero_value_head_gives_zero_values_at_step_0(tiny_model_dir):
    data = ppo_batch(4)
    model = load_value_model(str(tiny_model_dir))  # the default, as critic.model.value_head_init
    assert default_config().critic.model.value_head_init == "zero"
    assert not model.score.weight.any() and not model.score.bias.any()
    assert torch.equal(compute_values(model, data), torch.zeros(4, RESPONSE_LEN))
    normal = compute_values(load_value_model(str(tiny_model_dir), value_head_init="normal"), data)
    assert (normal[data.batch["response_mask"].bool()] != 0).all()


def test_a_critic_from_a_reward_model_folder_starts_at_its_per_token_scores(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    with torch.no_grad():  # a trained-looking head, not the zero or seeded one a critic would make itself
        reward_model.score.weight.copy_(torch.randn(reward_model.score.weight.shape,
                                                    generator=torch.Generator().manual_seed(7)))
    reward_model.save_pretrained(tmp_path / "rm")

    data = ppo_batch(4)
    values = compute_values(load_value_model(str(tmp_path / "rm"), value_head_init="zero"), data)
    scores = {}
    reward_model.score.register_forward_hook(lambda _m, _i, output: scores.update(per_token=output))
    b = data.batch
    with torch.no_grad():
        reward_model.eval()(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                            position_ids=b["position_ids"])
    # V before response token j is the score after reading the token before it: positions P-1 .. T-2
    expected = scores["per_token"][:, PROMPT_LEN - 1: -1, 0] * b["response_mask"]
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=1e-5)
    assert (values[b["response_mask"].bool()].abs() > 1e-3).all()


def test_a_reward_model_with_more_than_one_label_is_refused_naming_the_key(tmp_path):
    folder = tmp_path / "classifier"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"],
                                                    "id2label": {"0": "bad", "1": "good"}}))
    model = OmegaConf.create({"path": str(folder), "value_head_init": "zero"})
    with pytest.raises(ConfigError, match="critic.model.path.*2 labels"):
        check_value_head(model, "critic.model")
