"""The python tool: model-written code runs in hflow.sandbox, and the model sees its output and its limits."""

import asyncio
import textwrap

import pytest

from hflow.agent.parsers import ToolCall
from hflow.agent.tool_config import builtin_tools, load_tools
from hflow.agent.tools import PythonTool, run_tool_call
from hflow.sandbox import SandboxResult
from hflow.utils.errors import ConfigError
from tests.sandbox.refusal import allow_unisolated_where_refused, refuse_namespaces

pytestmark = pytest.mark.alone  # the sandbox's wall-time limit


@pytest.fixture(autouse=True)
def _unisolated_where_refused(monkeypatch):
    allow_unisolated_where_refused(monkeypatch)


def test_fails_closed_where_namespaces_are_refused(tmp_path, monkeypatch):
    # The sandbox refuses (as under Docker's seccomp profile): the tool's call fails, the code never runs.
    refuse_namespaces(monkeypatch, tmp_path)
    marker = tmp_path / "ran"
    outcome = call(PythonTool(), f"open({str(marker)!r}, 'w').write('x')")
    assert outcome.error == "raised" and "the sandbox failed" in outcome.text and "allow_unisolated" in outcome.text
    assert not marker.exists()
    monkeypatch.setenv("HFLOW_SANDBOX_ALLOW_UNISOLATED", "1")  # what a run with sandbox.allow_unisolated=true sets
    assert call(PythonTool(), "print(1)").text == "1\n"


def call(tool, code, timeout_s=30.0):
    return asyncio.run(run_tool_call({tool.name: tool}, ToolCall(tool.name, {"code": code}), timeout_s=timeout_s))


def test_stdout():
    outcome = call(PythonTool(), "print(sum(range(101)))")
    assert (outcome.text, outcome.error) == ("5050\n", None)
    assert outcome.metrics["limit_hit"] == 0.0 and outcome.metrics["sandbox_s"] > 0


def test_no_output():
    assert call(PythonTool(), "x = 1").text == "(no output)"


def test_an_error_shows_stderr_and_exit_code():
    outcome = call(PythonTool(), "print('before')\n1/0")
    assert outcome.error is None  # the program failed, not the tool: the model reads why
    assert outcome.text.startswith("before\n[stderr]\n")
    assert "ZeroDivisionError: division by zero" in outcome.text and outcome.text.endswith("[exit code 1]")


def test_a_limit_is_named():
    outcome = call(PythonTool({"wall_time_s": 1}), "while True: pass")
    assert outcome.error is None and "[stopped: wall_time limit hit]" in outcome.text
    assert outcome.metrics["limit_hit"] == 1.0


def test_the_code_runs_in_the_sandbox_not_in_this_process():
    outcome = call(PythonTool(), "import os, sys\nprint(os.getcwd()); print('hflow' in sys.modules)")
    cwd, imported = outcome.text.split()
    assert "hflow-sandbox-" in cwd and imported == "False"


def test_output_is_truncated():
    outcome = call(PythonTool({"max_output_chars": 100}), "print('x' * 5000)")
    assert outcome.text.startswith("x" * 100) and "more characters cut" in outcome.text
    assert len(outcome.text) < 200
    outcome = call(PythonTool({"max_output_chars": 100}), "import sys\nprint('o' * 500)\nprint('e' * 500, file=sys.stderr)")
    stdout, stderr = outcome.text.split("[stderr]\n")
    assert stdout.startswith("o" * 50) and stderr.startswith("e" * 50) and len(outcome.text) < 300


def test_a_failing_sandbox_is_a_tool_error():
    class Broken:
        def run(self, code, *, stdin=""):
            return SandboxResult("sandbox_error", None, "", "could not start python", None, 0.0, False)

    tool = PythonTool()
    tool.sandbox = Broken()
    outcome = call(tool, "print(1)")
    assert outcome.error == "raised" and outcome.text == "Error: RuntimeError: the sandbox failed: could not start python"


def test_builtin_and_yaml(tmp_path):
    assert list(builtin_tools(["python", "calculator"])) == ["python", "calculator"]
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent("""
        tools:
          - class_name: calculator
          - class_name: python
            config: {max_output_chars: 50, wall_time_s: 5}
    """))
    tools = load_tools(str(path))
    assert tools["python"].max_output_chars == 50 and tools["python"].tool_schema == PythonTool.default_schema()
    path.write_text("tools:\n  - class_name: calculator\n  - class_name: python\n    config: {wall_time: 5}\n")
    with pytest.raises(ConfigError, match=r"tools\[1\]: python\(config, tool_schema\) failed with ValueError: "
                                          r"unknown sandbox config key 'wall_time'"):
        load_tools(str(path))
