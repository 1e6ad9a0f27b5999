"""Code scorer: run the response's program against the row's test cases, in `hflow.sandbox`.

For ``data_source`` "hflow/code", "codecontests", "apps" and "taco". ``ground_truth`` (a dict or its
JSON text) holds the tests in one of two styles:

- stdin/stdout: ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``: the program reads the input
  on stdin; its stdout passes when it equals the expected text line by line, trailing whitespace of
  each line and trailing blank lines ignored;
- function call: ``{"fn_name": "f", "inputs": [[1, 2], ...], "outputs": [3, ...]}``: ``f(*args)`` (or
  ``Solution().f(*args)``, LeetCode style) must return the expected value (compared with == after a
  JSON round trip, so tuples equal lists; as in APPS, an expected ``[v]`` also accepts ``v``).

The code is the last fenced ```python block of the response, else the whole response. All tests of a
sample run in one sandbox execution: a harness (`_harness`, stdlib only) runs inside the sandbox,
runs each stdin test in a fresh child interpreter (each call test in the harness itself) with a
per-test timeout, and prints one JSON line per test as it finishes, so a sample killed at the wall
time keeps the results it had. Only the tests' inputs enter the sandbox: the outputs are compared
here, so code that forges the harness's output cannot pass a test it did not solve. Nothing of the
response ever runs in this process.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Mapping
from typing import Any

from hflow.sandbox import LocalSandbox, Sandbox, SandboxLimits, SandboxResult

__all__ = ["DATA_SOURCES", "compute_score", "extract_code"]

DATA_SOURCES = ("hflow/code", "codecontests", "apps", "taco")
PER_TEST_TIMEOUT_S = 4.0
# The whole sample's bound: under the reward manager's default 30 s deadline per call.
MAX_WALL_TIME_S = 20.0
_OUTPUT_PER_TEST = 65536  # bytes of a test's stdout (or return value's JSON) brought back

_FENCE = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(solution_str: str) -> str:
    """The last ```python fenced block of the response, else the whole response."""
    blocks = _FENCE.findall(solution_str)
    return blocks[-1] if blocks else solution_str


def compute_score(
    solution_str: str,
    ground_truth: str | Mapping[str, Any],
    extra_info: dict | None = None,
    sandbox: Sandbox | None = None,
    *,
    timeout_s: float = PER_TEST_TIMEOUT_S,
) -> dict[str, Any]:
    """``{"score": passed / total, "passed", "total", "error"}``; error says why tests did not run or crashed.

    `sandbox`: where to run (default: a `LocalSandbox` with limits fitted to the number of tests);
    `timeout_s`: the limit of each test. Raises ValueError for a ground truth without usable tests.
    """
    tests = _parse_tests(ground_truth)
    total = len(tests["inputs"])
    if sandbox is None:
        sandbox = LocalSandbox(_limits(total, timeout_s))
    payload = {
        "code": extract_code(solution_str),
        "fn_name": tests.get("fn_name"),
        "inputs": tests["inputs"],
        "timeout_s": timeout_s,
        "max_output": _OUTPUT_PER_TEST,
    }
    result = sandbox.run(_HARNESS, stdin=json.dumps(payload))
    reports = _parse_reports(result.stdout, total)
    passed, error = 0, None
    for i, expected in enumerate(tests["outputs"]):
        report = reports.get(i)
        if report is None:
            error = error or _sandbox_problem(result, i)
        elif "error" in report:
            error = error or f"test {i}: {report['error']}"
        elif _passes(report, expected, tests.get("fn_name") is not None):
            passed += 1
        elif report.get("exit", 0) != 0:
            error = error or f"test {i}: exit code {report['exit']}: {report.get('stderr', '')}"
    return {"score": passed / total, "passed": passed, "total": total, "error": error}


def _parse_tests(ground_truth: str | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(ground_truth, str):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError as err:
            raise ValueError(f"code ground_truth is not JSON ({err}): {ground_truth[:200]!r}") from None
    if not isinstance(ground_truth, Mapping):
        raise ValueError(f"code ground_truth must be a dict with inputs and outputs, not {type(ground_truth).__name__}")
    inputs, outputs = ground_truth.get("inputs"), ground_truth.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError(
            "code ground_truth needs equally long, non-empty lists 'inputs' and 'outputs' (and 'fn_name' for "
            f"function-call tests); it has keys {sorted(ground_truth)}"
        )
    fn_name = ground_truth.get("fn_name") or None
    if fn_name is None:  # stdin/stdout: some data sets store a test's lines as a list
        inputs = [_text(value) for value in inputs]
    return {"inputs": inputs, "outputs": outputs, "fn_name": fn_name}


def _text(value: Any) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _limits(total: int, timeout_s: float) -> SandboxLimits:
    wall = min(MAX_WALL_TIME_S, 2.0 + total * timeout_s)  # 2 s: the harness's own start
    return SandboxLimits(
        cpu_time_s=wall,  # function-call tests share the harness's one CPU-time budget
        wall_time_s=wall,
        max_processes=8,
        max_output_bytes=total * (_OUTPUT_PER_TEST + 1024),
    )


def _parse_reports(stdout: str, total: int) -> dict[int, dict[str, Any]]:
    reports = {}
    for line in stdout.splitlines():
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict) and isinstance(report.get("i"), int) and 0 <= report["i"] < total:
            reports.setdefault(report["i"], report)
    return reports


def _sandbox_problem(result: SandboxResult, i: int) -> str:
    if result.status == "limit":
        return f"test {i} did not finish: the sample hit the sandbox's {result.limit_hit} limit"
    tail = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
    return f"test {i} did not run: the sandbox run ended first ({result.status}: {tail[0][:300]})"


def _passes(report: dict[str, Any], expected: Any, call_style: bool) -> bool:
    if call_style:
        actual = report.get("value")
        expected = json.loads(json.dumps(expected))
        return actual == expected or (isinstance(expected, list) and len(expected) == 1 and actual == expected[0])
    return report.get("exit") == 0 and _lines(report.get("stdout", "")) == _lines(_text(expected))


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def _harness() -> None:
    """Runs inside the sandbox (stdlib only, no names from this module): the tests, one JSON line each."""
    import copy
    import json
    import os
    import signal
    import subprocess
    import sys

    job = json.loads(sys.stdin.read())
    timeout, cap = job["timeout_s"], job["max_output"]
    with open("solution.py", "w", encoding="utf-8") as f:
        f.write(job["code"])
    out = os.fdopen(os.dup(1), "w")  # our reports; the solution's prints go elsewhere

    def report(i: int, **fields: object) -> None:
        out.write(json.dumps({"i": i, **fields}) + "\n")
        out.flush()

    if not job["fn_name"]:
        # Each test in a fresh interpreter of our own kind (isolated here, site-packages where allowed).
        flags = [flag for flag, on in (("-I", sys.flags.isolated), ("-S", sys.flags.no_site)) if on]
        for i, stdin in enumerate(job["inputs"]):
            with open("in.txt", "w", encoding="utf-8") as f:
                f.write(stdin)
            # Files, not pipes: no output reaches memory beyond what we read back.
            with open("in.txt", "rb") as given, open("out.txt", "wb") as taken, open("err.txt", "wb") as errors:
                try:
                    command = [sys.executable, *flags, "solution.py"]
                    code = subprocess.run(command, stdin=given, stdout=taken, stderr=errors, timeout=timeout).returncode
                except subprocess.TimeoutExpired:
                    report(i, error=f"timed out after {timeout} s")
                    continue
            with open("out.txt", "rb") as f:
                text = f.read(cap).decode("utf-8", errors="replace")
            with open("err.txt", "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 300))
                tail = f.read().decode("utf-8", errors="replace").strip().splitlines()[-1:]
            report(i, stdout=text, exit=code, stderr=tail[0] if tail else "")
        return

    class Timeout(BaseException):  # not an Exception: the solution's `except Exception` must not swallow it
        pass

    fired = []  # the alarm went off: a timeout even if the solution caught it and went on

    def alarm(_signum: int, _frame: object) -> None:
        fired.append(True)
        raise Timeout()

    def failure(err: BaseException) -> str:
        return f"timed out after {timeout} s" if fired else f"{type(err).__name__}: {err}"[:500]

    signal.signal(signal.SIGALRM, alarm)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the solution's prints must not mix with our reports
    sys.stdin = open(os.devnull)
    namespace: dict = {"__name__": "__main__"}
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        exec(compile(job["code"], "solution.py", "exec"), namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
        name = job["fn_name"]
        fn = namespace.get(name)
        if fn is None and isinstance(namespace.get("Solution"), type):
            fn = getattr(namespace["Solution"](), name, None)
        if not callable(fn):
            raise NameError(f"the code defines no function {name!r} (nor a class Solution with that method)")
    except BaseException as err:  # noqa: BLE001 - the solution's failure is a result, not our crash
        signal.setitimer(signal.ITIMER_REAL, 0)
        for i in range(len(job["inputs"])):
            report(i, error=f"loading the code failed: {failure(err)}")
        return
    for i, args in enumerate(job["inputs"]):
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            value = fn(*copy.deepcopy(args if isinstance(args, list) else [args]))
            signal.setitimer(signal.ITIMER_REAL, 0)
            if fired:
                raise Timeout()
            text = json.dumps(value, default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else repr(o))
        except BaseException as err:  # noqa: BLE001
            signal.setitimer(signal.ITIMER_REAL, 0)
            report(i, error=failure(err))
            fired.clear()
            continue
        if len(text) > cap:
            report(i, error=f"the return value's JSON is longer than {cap} characters")
        else:
            report(i, value=json.loads(text))


_HARNESS = inspect.getsource(_harness) + "\n_harness()\n"
