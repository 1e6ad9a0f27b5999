"""The batch and dapo reward managers, a manager a user's reward file registers, and how the loader builds
them (the overlong buffer for training only). NaiveRewardManager's own tests: test_reward_manager.py."""

import textwrap

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hflow.reward import dynamic_sampling as trainer_dapo
from hflow.reward.managers import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    OverlongBuffer,
    RewardFunctionError,
    get_custom_reward_fn,
    get_reward_manager_cls,
    load_reward_manager,
)
from hflow.reward.managers.loader import RewardSignatureError, check_reward_fn_signature
from tests.reward.test_reward_manager import _config, make_batch, response_lengths, tokenizer  # noqa: F401

BATCH_FILE = '''
import time

CALLS = []


def batch_exact(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
    CALLS.append(len(solution_strs))
    return [{"score": float(s.strip().endswith(str(g))) + bonus, "n": len(solution_strs), "row": e["i"]}
            for s, g, e in zip(solution_strs, ground_truths, extra_infos)]


def batch_misbehave(data_sources, solution_strs, ground_truths, extra_infos):
    """Fails in the way the first response asks for."""
    ask = solution_strs[0]
    if "short" in ask:
        return [1.0] * (len(solution_strs) - 1)
    if "long" in ask:
        return [1.0] * (len(solution_strs) + 1)
    if "text" in ask:
        return [1.0, "yes"] + [1.0] * (len(solution_strs) - 2)
    if "sleep" in ask:
        time.sleep(30)
    if "raise" in ask:
        raise ValueError("boom on purpose")
    return 1.0  # not a list


def per_sample(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0


def tool_use_batch(data_sources, solution_strs, ground_truths, extra_infos):
    return [{"score": float(s == g), "turns": e["episode"]["num_turns"]}
            for s, g, e in zip(solution_strs, ground_truths, extra_infos)]
'''

SAMPLES = [
    ("What is 2 + 3?", "Answer: 5", "hflow/arithmetic", "5"),
    ("What is 6 * 7?", "Answer: 41 and more words", "hflow/arithmetic", "42"),
    ("What is 1 + 1?", "2", "hflow/arithmetic", "2"),
    ("What is 9 - 3?", "", "hflow/arithmetic", "6"),
]


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch_reward") / "batch_reward.py"
    path.write_text(BATCH_FILE)
    return str(path)


def _fn(path, name, **reward_kwargs):
    return get_custom_reward_fn(_config(path, name, reward_kwargs))


# ---- batch ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout_s", [None, 10], ids=["inline", "scoring-process"])
def test_batch_calls_once_with_lists_and_places_like_naive(tokenizer, batch_file, timeout_s):
    batch = make_batch(tokenizer, SAMPLES)
    fn = _fn(batch_file, "batch_exact", bonus=0.5)
    manager = BatchRewardManager(tokenizer, 0, compute_score=fn, timeout_s=timeout_s)
    out = manager(batch, return_dict=True)
    manager.close()
    expected = torch.zeros_like(out["reward_tensor"])
    for i, (length, value) in enumerate(zip(response_lengths(batch), [1.5, 0.5, 1.5, 0.5], strict=True)):
        expected[i, max(length - 1, 0)] = value  # the last valid response token (0 when empty)
    assert torch.equal(out["reward_tensor"], expected)
    assert out["reward_extra_info"] == {"n": [4] * 4, "row": [0, 1, 2, 3]}  # one call saw all four
    assert out["reward_metrics"] == {"reward/errors": 0}
    if timeout_s is None:
        assert fn.function.__globals__["CALLS"][-1:] == [4]


def test_batch_without_a_function_uses_the_default_scorers(tokenizer):
    batch = make_batch(tokenizer, SAMPLES)
    naive, batched = NaiveRewardManager(tokenizer, 0), BatchRewardManager(tokenizer, 0)
    assert torch.equal(naive(batch), batched(batch))
    naive.close(), batched.close()


@pytest.mark.parametrize("ask,named", [
    ("short", r"sample 3 \(data_source='hflow/arithmetic'\).*returned 3 results for 4 samples"),
    ("long", r"sample 0 .*returned 5 results for 4 samples"),
    ("text", r"sample 1 .*returned 'yes'"),
    ("raise", r"sample 0 .*ValueError: boom on purpose"),
    ("list", r"sample 0 .*returned float 1.0; return a list of 4"),
    ("sleep", r"sample 0 .*timed out after 1 s"),
])
def test_batch_failures_name_the_sample(tokenizer, batch_file, ask, named):
    samples = [(p, ask if i == 0 else r, d, g) for i, (p, r, d, g) in enumerate(SAMPLES)]
    manager = BatchRewardManager(tokenizer, 0, compute_score=_fn(batch_file, "batch_misbehave"), timeout_s=1)
    with pytest.raises(RewardFunctionError, match=named):
        manager(make_batch(tokenizer, samples))
    manager.close()


def test_batch_on_error_zero_scores_the_failed_samples_zero(tokenizer, batch_file):
    samples = [(p, "short" if i == 0 else r, d, g) for i, (p, r, d, g) in enumerate(SAMPLES)]
    manager = BatchRewardManager(tokenizer, 0, compute_score=_fn(batch_file, "batch_misbehave"), on_error="zero",
                                 timeout_s=None)
    out = manager(make_batch(tokenizer, samples), return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 1.0, 1.0, 0.0]
    assert out["reward_metrics"]["reward/errors"] == 1
    assert out["reward_extra_info"]["reward_error"] == [False, False, False, True]


def test_batch_sees_multi_turn_episodes(tokenizer, batch_file):
    samples = [("What is 37 * 86?", "x", "hflow/multiply", "3182")] * 2
    batch = make_batch(tokenizer, samples)
    batch.non_tensor_batch["episode"] = np.array([
        {"messages": [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "3182"},
                      {"role": "assistant", "content": answer}], "tool_calls": [], "num_turns": 2}
        for answer in ("3182", "2400")], dtype=object)
    manager = BatchRewardManager(tokenizer, 0, compute_score=_fn(batch_file, "tool_use_batch"), timeout_s=None)
    out = manager(batch, return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 0.0]
    assert out["reward_extra_info"] == {"turns": [2, 2]}


def test_signature_checks_follow_the_manager(batch_file):
    check_reward_fn_signature(_fn(batch_file, "batch_exact"), "batch")
    check_reward_fn_signature(_fn(batch_file, "per_sample"), "dapo")
    with pytest.raises(RewardSignatureError, match=r"batch_misbehave.*def batch_misbehave\(data_source, "):
        check_reward_fn_signature(_fn(batch_file, "batch_misbehave"), "naive")
    with pytest.raises(RewardSignatureError, match=r"per_sample.*data_sources, solution_strs.*passes lists"):
        check_reward_fn_signature(_fn(batch_file, "per_sample"), "batch")
    check_reward_fn_signature(_fn(batch_file, "per_sample"), "someone-elses")  # a user's manager: its call


# ---- dapo and the overlong buffer ------------------------------------------------------------------


def test_dapo_adds_the_overlong_penalty_on_the_last_token(tokenizer):
    samples = [("What is 2 + 3?", "Answer: 5", "hflow/arithmetic", "5"),
               ("What is 2 + 3?", "Answer: 5 " + "and so on " * 3, "hflow/arithmetic", "5")]
    batch = make_batch(tokenizer, samples, response_len=20)
    lengths = response_lengths(batch)
    assert lengths[0] < 20 - 8 < lengths[1]  # the second runs into the last 8 tokens
    manager = DAPORewardManager(tokenizer, 0, max_response_length=20, overlong_buffer_len=8,
                                overlong_penalty_factor=2.0, timeout_s=None)
    out = manager(batch, return_dict=True)
    penalty = min(-(lengths[1] - 12) / 8 * 2.0, 0.0)
    assert out["reward_tensor"][0, lengths[0] - 1] == 1.0
    assert out["reward_tensor"][1, lengths[1] - 1].item() == pytest.approx(1.0 + penalty)
    assert out["reward_tensor"].sum().item() == pytest.approx(2.0 + penalty)
    assert out["reward_metrics"]["reward/overlong_penalty_mean"] == pytest.approx(penalty / 2)
    assert out["reward_metrics"]["response/overlong_frac"] == 0.5
    # the same formula the trainer's module exports (one implementation)
    assert trainer_dapo.apply_overlong_penalty is OverlongBuffer.apply.__globals__["apply_overlong_penalty"]
    # without a buffer (validation), dapo is naive
    plain = DAPORewardManager(tokenizer, 0, timeout_s=None)
    assert torch.equal(plain(batch), NaiveRewardManager(tokenizer, 0, timeout_s=None)(batch))


def test_the_buffer_applies_to_reward_model_scores_alone_too(tokenizer):
    batch = make_batch(tokenizer, SAMPLES[:2], response_len=12)
    batch.batch["rm_scores"] = torch.zeros(2, 12)
    manager = NaiveRewardManager(tokenizer, 0, timeout_s=None, overlong_buffer=OverlongBuffer(12, 8, 1.0))
    out = manager(batch, return_dict=True)
    assert out["reward_tensor"].sum().item() < 0 and "reward/overlong_penalty_mean" in out["reward_metrics"]


@pytest.mark.parametrize("manager,enable,training,has_buffer", [
    ("dapo", None, True, True),  # dapo: on by default
    ("dapo", None, False, False),  # validation scores the task alone
    ("dapo", False, True, False),  # switched off: naive
    ("naive", True, True, True),  # naive with the buffer, as before
    ("naive", True, False, False),
    ("naive", None, True, False),
    ("batch", True, True, True),
])
def test_the_loader_gives_the_buffer_to_the_training_manager(tokenizer, manager, enable, training, has_buffer):
    config = _config(**{"reward_model.reward_manager": manager, "reward_model.overlong_buffer.enable": enable,
                        "custom_reward_function.timeout_s": None})
    built = load_reward_manager(config, tokenizer, num_examine=0, training=training)
    assert type(built) is get_reward_manager_cls(manager)
    assert (built.overlong_buffer == OverlongBuffer(64, None, 1.0)) if has_buffer else built.overlong_buffer is None


# ---- a manager the user's reward file registers ---------------------------------------------------------


def test_a_manager_registered_in_the_reward_file_is_used(tmp_path, tokenizer):
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent('''
        from hflow.reward.managers import BatchRewardManager, register

        def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
            return [2.0] * len(solution_strs)

        @register("unit_test_mine")
        class Mine(BatchRewardManager):
            pass
    '''))
    config = _config(str(path), **{"reward_model.reward_manager": "unit_test_mine",
                                   "custom_reward_function.timeout_s": None})
    with pytest.raises(Exception, match="unit_test_mine"):
        get_reward_manager_cls("unit_test_mine")  # not known before its file is imported
    check_reward_fn_signature(get_custom_reward_fn(config), "unit_test_mine")  # what preflight does: the import
    manager = load_reward_manager(config, tokenizer, num_examine=0)
    assert type(manager).__name__ == "Mine"
    assert manager(make_batch(tokenizer, SAMPLES[:2])).sum().item() == 4.0


def test_dapo_preflight_checks_the_buffer_it_turns_on():
    config = _config(**{"reward_model.reward_manager": "dapo", "data.max_response_length": 4})
    with pytest.raises(Exception, match="null: a fifth"):
        trainer_dapo.check_dapo_config(config)
    OmegaConf.update(config, "reward_model.overlong_buffer.enable", False)
    trainer_dapo.check_dapo_config(config)


@pytest.mark.parametrize("overrides,named", [
    (["custom_reward_function.url=127.0.0.1:8000"], "custom_reward_function.url='127.0.0.1:8000': give an http"),
    (["custom_reward_function.url=http://127.0.0.1:1", "custom_reward_function.max_retries=-1"], "max_retries=-1"),
    (["custom_reward_function.url=http://127.0.0.1:1", "custom_reward_function.path={batch_file}",
      "custom_reward_function.name=batch_exact"], "not both"),
    (["reward_model.reward_manager=batch", "custom_reward_function.path={batch_file}",
      "custom_reward_function.name=per_sample"], "passes lists"),
])
def test_preflight_checks_the_remote_scorer_and_the_batch_signature(batch_file, overrides, named):
    from hydra import compose, initialize_config_dir

    from hflow.config_schema import ConfigError

    from hflow.trainer.config import validate_config
    from hflow.trainer.main_ppo import CONFIG_DIR, fill_builtin_defaults
    from hflow.trainer.preflight import preflight_check

    overrides = [o.format(batch_file=batch_file) for o in overrides]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = validate_config(compose(config_name="ppo_trainer", overrides=overrides))
    fill_builtin_defaults(config, frozenset(o.split("=")[0] for o in overrides))
    with pytest.raises((ConfigError, RewardSignatureError), match=named):
        preflight_check(config)


def test_with_a_stop_token_the_buffer_measures_the_response_as_generated(tokenizer):
    """The trainer shows the manager each response cut after `algorithm.stop_token`; the overlong buffer
    still measures what was generated (as before it moved into the manager)."""
    from types import SimpleNamespace

    from hflow.reward.batch_scorer import BatchScorer

    stop = tokenizer("!", add_special_tokens=False)["input_ids"][0]
    batch = make_batch(tokenizer, [("What is 2 + 3?", "5 ! and then a lot more text here", "hflow/arithmetic", "5")],
                       response_len=16)
    generated = response_lengths(batch)[0]
    config = OmegaConf.create({"algorithm": {"missing_stop_penalty": None}})
    scorer = SimpleNamespace(stop_token_id=stop, tokenizer=tokenizer, use_rm=False, config=config)
    manager = NaiveRewardManager(tokenizer, 0, timeout_s=None, overlong_buffer=OverlongBuffer(16, 8, 1.0))
    scores, reward, _ = BatchScorer.score(scorer, batch, manager)
    penalty = min(-(generated - 8) / 8, 0.0)
    assert penalty < 0 and scores.sum().item() == pytest.approx(1.0 + penalty)
    assert reward["reward_metrics"]["reward/overlong_penalty_mean"] == pytest.approx(penalty)
