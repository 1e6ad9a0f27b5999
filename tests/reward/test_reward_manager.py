"""NaiveRewardManager: decoding, score placement, extra info, robustness; loading from the config."""

import pickle
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hflow.protocol import DataProto
from hflow.reward.managers import (
    NaiveRewardManager,
    RewardFunctionError,
    get_custom_reward_fn,
    get_reward_manager_cls,
    load_reward_manager,
    register,
)
from hflow.reward.managers.registry import REWARD_MANAGERS

CONFIG_PATH = Path(__file__).resolve().parents[2] / "config" / "ppo_trainer.yaml"

REWARD_FILE = '''
import os
import re


def exact(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    ok = solution_str.strip().endswith(str(ground_truth))
    return {"score": float(ok) + bonus, "acc": ok, "pred": solution_str.strip()[-1:]}


def first_has_more(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "first_only": 7} if extra_info["i"] == 0 else {"score": 0.5}


def misbehave(data_source, solution_str, ground_truth, extra_info=None):
    """Fails in the way the response asks for."""
    if "raise" in solution_str:
        raise ValueError("boom on purpose")
    if "hang" in solution_str:
        return re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking, holds the GIL
    if "die" in solution_str:
        os._exit(7)
    if "nan" in solution_str:
        return float("nan")
    if "text" in solution_str:
        return "yes"
    if "noscore" in solution_str:
        return {"acc": 1.0}
    return 1.0


def tool_use(data_source, solution_str, ground_truth, extra_info=None):
    """Rewards the answer and, separately, a calculator call that succeeded (seen in the episode)."""
    episode = extra_info["episode"]
    called = any(c["name"] == "calculator" and not c["error"] for c in episode["tool_calls"])
    return {"score": float(solution_str.strip() == str(ground_truth)), "called": called,
            "turns": episode["num_turns"], "row": extra_info["i"]}
'''


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from hflow.tasks.tiny_models import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "my_reward.py"
    path.write_text(REWARD_FILE)
    return str(path)


def make_batch(tokenizer, samples, prompt_len=24, response_len=16):
    """samples: (prompt, response, data_source, ground_truth); responses end with EOS, like vLLM's."""
    prompts, responses, masks = [], [], []
    for prompt, response, _, _ in samples:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] if response else []
        prompts.append([tokenizer.pad_token_id] * (prompt_len - len(p)) + p)
        responses.append(r + [tokenizer.pad_token_id] * (response_len - len(r)))
        masks.append([0] * (prompt_len - len(p)) + [1] * (len(p) + len(r)) + [0] * (response_len - len(r)))
    prompts, responses = torch.tensor(prompts), torch.tensor(responses)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.tensor(masks),
        },
        non_tensors={
            "data_source": [data_source for _, _, data_source, _ in samples],
            "reward_model": [{"style": "rule", "ground_truth": gt} for _, _, _, gt in samples],
            "extra_info": [{"i": i} for i in range(len(samples))],
        },
    )


def response_lengths(batch):
    return batch.batch["attention_mask"][:, batch.batch["prompts"].shape[1] :].sum(-1).tolist()


# ---- scoring and placement -----------------------------------------------------------------------


def test_default_scorers_by_data_source_at_last_token(tokenizer, capsys):
    samples = [
        ("What is 2 + 3?", "2 + 3 = 5. Answer: 5", "hflow/arithmetic", "5"),
        ("What is 6 * 7?", "Answer: 41", "hflow/arithmetic", "42"),
        ("Tom has 3 apples and buys 4 more.", "3 + 4 = 7 #### 7", "openai/gsm8k", "7"),
        ("Tom has 3 apples.", "It is 3", "openai/gsm8k", "3"),
    ]
    batch = make_batch(tokenizer, samples)
    manager = NaiveRewardManager(tokenizer, num_examine=1)
    scores = manager(batch)
    manager.close()

    assert scores.dtype == torch.float32 and scores.shape == batch.batch["responses"].shape
    expected = torch.zeros_like(scores)
    for i, (length, value) in enumerate(zip(response_lengths(batch), [1.0, 0.0, 1.0, 0.0], strict=True)):
        expected[i, length - 1] = value
    assert torch.equal(scores, expected)
    # One example per data source, decoded without special tokens.
    out = capsys.readouterr().out
    assert out.count("[response]") == 2
    assert "[response] 2 + 3 = 5. Answer: 5\n" in out and "[prompt] What is 2 + 3?" in out
    assert "<|im_end|>" not in out


def test_dict_results_become_extra_info(tokenizer, reward_file):
    samples = [("q", "it is 7", "any/source", "7"), ("q", "it is 8", "any/source", "7")]
    manager = NaiveRewardManager(tokenizer, 0, compute_score=get_custom_reward_fn(_config(reward_file, "exact")))
    out = manager(make_batch(tokenizer, samples), return_dict=True)
    manager.close()
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 0.0]
    assert out["reward_extra_info"] == {"acc": [True, False], "pred": ["7", "8"]}
    assert out["reward_metrics"] == {"reward/errors": 0}


def test_extra_keys_missing_in_some_samples_are_none(tokenizer, reward_file):
    samples = [("q", "a", "s", "1"), ("q", "b", "s", "1")]
    fn = get_custom_reward_fn(_config(reward_file, "first_has_more"))
    out = NaiveRewardManager(tokenizer, 0, compute_score=fn, timeout_s=None)(
        make_batch(tokenizer, samples), return_dict=True
    )
    assert out["reward_extra_info"] == {"first_only": [7, None]}


def test_reward_kwargs_are_bound_and_call_time_kwargs_win(tokenizer, reward_file):
    fn = get_custom_reward_fn(_config(reward_file, "exact", reward_kwargs={"bonus": 0.5}))
    assert fn("s", "it is 7", "7")["score"] == 1.5
    samples = [("q", "it is 7", "s", "7")]
    manager = NaiveRewardManager(tokenizer, 0, compute_score=fn, bonus=2.0)
    assert manager(make_batch(tokenizer, samples)).sum().item() == 3.0
    manager.close()


def test_empty_response_scores_at_position_zero(tokenizer):
    batch = make_batch(tokenizer, [("What is 0 + 0?", "", "hflow/arithmetic", "0")])
    scores = NaiveRewardManager(tokenizer, 0, timeout_s=None)(batch)
    assert scores.abs().sum().item() == 0.0  # nothing to score: an empty answer is wrong
    fixed = NaiveRewardManager(tokenizer, 0, compute_score=lambda **_: 1.0, timeout_s=None)(batch)
    assert fixed[0, 0].item() == 1.0 and fixed.sum().item() == 1.0


def test_rm_scores_pass_through_or_add_to_rule_scores(tokenizer):
    batch = make_batch(tokenizer, [("q", "Answer: 3", "hflow/arithmetic", "3")])
    rm_scores = torch.zeros(batch.batch["responses"].shape)
    rm_scores[0, 2] = 0.25
    batch.batch["rm_scores"] = rm_scores
    assert NaiveRewardManager(tokenizer, 0, timeout_s=None)(batch) is rm_scores
    combined = NaiveRewardManager(tokenizer, 0, compute_score=lambda **_: 1.0, timeout_s=None)(batch)
    assert combined[0, 2].item() == 0.25 and combined.sum().item() == 1.25


def test_missing_ground_truth_or_data_source_is_named(tokenizer):
    batch = make_batch(tokenizer, [("q", "a", "s", "1"), ("q", "b", "s", "1")])
    batch.non_tensor_batch["reward_model"][1] = {"style": "model"}
    with pytest.raises(KeyError, match="sample 1 has reward_model"):
        NaiveRewardManager(tokenizer, 0, timeout_s=None)(batch)
    with pytest.raises(KeyError, match=r"no non-tensor 'task'.*data\.reward_fn_key"):
        NaiveRewardManager(tokenizer, 0, reward_fn_key="task", timeout_s=None)(batch)


# ---- robustness ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def misbehaving_manager(tokenizer, reward_file):
    fn = get_custom_reward_fn(_config(reward_file, "misbehave"))
    manager = NaiveRewardManager(tokenizer, 0, compute_score=fn, timeout_s=1.0, num_workers=2)
    yield manager
    manager.close()


@pytest.mark.parametrize(
    ("response", "message"),
    [
        ("raise", r"ValueError: boom on purpose"),
        ("hang", r"timed out after 1 s"),
        ("die", r"died during the call \(exit code 7\)"),
        ("nan", r"returned nan; scores must be finite"),
        ("text", r"returned 'yes' \(str\)"),
        ("noscore", r"without a 'score' key"),
    ],
)
def test_failures_name_sample_and_data_source(tokenizer, misbehaving_manager, response, message):
    samples = [("q", "fine", "good/source", "1"), ("q", f"please {response}", "bad/source", "1")]
    start = time.monotonic()
    with pytest.raises(RewardFunctionError, match=message) as error:
        misbehaving_manager(make_batch(tokenizer, samples))
    assert "sample 1 (data_source='bad/source')" in str(error.value)
    assert "on_error=zero" in str(error.value)
    assert "\n" not in str(error.value) and "Traceback" not in str(error.value)  # the run's one last line
    assert time.monotonic() - start < 10
    # The pool recovers: the next batch scores normally.
    assert misbehaving_manager(make_batch(tokenizer, samples[:1])).sum().item() == 1.0


def test_traceback_points_into_the_users_file(tokenizer, misbehaving_manager, reward_file):
    with pytest.raises(RewardFunctionError) as error:
        misbehaving_manager(make_batch(tokenizer, [("q", "raise", "s", "1")]))
    assert reward_file in str(error.value) and "in misbehave" in str(error.value)


def test_on_error_zero_scores_failures_zero_and_counts_them(tokenizer, reward_file, capsys):
    fn = get_custom_reward_fn(_config(reward_file, "misbehave"))
    manager = NaiveRewardManager(tokenizer, 0, compute_score=fn, timeout_s=1.0, on_error="zero", num_workers=2)
    samples = [("q", response, "s", "1") for response in ["fine", "hang", "fine", "raise", "text", "fine"]]
    start = time.monotonic()
    out = manager(make_batch(tokenizer, samples), return_dict=True)
    manager.close()
    assert time.monotonic() - start < 10
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert out["reward_metrics"] == {"reward/errors": 3}
    assert out["reward_extra_info"]["reward_error"] == [False, True, False, True, True, False]
    assert "3/6 samples failed and were scored 0" in capsys.readouterr().out


def test_unpicklable_function_needs_in_process_mode(tokenizer):
    with pytest.raises(TypeError, match=r"custom_reward_function\.timeout_s=null"):
        NaiveRewardManager(tokenizer, 0, compute_score=lambda **_: 1.0)

    def from_script(**_):
        return 1.0

    from_script.__module__ = "__main__"
    with pytest.raises(TypeError, match="defined in __main__"):
        NaiveRewardManager(tokenizer, 0, compute_score=from_script)
    with pytest.raises(ValueError, match="on_error='ignore'"):
        NaiveRewardManager(tokenizer, 0, on_error="ignore")
    with pytest.raises(ValueError, match="timeout_s=0"):
        NaiveRewardManager(tokenizer, 0, timeout_s=0)


def test_in_process_mode_reports_errors_too(tokenizer):
    def broken(**_):
        raise RuntimeError("inline failure")

    with pytest.raises(RewardFunctionError, match="inline failure"):
        NaiveRewardManager(tokenizer, 0, compute_score=broken, timeout_s=None)(
            make_batch(tokenizer, [("q", "a", "s", "1")])
        )


def test_manager_pickles_without_its_processes(tokenizer, reward_file):
    manager = NaiveRewardManager(tokenizer, 0, compute_score=get_custom_reward_fn(_config(reward_file, "exact")))
    batch = make_batch(tokenizer, [("q", "it is 7", "s", "7")])
    assert manager(batch).sum().item() == 1.0
    copy = pickle.loads(pickle.dumps(manager))
    assert copy(batch).sum().item() == 1.0
    manager.close()
    copy.close()


# ---- loading from the config ---------------------------------------------------------------------


def _config(path=None, name="compute_score", reward_kwargs=None, **overrides):
    config = OmegaConf.load(CONFIG_PATH)
    config.custom_reward_function.path = path
    config.custom_reward_function.name = name
    config.custom_reward_function.reward_kwargs = reward_kwargs or {}
    for key, value in overrides.items():
        OmegaConf.update(config, key, value)
    return config


def test_load_reward_manager_from_config(tokenizer, reward_file):
    manager = load_reward_manager(
        _config(reward_file, "exact", **{"custom_reward_function.timeout_s": 5, "data.reward_fn_key": "src"}),
        tokenizer,
        num_examine=0,
    )
    assert isinstance(manager, NaiveRewardManager)
    assert (manager.timeout_s, manager.on_error, manager.reward_fn_key) == (5, "raise", "src")
    assert manager.has_rule_fn
    default = load_reward_manager(_config(), tokenizer, num_examine=1)
    assert not default.has_rule_fn and default.num_examine == 1
    batch = make_batch(tokenizer, [("q", "#### 3", "openai/gsm8k", "3")])
    assert default(batch).sum().item() == 1.0
    manager.close()
    default.close()


def test_custom_reward_fn_errors_name_key_and_file(tmp_path):
    assert get_custom_reward_fn(_config(None)) is None
    missing = str(tmp_path / "nope.py")
    with pytest.raises(FileNotFoundError, match=r"custom_reward_function\.path=.*nope\.py"):
        get_custom_reward_fn(_config(missing))

    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(RuntimeError, match=r"custom_reward_function\.path=.*broken\.py.*SyntaxError"):
        get_custom_reward_fn(_config(str(broken)))

    good = tmp_path / "good.py"
    good.write_text(textwrap.dedent("def score_a(**kw):\n    return 1.0\n"))
    with pytest.raises(AttributeError, match=r"name='compute_score'.*good\.py.*\['score_a'\]"):
        get_custom_reward_fn(_config(str(good)))


def test_registry(monkeypatch):
    assert get_reward_manager_cls("naive") is NaiveRewardManager
    with pytest.raises(ValueError, match=r"reward_manager='fancy'.*\['batch', 'dapo', 'naive'"):
        get_reward_manager_cls("fancy")

    monkeypatch.setitem(REWARD_MANAGERS, "test-only", NaiveRewardManager)

    class Other:
        pass

    with pytest.raises(ValueError, match="already taken"):
        register("test-only")(Other)
    assert register("test-only")(NaiveRewardManager) is NaiveRewardManager


def test_the_example_reward_function_loads_and_scores():
    from pathlib import Path

    from hflow.reward.managers import get_custom_reward_fn
    from hflow.trainer.config import default_config

    example = Path(__file__).resolve().parents[2] / "examples" / "reward_functions" / "length_penalty.py"
    config = default_config()
    config.custom_reward_function.path = str(example)
    config.custom_reward_function.reward_kwargs = {"penalty_per_char": 0.01}
    fn = get_custom_reward_fn(config)
    result = fn("openai/gsm8k", "so the answer is #### 72", "72")
    assert result["correct"] == 1.0
    assert result["score"] == 1.0 - 0.01 * len("so the answer is #### 72")


def test_multi_turn_reward_judges_the_final_answer_and_sees_the_episode(tokenizer, reward_file):
    """With an `episode` per sample (multi-turn rollouts), `solution_str` is the last assistant message (not
    the whole decoded episode, whose tool output holds the right number too) and extra_info keeps the
    row's own keys beside `episode`."""
    samples = [("What is 37 * 86?", "call 3182 answer 3182", "hflow/multiply", "3182"),
               ("What is 37 * 86?", "call 3182 answer 2400", "hflow/multiply", "3182")]
    batch = make_batch(tokenizer, samples)
    call = {"name": "calculator", "arguments": {"expression": "37 * 86"}, "result": "3182", "error": None}
    batch.non_tensor_batch["episode"] = np.array([
        {"messages": [{"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role": "tool", "content": "3182"},
                      {"role": "assistant", "content": answer}], "tool_calls": [call], "num_turns": 2}
        for answer in ("3182", "2400")], dtype=object)
    manager = NaiveRewardManager(tokenizer, 0, compute_score=get_custom_reward_fn(_config(reward_file, "tool_use")))
    out = manager(batch, return_dict=True)
    manager.close()
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 0.0]
    assert out["reward_extra_info"] == {"called": [True, True], "turns": [2, 2], "row": [0, 1]}
