"""Preflight's sandbox check: a run with code tools or code rewards stops when the sandbox cannot isolate
code (namespaces refused by a seccomp filter on the sandbox's launcher, as under Docker), names who
needs it and the ways out; `sandbox.allow_unisolated=true` lets it start with a warning and a record."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hflow.config_schema import ConfigError
from hflow.trainer.config import default_config
from hflow.sandbox import LocalSandbox, RemoteSandbox, isolation, local
from hflow.trainer.code_isolation import check_code_isolation, code_sandboxes
from tests.sandbox.refusal import refuse_namespaces

PYTHON_TOOLS = """
tools:
  - class_name: calculator
  - class_name: python
    config: {wall_time_s: 5}
"""


@pytest.fixture
def refused(tmp_path, monkeypatch):
    refuse_namespaces(monkeypatch, tmp_path)


def write_data(path, sources):
    pq.write_table(pa.table({"prompt": ["p"] * len(sources), "data_source": sources}), path)
    return str(path)


@pytest.fixture
def config(tmp_path):
    config = default_config()
    config.data.train_files = write_data(tmp_path / "train.parquet", ["openai/gsm8k", "apps"])
    config.data.val_files = write_data(tmp_path / "val.parquet", ["hflow/code"])
    config.trainer.log_dir = str(tmp_path / "logs")
    return config


def with_python_tool(config, tmp_path, backend=None):
    tools = tmp_path / "tools.yaml"
    tools.write_text(PYTHON_TOOLS if backend is None else PYTHON_TOOLS.replace("{wall_time_s: 5}", backend))
    config.actor_rollout_ref.rollout.multi_turn.enable = True
    config.actor_rollout_ref.rollout.multi_turn.tool_config_path = str(tools)
    return str(tools)


def test_code_sandboxes_finds_code_tools_and_code_rewards(config, tmp_path):
    found = code_sandboxes(config)
    assert list(found) == ["code rewards (data_source 'apps', 'hflow/code')"]
    tools = with_python_tool(config, tmp_path)
    found = code_sandboxes(config)
    assert list(found)[0] == f"the 'python' tool (tools[1] of {tools})"
    assert isinstance(found[list(found)[0]], LocalSandbox) and found[list(found)[0]].limits.wall_time_s == 5
    with_python_tool(config, tmp_path, backend="{backend: remote, url: 'http://h:8080/run_code'}")
    assert isinstance(next(iter(code_sandboxes(config).values())), RemoteSandbox)


def test_no_code_no_sandbox(config, tmp_path):
    config.data.train_files = config.data.val_files = write_data(tmp_path / "math.parquet", ["openai/gsm8k"])
    config.actor_rollout_ref.rollout.multi_turn.enable = True  # the built-in calculator
    assert code_sandboxes(config) == {}
    config.custom_reward_function.url = "http://h/score"
    config.data.train_files = write_data(tmp_path / "code.parquet", ["apps"])
    assert code_sandboxes(config) == {}  # scored elsewhere
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    config.custom_reward_function.url, config.custom_reward_function.path = None, str(reward)
    assert code_sandboxes(config) == {}
    reward.write_text("from hflow.reward.score import code_exec\n" + reward.read_text())
    assert list(code_sandboxes(config)) == [
        f"the reward function of custom_reward_function.path={reward} (it uses hflow.sandbox)"]


def test_preflight_stops_a_run_whose_sandbox_cannot_isolate(refused, config, tmp_path):
    tools = with_python_tool(config, tmp_path)
    with pytest.raises(ConfigError) as caught:
        check_code_isolation(config)
    message = str(caught.value)
    assert f"the 'python' tool (tools[1] of {tools}); code rewards (data_source 'apps', 'hflow/code')" in message
    for needed in ("a user namespace", "a network namespace", "a read-only mount namespace", "a pid namespace"):
        assert needed in message
    assert "backend: remote, url:" in message and "privileged container" in message
    assert "sandbox.allow_unisolated=true" in message
    assert not (tmp_path / "logs").exists()


def test_allow_unisolated_starts_with_a_warning_and_a_record(refused, config, tmp_path, capsys):
    with_python_tool(config, tmp_path)
    config.sandbox.allow_unisolated = True
    for _ in range(2):  # a warning at every start
        report = check_code_isolation(config)
        assert "WARNING: model-written code runs WITHOUT isolation" in capsys.readouterr().err
    assert len(report.unisolated) == 2
    lines = [json.loads(line) for line in (tmp_path / "logs" / "sandbox.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[-1]["allow_unisolated"] is True and lines[-1]["isolated"] is False
    assert "WITHOUT isolation" in lines[-1]["warning"]


def test_isolated_run_passes_and_is_recorded(config, monkeypatch):
    """Where this machine isolates, the run passes and is recorded; where it refuses namespaces (no wrapper:
    the machine's own refusal), preflight stops the run instead, naming what is missing, before any log."""
    monkeypatch.delenv(isolation.ALLOW_UNISOLATED_ENV, raising=False)
    missing = isolation.missing_isolation(local.sandbox_capabilities())
    if missing:
        with pytest.raises(ConfigError) as caught:
            check_code_isolation(config)
        assert "code rewards (data_source 'apps', 'hflow/code')" in str(caught.value)
        assert all(isolation.REQUIRED_ISOLATION[key] in str(caught.value) for key in missing)
        assert not Path(config.trainer.log_dir).exists()
        return
    report = check_code_isolation(config)
    assert report.unisolated == {} and report.warning is None
    with open(f"{config.trainer.log_dir}/sandbox.jsonl") as f:
        record = json.loads(f.read())
    assert record["isolated"] is True and record["sandboxes"] == {"code rewards (data_source 'apps', 'hflow/code')": "local"}
