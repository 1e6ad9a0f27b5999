"""`python -m hflow.trainer.main_ppo` as a user meets it: what the console shows, and how a run that the
user's config, data or reward function cannot run ends (the message alone, as the last lines; no
traceback; no Ray start for what can be checked before it).

The bad inputs that stop before training run through the module's `main()` in this process (Hydra, the
command-line check, `run_cli`: tests/trainer/test_user_errors.py's `run_in_process`, where reaching `train()`
fails the test); one bad configuration runs as a user runs it, in a fresh interpreter, timed and watched for
Ray's daemons, and so does the run whose reward function fails during training.
"""

import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hflow.tasks.builtin_task import ensure_builtin_assets
from tests.conftest import REPO_ROOT
from tests.trainer.test_user_errors import run_in_process

RAY_PROCESSES = ("raylet", "gcs_server")


@pytest.fixture(scope="module")
def builtin():
    return ensure_builtin_assets()


def main_ppo(cwd: Path, *args: str, timeout: float = 600, env: dict | None = None) -> tuple[int, str, set[str]]:
    """Run the command line; returns (exit code, stdout + stderr, names of the Ray daemons it started)."""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("HYDRA_FULL_ERROR", None)
    # Output goes to a file, not a pipe: nobody reads a pipe while we poll, and a full one would block the run.
    log = open(cwd / "main_ppo.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "hflow.trainer.main_ppo", *args], cwd=cwd, env=env,
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    started, deadline = set(), time.monotonic() + timeout
    try:
        while proc.poll() is None:  # watch for Ray's daemons while the run lasts
            assert time.monotonic() < deadline, "main_ppo did not finish in time"
            try:
                started |= {p.name() for p in psutil.Process(proc.pid).children(recursive=True)
                            if p.name() in RAY_PROCESSES}
            except psutil.Error:
                pass
            time.sleep(0.05)
        log.seek(0)
        output = log.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    return proc.returncode, output, started


def assert_ray_not_started() -> None:
    """For a case run in this process: no Ray here (`run_in_process` fails the case if train() is reached)."""
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()


def last_lines(output: str, n: int = 3) -> str:
    return "\n".join([line for line in output.splitlines() if line.strip()][-n:])


def assert_ends_with_the_message(code: int, output: str, *named: str) -> None:
    assert code == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    tail = last_lines(output)
    assert "hflow: error: " in tail, output[-3000:]
    for text in named:
        assert text in tail, (text, tail)


def test_a_bad_configuration_fails_in_seconds_naming_the_key_without_starting_ray(builtin, tmp_path):
    started = time.monotonic()
    code, output, daemons = main_ppo(
        tmp_path, f"data.train_files={builtin.train_file}", f"data.val_files={builtin.val_file}",
        f"actor_rollout_ref.model.path={builtin.model_path}", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=3")
    assert time.monotonic() - started < 30, output  # the interpreter and imports are most of it
    assert_ends_with_the_message(code, output, "actor_rollout_ref.actor.ppo_mini_batch_size")
    assert "Started a local Ray instance" not in output
    assert not daemons


# The four ways a new user's own files stop a run: (files to write, overrides, words the message must hold).
def _no_prompt_column(root: Path, builtin) -> list[str]:
    pq.write_table(pq.read_table(builtin.train_file).drop(["prompt"]), root / "train.parquet")
    return [f"data.train_files={root / 'train.parquet'}"]


def _unknown_data_source(root: Path, builtin) -> list[str]:
    rows = pq.read_table(builtin.train_file).to_pylist()
    for row in rows:
        row["data_source"] = "my/task"
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    return [f"data.train_files={root / 'train.parquet'}"]


def _corrupt_parquet(root: Path, builtin) -> list[str]:
    (root / "train.parquet").write_bytes(b"not a parquet file\n" * 20)
    return [f"data.train_files={root / 'train.parquet'}"]


@pytest.mark.parametrize("make,named", [
    (_no_prompt_column, ["train.parquet", "'prompt'", "data.prompt_key"]),
    (_unknown_data_source, ["train.parquet", "'my/task'", "custom_reward_function.path"]),
    (_corrupt_parquet, ["data.train_files", "train.parquet", "not a readable parquet file"]),
], ids=["no-prompt-column", "unknown-data-source", "corrupt-parquet"])
def test_a_bad_data_file_ends_the_run_with_a_message_naming_it(builtin, tmp_path, monkeypatch, capsys, make, named):
    args = make(tmp_path, builtin)
    code, output, _ = run_in_process(
        "hflow.trainer.main_ppo", [*args, f"data.val_files={builtin.val_file}",
                                   f"actor_rollout_ref.model.path={builtin.model_path}",
                                   "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"],
        tmp_path, monkeypatch, capsys)
    assert_ends_with_the_message(code, output, *named)
    assert_ray_not_started()  # data files are read before Ray starts


@pytest.mark.slow  # a training run on Ray, to its first validation
def test_a_reward_function_returning_none_ends_the_run_with_the_sample_and_no_ray_noise(tmp_path):
    reward = tmp_path / "my_reward.py"
    # None for a wrong number only: the preflight probe (the ground truth, and a wrong answer in words) passes, and
    # the run fails on a generated response (the built-in model answers one too high); a reward that returns None
    # for every wrong answer stops in preflight (reward-none-on-wrong-answers below, tests/reward/test_probe.py)
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if not solution_str.strip().isdigit():\n"
                      "        return 0.0\n"
                      "    return 1.0 if solution_str.strip() == str(ground_truth) else None\n")
    # the built-in task and model; the first validation's first sample fails
    code, output, _ = main_ppo(tmp_path, "algorithm.adv_estimator=grpo", f"custom_reward_function.path={reward}")
    assert_ends_with_the_message(code, output, "my_reward.py", "sample 0", "returned None",
                                 "custom_reward_function.on_error=zero")


# Bad inputs that once ended in a traceback or in Hydra's own message: (id, command line made in a folder
# for the files it needs, words the message must hold).
def _reward_file(root: Path, text: str) -> str:
    (root / "my_reward.py").write_text(text)
    return str(root / "my_reward.py")


def _reward_file_with_syntax_error(root: Path) -> list[str]:
    path = _reward_file(root, "def compute_score(:\n")
    return [f"custom_reward_function.path={path}"]


def _reward_function_not_in_file(root: Path) -> list[str]:
    path = _reward_file(root, "def score(*args, **kwargs):\n    return 1.0\n")
    return [f"custom_reward_function.path={path}", "custom_reward_function.name=compute_scor"]


def _reward_returning_a_string(root: Path) -> str:
    return _reward_file(root, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                              "    return 'yes'\n")


def _reward_none_when_wrong(root: Path) -> str:
    return _reward_file(root, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                              "    return 1.0 if solution_str.strip() == str(ground_truth) else None\n")


def _dead_url(root: Path) -> list[str]:
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [f"custom_reward_function.url=http://127.0.0.1:{port}/score"]


_BAD_INPUTS = [
    # issue 39: the reward is tried before the run (hflow.reward.probe)
    ("reward-url-where-nothing-listens", _dead_url,
     ["custom_reward_function.url=http://127.0.0.1:", "row 0", "Start the scoring service"]),
    ("reward-returning-a-string", lambda root: [f"custom_reward_function.path={_reward_returning_a_string(root)}"],
     ["my_reward.py", "row 0", "returned 'yes'"]),
    # issue 53: a reward that scores right answers only, tried with a wrong one too
    ("reward-none-on-wrong-answers", lambda root: [f"custom_reward_function.path={_reward_none_when_wrong(root)}"],
     ["my_reward.py", "row 0", "scored with a wrong answer", "returned None", "right or wrong"]),
    ("reward-file-syntax-error", _reward_file_with_syntax_error,
     ["custom_reward_function.path", "my_reward.py", "SyntaxError"]),
    ("reward-function-not-in-file", _reward_function_not_in_file,
     ["custom_reward_function.name='compute_scor'", "my_reward.py", "['score']"]),
    ("zero-prompt-length", lambda root: ["data.max_prompt_length=0"], ["data.max_prompt_length"]),
    ("negative-response-length", lambda root: ["data.max_response_length=-1"], ["data.max_response_length"]),
    ("zero-mini-batch", lambda root: ["actor_rollout_ref.actor.ppo_mini_batch_size=0"],
     ["actor_rollout_ref.actor.ppo_mini_batch_size"]),
    ("mistyped-key", lambda root: ["data.train_batchsize=8"],
     ["data.train_batchsize", "did you mean data.train_batch_size?"]),
    ("argument-without-value", lambda root: ["data.train_batch_size"], ["data.train_batch_size", "key=value"]),
]


@pytest.mark.parametrize("make,named", [case[1:] for case in _BAD_INPUTS], ids=[case[0] for case in _BAD_INPUTS])
def test_a_bad_input_ends_with_one_message_naming_it_before_ray_starts(builtin, tmp_path, monkeypatch, capsys,
                                                                      make, named):
    # the built-in task and model otherwise
    code, output, _ = run_in_process("hflow.trainer.main_ppo", make(tmp_path), tmp_path, monkeypatch, capsys)
    assert_ends_with_the_message(code, output, *named)
    # The message is the very last line printed (to stderr, after stdout was flushed).
    assert output.strip().splitlines()[-1].startswith("hflow: error: "), output[-3000:]
    assert_ray_not_started()


def test_the_command_line_check_lets_through_what_hydra_and_the_schema_accept(tmp_path):
    from hflow.config_schema import ConfigError
    from hflow.trainer.config import PPOTrainerConfig, SFTTrainerConfig
    from hflow.trainer.main_ppo import check_command_line

    check_command_line(["--multirun", "data.train_batch_size=8,16", "~trainer.logger", "hydra.run.dir=out",
                        "hydra/job_logging=disabled", "+custom_reward_function.reward_kwargs.bonus=1",
                        "actor_rollout_ref.actor.optim.betas=[0.9,0.99]"], PPOTrainerConfig)
    (tmp_path / "my_own.yaml").write_text("dataa: {}\n")
    for own in (["--config-dir", str(tmp_path)], ["--config-path", str(tmp_path)],
                [f"hydra.searchpath=[file://{tmp_path}]"]):  # a file of the user's, which the schema does not describe
        check_command_line([*own, "--config-name", "my_own", "dataa.anything=1"], PPOTrainerConfig)
    with pytest.raises(ConfigError, match="--config-name my_own: there is no my_own.yaml in .*ppo_trainer"):
        check_command_line(["--config-name", "my_own"], PPOTrainerConfig)
    check_command_line(["model.path=/m"], SFTTrainerConfig)
    with pytest.raises(ConfigError, match=r"\+custom_reward_function\.reward_kwargs\.bonus="):
        check_command_line(["custom_reward_function.reward_kwargs.bonus=1"], PPOTrainerConfig)  # new: needs +
    with pytest.raises(ConfigError, match="dataa is not a configuration key; did you mean data?"):
        check_command_line(["dataa.train_batch_size=8"], PPOTrainerConfig)


def test_several_bad_keys_of_one_command_are_reported_together():
    from hflow.config_schema import ConfigError
    from hflow.trainer.config import PPOTrainerConfig
    from hflow.trainer.main_ppo import check_command_line

    with pytest.raises(ConfigError) as err:
        check_command_line(["data.train_batchsize=8", "actor_rollout_ref.rollout.temprature=0.7",
                            "trainer.total_epochs=2", "data.max_prompt_length"], PPOTrainerConfig)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("3 problems"), str(err.value)
    assert lines[1].startswith("  1. data.train_batchsize is not a configuration key; did you mean data.train_batch_size?")
    assert lines[2].startswith("  2. actor_rollout_ref.rollout.temprature is not a configuration key; did you mean "
                               "actor_rollout_ref.rollout.temperature?")
    assert lines[3].startswith("  3. cannot read the command-line argument 'data.max_prompt_length'")


def test_the_issues_health_settings_end_in_one_error_naming_each_before_ray_starts(tmp_path, monkeypatch, capsys):
    """Issue 39: remedy=lr_scale lr_scale=-1 (gradient ascent after a rollback), zero_adv_group_frac=50,
    clip_scale=0 and a negative tool-result limit, all in one command: one `hflow: error:` naming each,
    before Ray starts."""
    code, output, _ = run_in_process(
        "hflow.trainer.main_ppo", [
            "trainer.health.enable=true", "trainer.health.remedy=lr_scale", "trainer.health.lr_scale=-1",
            "trainer.health.zero_adv_group_frac=50", "trainer.health.clip_scale=0",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=-5"], tmp_path, monkeypatch, capsys)
    assert code == 1 and "Traceback" not in output, output[-3000:]
    message = output[output.index("hflow: error: "):]
    assert message.startswith("hflow: error: 4 problems in the configuration"), output[-3000:]
    for key in ("trainer.health.lr_scale", "trainer.health.zero_adv_group_frac", "trainer.health.clip_scale",
                "multi_turn.max_tool_response_length=-5"):
        assert key in message, (key, message)
    assert_ray_not_started()


# --------------------------------------------------------------------------------------------- console

# What differs between two prints of the same message: Ray's and vLLM's process prefixes, time stamps,
# colour codes.
_VARIABLE = [
    re.compile(r"\x1b\[[0-9;]*m"),
    re.compile(r"\((?:\w+ )?pid=\d+(?:, ip=[\d.]+)?\)"),
    re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+"),
    re.compile(r"\b\d\d-\d\d \d\d:\d\d:\d\d\b"),
    re.compile(r"\[W\d{4} [\d:.]+ "),
    re.compile(r"\[rank\d+\]:"),
]
_WARNING = re.compile(r"warn|error|deprecat", re.IGNORECASE)


def _normalise(line: str) -> str:
    for pattern in _VARIABLE:
        line = pattern.sub("", line)
    return line.strip()


def assert_no_warning_twice(output: str) -> None:
    """No warning or error line (timestamps, pids and ranks aside) appears twice in a run's output; the
    built-in run's test (test_builtin_default.py) calls it on the README's main job."""
    warnings = Counter(_normalise(line) for line in output.splitlines() if _WARNING.search(line))
    repeated = {line: count for line, count in warnings.items() if count > 1}
    assert not repeated, "\n".join(f"{count}x {line}" for line, count in repeated.items())


def test_the_library_filter_drops_only_listed_library_messages(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(
        "import logging, warnings\n"
        "from hflow.utils.logging_utils import install_library_filter\n"
        "logging.basicConfig(format='%(name)s: %(message)s')\n"
        "install_library_filter()\n"
        "logging.getLogger('vllm.model_executor.model_loader.reload.layerwise').warning("
        "'%s: Failed to load weights', 'RotaryEmbedding')\n"
        "logging.getLogger('vllm.model_executor.model_loader.reload.layerwise').warning("
        "'%s: Failed to load weights', 'QKVParallelLinear')\n"
        "logging.getLogger('vllm.v1.worker.cpu_worker').warning('libtcmalloc is not found in LD_PRELOAD.')\n"
        "logging.getLogger('vllm.config.vllm').warning('max_num_seqs is larger than the batch')\n"
        "logging.getLogger('hflow.trainer').warning('data.train_batch_size is small')\n"
        "exec(compile(\"import warnings; warnings.warn('old API', FutureWarning)\", 'lib', 'exec'),"
        " {'__name__': 'somelib.module'})\n"
        "warnings.warn('your setting is deprecated', FutureWarning)\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("HFLOW_SHOW_LIBRARY_WARNINGS", None)
    quiet = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True).stderr
    assert "RotaryEmbedding" not in quiet and "libtcmalloc" not in quiet and "old API" not in quiet
    for kept in ("QKVParallelLinear: Failed to load weights", "max_num_seqs is larger", "data.train_batch_size",
                 "your setting is deprecated"):
        assert kept in quiet, (kept, quiet)
    loud = subprocess.run([sys.executable, str(script)], env={**env, "HFLOW_SHOW_LIBRARY_WARNINGS": "1"},
                          capture_output=True, text=True, check=True).stderr
    assert "RotaryEmbedding" in loud and "libtcmalloc" in loud and "old API" in loud
