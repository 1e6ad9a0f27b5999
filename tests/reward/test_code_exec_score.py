"""The code-execution scorer: tests run in hflow.sandbox, both styles, partial passes, bounded time."""

import json
import time

import pytest

from hflow.sandbox import Sandbox, SandboxResult
from hflow.reward.score import SCORERS, default_compute_score
from hflow.reward.score.code_exec import DATA_SOURCES, compute_score, extract_code
from tests.sandbox.refusal import allow_unisolated_where_refused, refuse_namespaces

STDIO = {"inputs": ["1 2\n", "3 4\n", "10 -5\n"], "outputs": ["3\n", "7\n", "5"]}
CALL = {"fn_name": "add", "inputs": [[1, 2], [3, 4], [[1], [2]]], "outputs": [3, 7, [1, 2]]}


@pytest.fixture(autouse=True)
def _unisolated_where_refused(monkeypatch):
    allow_unisolated_where_refused(monkeypatch)


def test_fails_closed_where_namespaces_are_refused(tmp_path, monkeypatch):
    # The sandbox refuses (as under Docker's seccomp profile): no test runs, the error says why.
    refuse_namespaces(monkeypatch, tmp_path)
    result = compute_score(fenced("print(3)"), json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}))
    assert (result["score"], result["passed"]) == (0.0, 0)
    assert "sandbox_error: the local sandbox cannot isolate model-written code" in result["error"]


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nIt reads the input and prints the sum."


def test_stdio_all_pass_in_a_fence():
    result = compute_score(fenced("a, b = map(int, input().split())\nprint(a + b)"), json.dumps(STDIO))
    assert result == {"score": 1.0, "passed": 3, "total": 3, "error": None}


def test_stdio_partial_pass_not_in_a_fence():
    # open(0) reads the real stdin (fd 0): each test runs in its own process with its input there
    code = "a, b = map(int, open(0).read().split())\nprint(a + b if a < 5 else 0, '  ')\n\n"
    result = compute_score(code, STDIO)
    assert (result["passed"], result["total"], result["error"]) == (2, 3, None)
    assert result["score"] == pytest.approx(2 / 3)


def test_stdio_wrong_and_crashing_programs():
    assert compute_score(fenced("print(42)"), STDIO)["score"] == 0.0
    result = compute_score(fenced("raise SystemExit('bad input')"), STDIO)
    assert result["score"] == 0.0 and result["error"] == "test 0: exit code 1: bad input"


def test_last_fence_is_the_code():
    response = "```python\nprint('draft')\n```\nBetter:\n```python\nprint(sum(map(int, input().split())))\n```"
    assert extract_code(response) == "print(sum(map(int, input().split())))\n"
    assert compute_score(response, STDIO)["score"] == 1.0


def test_infinite_loop_scores_zero_in_bounded_time():
    start = time.monotonic()
    result = compute_score(fenced("while True:\n    pass"), STDIO, timeout_s=0.5)
    assert result["score"] == 0.0 and result["passed"] == 0 and "timed out after 0.5 s" in result["error"]
    assert time.monotonic() - start < 3 * 0.5 + 4


def test_function_call_style():
    code = "def add(a, b):\n    print('debug output must not matter')\n    return a + b"
    assert compute_score(fenced(code), CALL) == {"score": 1.0, "passed": 3, "total": 3, "error": None}


def test_function_call_partial_leetcode_class_and_tuples():
    code = "class Solution:\n    def add(self, a, b):\n        return (a + b) if a != 3 else 0"
    result = compute_score(code, json.dumps(CALL))
    assert (result["passed"], result["total"], result["error"]) == (2, 3, None)
    # tuples equal lists after JSON; APPS wraps an expected value in a list
    gt = {"fn_name": "pair", "inputs": [[1], [2]], "outputs": [[[1, 1]], [2, 2]]}
    assert compute_score("def pair(x):\n    return (x, x)", gt)["score"] == 1.0


def test_function_call_failures_are_reported():
    result = compute_score("def other(): pass", CALL)
    assert result["score"] == 0.0 and "no function 'add'" in result["error"]
    result = compute_score("def add(a, b):\n    while True:\n        pass", CALL, timeout_s=0.3)
    assert result["score"] == 0.0 and "timed out" in result["error"]
    # catching the timeout does not turn a late answer into a pass
    late = "def add(a, b):\n    try:\n        while True: pass\n    except BaseException: pass\n    return a + b"
    assert compute_score(late, CALL, timeout_s=0.3)["passed"] == 0
    result = compute_score("def add(a, b):\n    return a / 0", CALL)
    assert result["score"] == 0.0 and result["error"] == "test 0: ZeroDivisionError: division by zero"


class RecordingSandbox(Sandbox):
    """Runs nothing: shows what compute_score sends to the sandbox."""

    def __init__(self):
        self.calls = []

    def run(self, code, *, stdin="", language="python"):
        self.calls.append((code, json.loads(stdin)))
        return SandboxResult("sandbox_error", None, "", "remote service unreachable", None, 0.0, False)


def test_model_code_only_runs_in_the_sandbox_and_outputs_stay_outside(tmp_path):
    marker = tmp_path / "ran-outside.txt"
    sandbox = RecordingSandbox()
    result = compute_score(fenced(f"open({str(marker)!r}, 'w').write('x')"), STDIO, sandbox=sandbox)
    assert not marker.exists()
    assert result["score"] == 0.0 and "sandbox_error: remote service unreachable" in result["error"]
    (harness, payload), = sandbox.calls
    assert payload["inputs"] == STDIO["inputs"] and str(marker) in payload["code"]
    assert set(payload) == {"code", "fn_name", "inputs", "timeout_s", "max_output"}  # the expected outputs stay here


def test_bad_ground_truth_raises():
    with pytest.raises(ValueError, match="not JSON"):
        compute_score("print(1)", "{inputs")
    with pytest.raises(ValueError, match="equally long, non-empty lists"):
        compute_score("print(1)", {"inputs": ["1"], "outputs": []})


def test_registered_for_code_data_sources():
    assert set(DATA_SOURCES) == {"hflow/code", "codecontests", "apps", "taco"}
    for source in DATA_SOURCES:
        assert SCORERS[source] is compute_score
    score = default_compute_score("taco", "print(int(input()) * 2)", {"inputs": ["2\n"], "outputs": ["4\n"]})
    assert score == {"score": 1.0, "passed": 1, "total": 1, "error": None}
    assert default_compute_score("hflow/arithmetic", "Answer: 3", "3") == 1.0  # others still return floats
