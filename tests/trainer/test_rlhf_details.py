"""The reward details of the seed RLHF systems, each against its definition (hflow/reward/shaping.py):

* `algorithm.reward_clip` (DeepSpeed-Chat): each sequence's score clipped to [-c, c], before the KL penalty;
* `algorithm.stop_token` / `.missing_stop_penalty` (lm-human-preferences): the reward sees each response cut
  after its first stop token; responses without one score the penalty; training tensors stay as generated;
* `reward_model.normalize` (lm-human-preferences): gain and bias fitted once, on fresh samples of training
  prompts, so the reward model's scores get mean 0 and std 1; applied after, checkpointed, never refitted.

Most tests use small synthetic batches and a trainer whose worker groups are stand-ins (no Ray, no model);
one short run of the real trainer (local backend, HF rollout, a tiny reward model) checks the wiring.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from hflow.algorithms import core_algos
from hflow.config_schema import ConfigError
from hflow.trainer.config import default_config
from hflow.protocol import DataProto
from hflow.utils.torch_functional import last_valid_index
from hflow.reward import shaping as reward_shaping
from hflow.trainer.ppo.ray_trainer import RayPPOTrainer, apply_kl_penalty
from hflow.trainer.ppo.rollout_source import RolloutSource
from hflow.trainer.preflight import check_reward_shaping
from hflow.tasks.builtin_task import ensure_builtin_assets
from hflow.utils.errors import UserError
from hflow.utils.torch_functional import compute_position_id_with_mask
from hflow.reward.managers.naive import NaiveRewardManager
from hflow.workers.rollout.base import assemble_rollout_output
from tests.conftest import REPO_ROOT

P, L = 6, 8


@pytest.fixture(scope="module")
def builtin():
    return ensure_builtin_assets()


@pytest.fixture(scope="module")
def tokenizer(builtin):
    return AutoTokenizer.from_pretrained(builtin.model_path)


def make_batch(tokenizer, responses: list[str], eos: bool | list[bool] = True) -> DataProto:
    """Prompt/response rows as the rollout returns them: left-padded prompts, responses right-padded after EOS."""
    eos_flags = [eos] * len(responses) if isinstance(eos, bool) else eos
    prompt_ids = torch.full((len(responses), P), tokenizer.pad_token_id)
    prompt_mask = torch.zeros_like(prompt_ids)
    response_ids = torch.full((len(responses), L), tokenizer.pad_token_id)
    for i, (text, with_eos) in enumerate(zip(responses, eos_flags)):
        p = tokenizer.encode(f"q{i}", add_special_tokens=False)
        prompt_ids[i, P - len(p):], prompt_mask[i, P - len(p):] = torch.tensor(p), 1
        r = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if with_eos else [])
        response_ids[i, :len(r)] = torch.tensor(r[:L])
    gen = DataProto.from_dict(
        {"input_ids": prompt_ids, "attention_mask": prompt_mask, "position_ids": compute_position_id_with_mask(prompt_mask)},
        non_tensors={"data_source": np.array(["hflow/arithmetic"] * len(responses), dtype=object),
                     "reward_model": np.array([{"ground_truth": "0"}] * len(responses), dtype=object)},
        meta_info={"eos_token_id": tokenizer.eos_token_id})
    return assemble_rollout_output(gen, response_ids, n=1)


def last_token_scores(mask: torch.Tensor, scores: list[float]) -> torch.Tensor:
    out = torch.zeros(mask.shape)
    out[torch.arange(len(scores)), last_valid_index(mask)] = torch.tensor(scores)
    return out


# ------------------------------------------------------------------------------------------ reward clip


def test_reward_clip_clamps_each_sequence_score_and_keeps_its_place():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
    scores = last_token_scores(mask, [3.0, -0.5, -7.0, 2.0, 1.0])
    scores[2, 0] = 4.0  # a dense score: the sequence's score is the sum (-3)
    original = scores.clone()
    clipped, metrics = reward_shaping.clip_sequence_scores(scores, mask, 1.0)
    torch.testing.assert_close(clipped.sum(-1), torch.tensor([1.0, -0.5, -1.0, 1.0, 1.0]))
    # only the last valid token moves (position 0 for the empty response, where its score sits)
    changed = (clipped != scores).nonzero().tolist()
    assert changed == [[0, 2], [2, 3], [3, 0]]
    assert metrics["reward/clipped_frac"] == pytest.approx(3 / 5)
    assert torch.equal(scores, original)  # a copy: the input is left alone


def test_reward_clip_applies_to_the_score_before_the_kl_penalty():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    scores = last_token_scores(mask, [5.0, -5.0])
    old, ref = torch.zeros(2, 4), torch.full((2, 4), -0.5)  # kl = old - ref = 0.5 per token
    batch = DataProto.from_dict({"response_mask": mask, "token_level_scores": scores, "old_log_probs": old,
                                 "ref_log_prob": ref})
    clipped, _ = reward_shaping.clip_sequence_scores(scores, mask, 2.0)
    apply_kl_penalty(batch, core_algos.FixedKLController(kl_coef=0.1), "kl", clipped)
    rewards = batch.batch["token_level_rewards"]
    # clip(score) - beta * sum(kl): the penalty is not clipped away (clip(score - penalty) would give +-2)
    torch.testing.assert_close(rewards.sum(-1), torch.tensor([2.0 - 0.1 * 0.5 * 3, -2.0 - 0.1 * 0.5 * 4]))
    assert torch.equal(batch.batch["token_level_scores"], scores)  # the logged score stays the model's


# ------------------------------------------------------------------------------------------ stop token


def test_resolve_stop_token_accepts_exactly_one_token(tokenizer):
    assert reward_shaping.resolve_stop_token_id(tokenizer, "<|im_end|>") == tokenizer.eos_token_id
    assert reward_shaping.resolve_stop_token_id(tokenizer, ".") == tokenizer.encode(".", add_special_tokens=False)[0]
    for text in ("What is the answer?", ""):
        with pytest.raises(ConfigError, match=r"algorithm\.stop_token=.*exactly one token"):
            reward_shaping.resolve_stop_token_id(tokenizer, text)


def test_scoring_view_cuts_after_the_first_stop_token_and_leaves_the_batch(tokenizer):
    stop = tokenizer.encode(".", add_special_tokens=False)[0]
    batch = make_batch(tokenizer, ["1.2.3", "12", ".45", "1234567."], eos=[True, True, True, False])
    before = {k: v.clone() for k, v in batch.batch.items()}
    batch.batch["response_mask"] = batch.batch["attention_mask"][:, -L:].clone()
    view, has_stop = reward_shaping.stop_token_view(batch, stop, tokenizer.pad_token_id)

    assert has_stop.tolist() == [True, False, True, True]
    cut = view.batch["attention_mask"][:, -L:]
    assert cut.sum(-1).tolist() == [2, 3, 1, 8]  # "1." | "12<eos>" (no stop: whole) | "." | "1234567." (whole)
    assert torch.equal(view.batch["response_mask"], cut)
    for i in range(4):
        kept = int(cut[i].sum())
        assert torch.equal(view.batch["responses"][i, :kept], batch.batch["responses"][i, :kept])
        assert (view.batch["responses"][i, kept:] == tokenizer.pad_token_id).all()
    assert torch.equal(view.batch["input_ids"][:, -L:], view.batch["responses"])
    assert torch.equal(view.batch["attention_mask"][:, :-L], batch.batch["attention_mask"][:, :-L])
    for key, value in before.items():  # the training tensors stay as generated
        assert torch.equal(batch.batch[key], value), key


def test_reward_function_sees_the_cut_text_and_missing_stops_are_penalised(tokenizer):
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return float(len(solution_str))

    stop = tokenizer.encode(".", add_special_tokens=False)[0]
    batch = make_batch(tokenizer, ["12.345", "678", "9."], eos=[True, True, False])
    manager = NaiveRewardManager(tokenizer, num_examine=0, compute_score=compute_score, timeout_s=None)
    view, has_stop = reward_shaping.stop_token_view(batch, stop, tokenizer.pad_token_id)
    view_scores = manager(view)
    assert seen == ["12.", "678", "9."]

    response_mask = batch.batch["attention_mask"][:, -L:]
    scores, metrics = reward_shaping.finish_stop_token_scores(view_scores, response_mask, has_stop, -1.0)
    assert scores.sum(-1).tolist() == [3.0, -1.0, 2.0]  # "678" never stops: the fixed penalty, not its 3
    assert metrics["response/missing_stop_frac"] == pytest.approx(1 / 3)
    # each score sits on the last generated token (the episode ends there), not on the cut
    assert torch.equal(scores != 0, torch.nn.functional.one_hot(response_mask.sum(-1) - 1, L).bool())

    kept, _ = reward_shaping.finish_stop_token_scores(view_scores, response_mask, has_stop, None)
    assert kept.sum(-1).tolist() == [3.0, 3.0, 2.0]  # no penalty: the response keeps its own score


# ------------------------------------------------------------------------------------------ normalisation


def test_normalization_gain_and_bias_give_mean_zero_std_one():
    scores = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3.0 + 5.0
    norm = reward_shaping.RewardNormalization()
    norm.fit(scores)
    normalised = norm.gain * scores.double() + norm.bias
    assert normalised.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert normalised.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-9)
    assert norm.gain == pytest.approx(1 / scores.double().std(unbiased=False).item())
    assert norm.bias == pytest.approx(-scores.double().mean().item() * norm.gain)
    with pytest.raises(UserError, match="same score"):
        reward_shaping.RewardNormalization().fit(torch.full((8,), 2.0))


def test_normalization_applies_to_the_sequence_score_and_round_trips(tmp_path):
    norm = reward_shaping.RewardNormalization()
    norm.fit(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    rm_scores = last_token_scores(mask, [2.0, -1.0, 0.0])
    out = norm.apply(rm_scores, mask)
    torch.testing.assert_close(out.sum(-1), torch.tensor([norm.gain * 2 + norm.bias, -norm.gain + norm.bias, 0.0]))
    assert (out[0, 2] == 0) and (out[1, :2] == 0).all()  # still only on the last valid token; no response: no score

    torch.save({"reward_norm": norm.state_dict()}, tmp_path / "state.pt")
    restored = reward_shaping.RewardNormalization()
    restored.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True)["reward_norm"])
    assert (restored.gain, restored.bias, restored.fitted) == (norm.gain, norm.bias, True)
    torch.testing.assert_close(restored.apply(rm_scores, mask), out)
    assert restored.metrics() == {"reward/norm_gain": norm.gain, "reward/norm_bias": norm.bias}


# ------------------------------------------------------------------------------------------ the trainer's wiring


class FakeWorkers:
    """Stands in for the actor/rollout and reward-model worker groups: generates fixed answers and scores
    a response by the sum of its valid token ids (so a cut response scores differently)."""

    world_size = 2

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.generated_prompts, self.sample_counts, self.scored = [], [], []

    def generate_sequences(self, gen_batch: DataProto) -> DataProto:
        self.generated_prompts.append(gen_batch.batch["input_ids"].clone())
        self.sample_counts.append(gen_batch.meta_info.get("n"))
        tok = self.tokenizer
        rows = []
        for i in range(len(gen_batch)):
            text = ["1.5", "23", "4.", "56.7"][i % 4]
            ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if i % 3 else [])
            rows.append(ids + [tok.pad_token_id] * (L - len(ids)))
        gen_batch.meta_info.setdefault("eos_token_id", tok.eos_token_id)
        return assemble_rollout_output(gen_batch, torch.tensor(rows), n=1)

    def call(self, method, *args, **kwargs):  # a group call by the worker method's name, as a WorkerGroup's
        return getattr(self, method.__name__)(*args, **kwargs)

    def compute_rm_score(self, data: DataProto) -> DataProto:
        self.scored.append(data)
        mask = data.batch["attention_mask"][:, -L:]
        sums = (data.batch["responses"] * mask).sum(-1).float() / 100
        return DataProto.from_dict({"rm_scores": last_token_scores(mask, sums.tolist())})

    def save_checkpoint(self, path, global_step):
        pass

    def load_checkpoint(self, path):
        pass


def make_trainer(builtin, tokenizer, tmp_path, **algorithm):
    from hflow.utils.dataset import RLHFDataset, collate_fn, create_train_dataloader

    config = default_config()
    config.actor_rollout_ref.model.path = str(builtin.model_path)
    config.data.train_files = str(builtin.train_file)
    config.data.max_prompt_length = 32
    config.data.max_response_length = L
    config.data.train_batch_size = 4
    config.algorithm.adv_estimator = "grpo"
    config.reward_model.enable = True
    config.reward_model.normalize.enable = True
    config.reward_model.normalize.num_prompts = 6
    config.trainer.total_training_steps = 2
    config.trainer.default_local_dir = str(tmp_path / "ckpt")
    for key, value in algorithm.items():
        config.algorithm[key] = value
    dataset = RLHFDataset(config.data.train_files, tokenizer, config.data)
    loader = create_train_dataloader(dataset, config.data, collate_fn)
    trainer = RayPPOTrainer(config, tokenizer, None, None, dataset, None, collate_fn, loader, n_workers=1)
    trainer.actor_rollout_wg = trainer.scorer.rm_wg = FakeWorkers(tokenizer)
    trainer.rollouts = RolloutSource(config, trainer.actor_rollout_wg, loader)
    return trainer


def fit_normalization(trainer) -> None:
    trainer.scorer.fit_normalization(trainer.train_dataset, trainer.collate_fn, trainer.rollouts.generate)


def test_trainer_fits_normalization_on_fresh_samples_without_moving_the_loader(builtin, tokenizer, tmp_path):
    trainer = make_trainer(builtin, tokenizer, tmp_path, stop_token=".")
    loader_state = trainer.train_dataloader.state_dict()
    fit_normalization(trainer)
    assert trainer.train_dataloader.state_dict() == loader_state
    workers = trainer.scorer.rm_wg
    (scored,) = workers.scored
    assert len(scored) == 6 and workers.sample_counts == [1]  # one response for each of num_prompts prompts
    # the reward model saw the responses cut after the stop token, and the fit is over exactly those scores
    assert scored.batch["attention_mask"][:, -L:].sum(-1).tolist()[:4] == [2, 3, 2, 3]
    raw = workers.compute_rm_score(scored).batch["rm_scores"].sum(-1).double()
    normalised = trainer.scorer.reward_norm.gain * raw + trainer.scorer.reward_norm.bias
    assert normalised.mean().item() == pytest.approx(0, abs=1e-9)
    assert normalised.std(unbiased=False).item() == pytest.approx(1, abs=1e-9)

    # seeded: another trainer draws the same prompts
    again = make_trainer(builtin, tokenizer, tmp_path, stop_token=".")
    fit_normalization(again)
    assert torch.equal(again.scorer.rm_wg.generated_prompts[0], workers.generated_prompts[0])
    norm, again_norm = trainer.scorer.reward_norm, again.scorer.reward_norm
    assert (again_norm.gain, again_norm.bias) == (norm.gain, norm.bias)


def test_trainer_scores_with_normalization_stop_token_and_penalty(builtin, tokenizer, tmp_path):
    trainer = make_trainer(builtin, tokenizer, tmp_path, stop_token=".", missing_stop_penalty=-3.0)
    trainer.scorer.reward_fn = NaiveRewardManager(tokenizer, num_examine=0, timeout_s=None)  # reward model alone
    fit_normalization(trainer)
    batch = DataProto.from_single_dict(trainer.collate_fn([trainer.train_dataset[i] for i in range(4)]))
    gen = batch.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
    batch = batch.union(trainer.rollouts.generator.generate_sequences(gen))
    scores, _, metrics = trainer.scorer.score(batch, trainer.scorer.reward_fn)
    # answers "1.5" "23<eos>" "4.<eos>" "56.7" -> cut "1." | no stop | "4." | "56."
    raw_cut = [(tokenizer.encode(t, add_special_tokens=False)) for t in ("1.", "4.", "56.")]
    expected = [trainer.scorer.reward_norm.gain * sum(ids) / 100 + trainer.scorer.reward_norm.bias for ids in raw_cut]
    torch.testing.assert_close(scores.sum(-1), torch.tensor([expected[0], -3.0, expected[1], expected[2]]))
    assert metrics == {"response/missing_stop_frac": 0.25}
    assert "rm_scores" not in batch.batch.keys()  # the training batch stays as generated


def test_normalization_is_checkpointed_and_restored_not_refitted(builtin, tokenizer, tmp_path):
    trainer = make_trainer(builtin, tokenizer, tmp_path)
    fit_normalization(trainer)
    trainer.global_steps = 2
    trainer._save_checkpoint()
    state = torch.load(tmp_path / "ckpt" / "global_step_2" / "data" / "state.pt", weights_only=True)
    assert state["reward_norm"] == trainer.scorer.reward_norm.state_dict()

    resumed = make_trainer(builtin, tokenizer, tmp_path)
    resumed._load_checkpoint()
    assert resumed.global_steps == 2 and resumed.scorer.reward_norm.fitted
    norm, resumed_norm = trainer.scorer.reward_norm, resumed.scorer.reward_norm
    assert (resumed_norm.gain, resumed_norm.bias) == (norm.gain, norm.bias)
    assert resumed.scorer.rm_wg.generated_prompts == []  # nothing sampled: fit() refits only when not fitted


# ------------------------------------------------------------------------------------------ preflight


def preflight_config(builtin, **keys):
    config = default_config()
    config.actor_rollout_ref.model.path = str(builtin.model_path)
    for key, value in keys.items():
        OmegaConf.update(config, key, value)
    return config


@pytest.mark.parametrize("keys,named", [
    ({"algorithm.stop_token": "What is"}, ["algorithm.stop_token", "exactly one token"]),
    ({"algorithm.reward_clip": 0.0}, ["algorithm.reward_clip"]),
    ({"algorithm.missing_stop_penalty": -1.0}, ["algorithm.missing_stop_penalty", "algorithm.stop_token"]),
    ({"reward_model.normalize.enable": True}, ["reward_model.normalize.enable", "reward_model.enable"]),
    ({"reward_model.enable": True, "reward_model.normalize.enable": True, "reward_model.normalize.num_prompts": 1},
     ["reward_model.normalize.num_prompts", ">= 2"]),
])
def test_preflight_rejects_bad_reward_details_naming_the_key(builtin, keys, named):
    with pytest.raises(ConfigError) as err:
        check_reward_shaping(preflight_config(builtin, **keys))
    for word in named:
        assert word in str(err.value), (word, str(err.value))


def test_preflight_accepts_the_reward_details(builtin):
    check_reward_shaping(preflight_config(builtin))  # all off
    check_reward_shaping(preflight_config(
        builtin, **{"algorithm.stop_token": "<|im_end|>", "algorithm.missing_stop_penalty": -1.0,
                    "algorithm.reward_clip": 5.0, "reward_model.enable": True, "reward_model.normalize.enable": True}))


# ------------------------------------------------------------------------------------------ one real run


@pytest.fixture(scope="module")
def reward_model(builtin, tmp_path_factory):
    """A tiny random sequence classifier that reads the policy's tokenizer."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    folder = tmp_path_factory.mktemp("rm")
    tokenizer = AutoTokenizer.from_pretrained(builtin.model_path)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    return folder


def _train(tmp_path, reward_model, steps: int) -> tuple[str, list[dict]]:
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
         "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf", "data.train_batch_size=8",
         "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         f"trainer.total_training_steps={steps}", "trainer.save_freq=2", "trainer.test_freq=-1",
         "reward_model.enable=true", f"reward_model.model.path={reward_model}",
         "reward_model.normalize.enable=true", "reward_model.normalize.num_prompts=16",
         "algorithm.reward_clip=0.5", "algorithm.stop_token='<|im_end|>'", "algorithm.missing_stop_penalty=-1",
         # answers are 2 or 3 tokens with the stop token: at 2, the longer ones are cut before it
         "data.max_response_length=2", "trainer.rollout_data_dir=rollouts"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO_ROOT}, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    with open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl") as f:
        return run.stdout + run.stderr, [json.loads(line) for line in f]


@pytest.mark.slow  # training runs, stopped and resumed
def test_a_run_with_every_detail_fits_once_logs_and_resumes(tmp_path, reward_model):
    output, records = _train(tmp_path, reward_model, steps=2)
    assert output.count("reward_model.normalize: gain=") == 1
    steps = [r for r in records if "actor/pg_loss" in r]
    assert len(steps) == 2
    gain, bias = steps[0]["reward/norm_gain"], steps[0]["reward/norm_bias"]
    for step in steps:
        assert (step["reward/norm_gain"], step["reward/norm_bias"]) == (gain, bias)
        # Against each sample's score as dumped (before clipping): a response without the stop token scores
        # the penalty, -1 exactly (a normalised reward-model score never is), and a score beyond 0.5 is clipped.
        dump = tmp_path / "rollouts" / f"{int(step['training/global_step'])}.jsonl"
        scores = [json.loads(line)["score"] for line in dump.read_text().splitlines()]
        assert len(scores) == 8 * 4
        assert step["response/missing_stop_frac"] == pytest.approx(np.mean([s == -1.0 for s in scores]))
        assert step["reward/clipped_frac"] == pytest.approx(np.mean([abs(s) > 0.5 for s in scores]))
        assert 0 < step["response/missing_stop_frac"] < 1  # the setup: responses with and without the stop token
        assert -0.5 <= step["critic/rewards/min"] <= step["critic/rewards/max"] <= 0.5  # clipped (no KL in reward)
    assert any(key.endswith("/rm_score/mean@1") for key in records[0]), sorted(records[0])  # validation
    state = torch.load(tmp_path / "checkpoints" / "hflow" / "default" / "global_step_2" / "data" / "state.pt",
                       weights_only=True)
    assert state["reward_norm"] == {"gain": gain, "bias": bias}

    output, records = _train(tmp_path, reward_model, steps=3)  # resumes from step 2
    assert "reward_model.normalize: gain=" not in output
    last = [r for r in records if "actor/pg_loss" in r][-1]
    assert (last["training/global_step"], last["reward/norm_gain"], last["reward/norm_bias"]) == (3, gain, bias)
