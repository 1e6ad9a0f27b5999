"""DAPO: dynamic sampling (`algorithm.filter_groups`) and the soft overlong punishment
(`reward_model.overlong_buffer`), against their definitions, plus one real run on the built-in task."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hflow.config_schema import ConfigError

from hflow.trainer.config import default_config
from hflow.protocol import DataProto
from hflow.reward import dynamic_sampling as dapo
from hflow.trainer.ppo.ray_trainer import RayPPOTrainer
from hflow.utils.errors import UserError


def _groups(scores_per_group: list[list[float]], tag: str = "g", length: int = 4) -> DataProto:
    """Samples of consecutive groups (uid `<tag><i>`), each score on the last of `length` response tokens."""
    uids, scores = [], []
    for g, group in enumerate(scores_per_group):
        for s in group:
            uids.append(f"{tag}{g}")
            row = torch.zeros(length)
            row[-1] = s
            scores.append(row)
    return DataProto.from_dict({"token_level_scores": torch.stack(scores),
                                "attention_mask": torch.ones(len(uids), length, dtype=torch.long)},
                               {"uid": np.array(uids, dtype=object)})


# ---------------------------------------------------------------- the group filter


def test_groups_whose_samples_all_score_the_same_are_dropped():
    batch = _groups([[1, 1, 1], [0, 1, 0], [0, 0, 0], [0.5, 0.5, 0.25]])
    values = dapo.group_metric_values("score", batch.batch["token_level_scores"], {})
    np.testing.assert_array_equal(values, [1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.25])
    keep = dapo.informative_groups(batch.non_tensor_batch["uid"], values)
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3


def test_groups_need_not_be_contiguous_and_other_metrics_come_from_the_reward_function():
    uids = np.array(["a", "b", "a", "b"], dtype=object)
    scores = torch.tensor([[0.1], [0.0], [0.2], [0.0]])  # score differs in `a`; acc is equal in `a`, differs in `b`
    acc = dapo.group_metric_values("acc", scores, {"acc": [True, False, True, True]})
    assert dapo.informative_groups(uids, acc).tolist() == [False, True, False, True]
    score = dapo.group_metric_values("score", scores, {})
    assert dapo.informative_groups(uids, score).tolist() == [True, False, True, False]
    with pytest.raises(UserError, match="filter_groups.metric='acc'"):
        dapo.group_metric_values("acc", scores, {"pred": [1, 2, 3, 4]})


def test_take_groups_keeps_whole_groups_in_order():
    batch = _groups([[0, 1], [1, 0], [0, 1], [1, 1]])
    taken = dapo.take_groups(batch, 2)
    assert taken.non_tensor_batch["uid"].tolist() == ["g0", "g0", "g1", "g1"]
    assert torch.equal(taken.batch["token_level_scores"], batch.batch["token_level_scores"][:4])


def _fake_trainer(batches: list[DataProto], train_batch_size: int, max_num_gen_batches: int):
    """A trainer whose generation batches are `batches` (already scored): its rollout source's `take`
    hands out the next one, as the pipeline of batches in flight would, and counts the draws."""
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    config = default_config()
    config.data.train_batch_size = train_batch_size
    config.algorithm.filter_groups.enable = True
    config.algorithm.filter_groups.max_num_gen_batches = max_num_gen_batches
    trainer.config = config
    queue = list(batches[1:])
    trainer.draws = 0

    def take_rollout(timing, steps_after):
        trainer.draws += 1
        return SimpleNamespace(batch=queue.pop(0), output=DataProto(meta_info={"metrics": {}}))

    trainer.total_training_steps = trainer.global_steps = 1
    trainer.rollouts = SimpleNamespace(take=take_rollout, scored=lambda rollout, metrics, timing: (rollout.batch, {}))
    return trainer, batches[0]


def test_the_batch_is_refilled_from_new_generation_batches_and_trimmed():
    batches = [_groups([[0, 0], [0, 1], [1, 1]], "a"),  # 1 informative group
               _groups([[1, 1], [1, 1], [0, 0]], "b"),  # none
               _groups([[1, 0], [0, 1], [0, 1]], "c")]  # 3: one more than needed, trimmed
    trainer, first = _fake_trainer(batches, train_batch_size=3, max_num_gen_batches=10)
    metrics = {}
    batch = trainer._fill_batch_with_informative_groups(first, {}, metrics, {})
    assert batch.non_tensor_batch["uid"].tolist() == ["a1", "a1", "c0", "c0", "c1", "c1"]
    assert trainer.draws == 2
    assert metrics["train/num_gen_batches"] == 3
    assert metrics["train/filtered_groups_frac"] == pytest.approx(1 - 4 / 9)


def test_a_full_first_batch_draws_nothing_more():
    trainer, first = _fake_trainer([_groups([[0, 1], [1, 0], [0, 0]])], train_batch_size=2, max_num_gen_batches=1)
    metrics = {}
    batch = trainer._fill_batch_with_informative_groups(first, {}, metrics, {})
    assert len(batch) == 4 and trainer.draws == 0 and metrics["train/num_gen_batches"] == 1


def test_too_many_generation_batches_stop_with_an_error_naming_the_key():
    batches = [_groups([[0, 0], [1, 1]], tag) for tag in "abc"]
    trainer, first = _fake_trainer(batches, train_batch_size=2, max_num_gen_batches=2)
    with pytest.raises(UserError, match="max_num_gen_batches=2"):
        trainer._fill_batch_with_informative_groups(first, {}, {}, {})
    assert trainer.draws == 1


# ---------------------------------------------------------------- the overlong penalty


def test_overlong_penalty_follows_the_formula():
    max_len, buffer_len, factor = 20, 8, 0.5
    lengths = torch.arange(0, max_len + 1)
    got = dapo.overlong_penalty(lengths, max_len, buffer_len, factor)
    expected = [min(-(l - (max_len - buffer_len)) / buffer_len * factor, 0.0) for l in range(max_len + 1)]
    torch.testing.assert_close(got, torch.tensor(expected))
    assert got[12] == 0 and got[16] == pytest.approx(-0.25) and got[20] == pytest.approx(-0.5)


def test_overlong_penalty_lands_on_the_last_valid_token():
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    scores = torch.zeros(3, 6)
    scores[torch.arange(3), torch.tensor([1, 4, 5])] = 1.0
    out, metrics = dapo.apply_overlong_penalty(scores, mask, max_response_length=6, buffer_len=2, penalty_factor=1.0)
    expected = scores.clone()
    expected[1, 4] -= 0.5
    expected[2, 5] -= 1.0
    torch.testing.assert_close(out, expected)
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-0.5)
    assert metrics["response/overlong_frac"] == pytest.approx(2 / 3)
    assert scores[2, 5] == 1.0  # the input is left as it was


# ---------------------------------------------------------------- preflight


@pytest.mark.parametrize("changes,named", [
    ({"algorithm.filter_groups.enable": True, "actor_rollout_ref.rollout.n": 1}, "rollout.n >= 2"),
    ({"algorithm.filter_groups.enable": True, "actor_rollout_ref.rollout.n": 4,
      "algorithm.filter_groups.max_num_gen_batches": -1}, "max_num_gen_batches must be >= 0"),
    ({"reward_model.overlong_buffer.enable": True, "reward_model.overlong_buffer.len": 0}, "overlong_buffer.len"),
    ({"reward_model.overlong_buffer.enable": True, "reward_model.overlong_buffer.len": 64}, "overlong_buffer.len"),
    ({"reward_model.overlong_buffer.enable": True, "data.max_response_length": 4}, r"null: a fifth"),
])
def test_preflight_rejects(changes, named):
    config = default_config()
    for key, value in changes.items():
        OmegaConf.update(config, key, value)
    with pytest.raises(ConfigError, match=named):
        dapo.check_dapo_config(config)


def test_preflight_accepts_the_defaults_and_a_valid_dapo_config():
    config = default_config()
    dapo.check_dapo_config(config)
    config.algorithm.filter_groups.enable = True
    config.actor_rollout_ref.rollout.n = 4
    config.reward_model.overlong_buffer.enable = True  # len null: 64 // 5 = 12
    dapo.check_dapo_config(config)
    assert dapo.overlong_buffer_len(None, 64) == 12


def test_preflight_check_runs_the_dapo_checks():
    from hflow.trainer.config import validate_config
    from hflow.trainer.main_ppo import CONFIG_DIR, fill_builtin_defaults
    from hflow.trainer.preflight import preflight_check

    overrides = ["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=1"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = validate_config(compose(config_name="ppo_trainer", overrides=overrides))
    fill_builtin_defaults(config, frozenset(o.split("=")[0] for o in overrides))
    with pytest.raises(ConfigError, match="filter_groups"):
        preflight_check(config)
