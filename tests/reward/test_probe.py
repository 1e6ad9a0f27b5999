"""`hflow.reward.probe`: the run's reward is tried on a few validation rows before anything starts, so a reward
that cannot score stops the run in seconds, naming the reward, the row and the reason (issue 39)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import open_dict

from hflow.config_schema import ConfigError
from hflow.trainer.config import default_config
from hflow.reward.probe import PROBE_ROWS, WRONG_ANSWER, probe_reward

GOOD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == str(ground_truth))
"""
RETURNS_NONE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return None
"""
NONE_WHEN_WRONG = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == str(ground_truth) else None
"""
RETURNS_A_STRING = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return "correct"
"""
SLOW = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(60)
    return 1.0
"""
BATCH_RETURNS_ONE = """
def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
    return 1.0
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("probe")
    rows = [{"data_source": "hflow/arithmetic", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}
            for i in range(10)]
    pq.write_table(pa.Table.from_pylist(rows), root / "val.parquet")
    for name, text in (("good", GOOD), ("none", RETURNS_NONE), ("none_when_wrong", NONE_WHEN_WRONG), ("string", RETURNS_A_STRING), ("slow", SLOW), ("batch", BATCH_RETURNS_ONE)):
        (root / f"{name}.py").write_text(text)
    return root


def config_for(files: Path, **reward):
    config = default_config()
    with open_dict(config):
        config.data.train_files = config.data.val_files = str(files / "val.parquet")
        for key, value in reward.items():
            if key == "manager":
                config.reward_model.reward_manager = value
            elif key == "reward_model":
                config.reward_model.enable = value
            else:
                config.custom_reward_function[key] = value
    return config


def test_a_reward_that_scores_passes(files):
    assert probe_reward(config_for(files, path=str(files / "good.py"))) == PROBE_ROWS
    assert probe_reward(config_for(files)) == PROBE_ROWS  # the built-in scorer of hflow/arithmetic


def test_a_reward_that_returns_a_string_stops_naming_the_row_and_the_value(files):
    with pytest.raises(ConfigError) as error:
        probe_reward(config_for(files, path=str(files / "string.py")))
    message = str(error.value)
    for words in (f"custom_reward_function.path={files / 'string.py'}", "row 0 of", "data_source='hflow/arithmetic'",
                  "returned 'correct'", "nothing has started yet"):
        assert words in message, (words, message)


def test_a_reward_that_returns_none_stops_in_preflight(files):
    with pytest.raises(ConfigError, match="row 0 of .*returned None"):
        probe_reward(config_for(files, path=str(files / "none.py")))


def test_a_reward_that_scores_only_right_answers_stops_naming_the_wrong_one(files, capsys):
    """Issue 53: most generated responses are wrong; a reward that returns None for them passes a probe with the
    ground truth alone and fails only after generation. With on_error=zero (failures scored 0) it only warns."""
    with pytest.raises(ConfigError) as error:
        probe_reward(config_for(files, path=str(files / "none_when_wrong.py")))
    message = str(error.value)
    for words in ("row 0 of", f"scored with a wrong answer {WRONG_ANSWER!r} as the response", "returned None",
                  "for any response, right or wrong"):
        assert words in message, (words, message)
    assert probe_reward(config_for(files, path=str(files / "none_when_wrong.py"), on_error="zero")) == PROBE_ROWS
    assert f"{PROBE_ROWS} of {2 * PROBE_ROWS} tries failed" in capsys.readouterr().out


def test_a_reward_past_its_timeout_stops_in_its_time(files):
    started = time.monotonic()
    with pytest.raises(ConfigError, match="custom_reward_function.path=.*slow.py.*timeout"):
        probe_reward(config_for(files, path=str(files / "slow.py"), timeout_s=2))
    assert time.monotonic() - started < 15


def test_a_batch_function_is_tried_as_the_batch_manager_calls_it(files):
    with pytest.raises(ConfigError, match="batch call returned float"):
        probe_reward(config_for(files, path=str(files / "batch.py"), manager="batch"))


def test_a_url_where_nothing_listens_stops_within_seconds_without_advising_zero_rewards(files):
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ConfigError) as error:
        probe_reward(config_for(files, url=f"http://127.0.0.1:{port}/score", max_retries=5, request_timeout_s=60))
    assert time.monotonic() - started < 15  # one try, not six of up to a minute
    message = str(error.value)
    assert f"custom_reward_function.url=http://127.0.0.1:{port}/score" in message and "row 0" in message
    assert "Start the scoring service" in message and "on_error" not in message


def test_a_reward_model_alone_is_not_probed(files):
    assert probe_reward(config_for(files, reward_model=True)) == 0


def test_a_weighted_reward_key_the_function_does_not_return_stops_in_preflight(files, tmp_path):
    """GDPO (issue 52): each name of algorithm.reward_weights must be a key of the function's dict."""
    two = tmp_path / "two.py"
    two.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                   "    return {'score': 1.0, 'correct': 1.0, 'format': 0.0}\n")
    config = config_for(files, path=str(two))
    with open_dict(config):
        config.algorithm.adv_estimator = "gdpo"
        config.algorithm.reward_weights = {"correct": 1.0, "format": 0.5, "score": 0.1}
    assert probe_reward(config) == PROBE_ROWS
    with open_dict(config):
        config.algorithm.reward_weights = {"correct": 1.0, "length": 0.5}
    with pytest.raises(ConfigError) as error:
        probe_reward(config)
    for words in ("algorithm.reward_weights names 'length'", "row 0 of", "['correct', 'format', 'score']",
                  "nothing has started yet"):
        assert words in str(error.value), (words, str(error.value))
