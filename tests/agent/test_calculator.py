"""The calculator: exact values, the ways models write operators, and refusals that are fast and clear."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hflow.agent.calculator import MAX_DIGITS, evaluate

pytestmark = pytest.mark.alone  # a refusal's speed is measured in wall time


@pytest.mark.parametrize("expression, value", [
    ("37 * 86", "3182"),
    ("123456789123456789 * 987654321987654321", "121932631356500531347203169112635269"),
    ("2 ** 100", "1267650600228229401496703205376"),
    ("0.1 + 0.2", "0.3"),
    ("1/3", "1/3"),
    ("1/3 * 3", "1"),
    ("-22/7", "-22/7"),
    ("10 / 4", "2.5"),
    ("-1/8", "-0.125"),
    ("1/1024", "0.0009765625"),
    ("1/4096", "0.000244140625"),  # 12 places: the decimal rule's edge
    ("1/8192", "1/8192"),  # 13 places: a fraction
    ("1e-3 * 2", "0.002"),
    ("1_000.5", "1000.5"),
    ("7 % 3", "1"),
    ("-7 // 2", "-4"),
    ("2 ** -2", "0.25"),
    ("16 ** 0.5", "4"),
    ("(27/8) ** (2/3)", "2.25"),
    ("(-1) ** 1001", "-1"),
    ("1 ** (10 ** 999)", "1"),
    ("12 * 7 =", "84"),
])
def test_exact_values(expression, value):
    assert evaluate(expression) == value


def test_precedence_and_parentheses():
    assert evaluate("2 + 3 * 4") == "14"
    assert evaluate("(2 + 3) * 4") == "20"
    assert evaluate("2 * 3 ** 2") == "18"
    assert evaluate("-2 ** 2") == "-4"  # Python's (and math's) reading: -(2**2)
    assert evaluate("2 ** 3 ** 2") == "512"  # right-associative
    assert evaluate("100 - 10 - 1") == "89"
    assert evaluate("2 ^ 10") == "1024"  # ^ is the power, as models mean it


@pytest.mark.parametrize("expression", ["37 x 86", "37x86", "37 X 86", "37 × 86", "(37)x(86)"])
def test_times_spellings(expression):
    assert evaluate(expression) == "3182"


def test_division_and_minus_spellings():
    assert evaluate("3 × 4 ÷ 6") == "2"
    assert evaluate("10 − 4") == "6"


@pytest.mark.parametrize("expression, message", [
    ("__import__('os')", "function calls are not allowed"),
    ("__import__('os').system('true')", "not allowed"),
    ("abs(-1)", "function calls are not allowed"),
    ("os", "names are not allowed ('os')"),
    ("exp(2)", "function calls"),
    ("x", "names are not allowed"),
    ("(1).__class__", "attribute access is not allowed"),
    ("'a' * 3", "'a' is not a number"),
    ("[1, 2]", "not allowed"),
    ("1,000", "commas"),
    ("3 < 4", "comparisons are not allowed"),
    ("1j", "not a number"),
    ("True", "not a number"),
    ("~1", "Invert is not allowed"),
    ("lambda: 1", "lambdas are not allowed"),
    ("", "empty"),
    ("2 +", "cannot parse"),
])
def test_refusals(expression, message):
    with pytest.raises(ValueError) as info:
        evaluate(expression)
    assert message in str(info.value)


@pytest.mark.parametrize("expression", ["1/0", "5 % 0", "5 // 0", "0 ** -1", "1 / (3 - 3)"])
def test_division_by_zero(expression):
    with pytest.raises(ValueError, match="division by zero"):
        evaluate(expression)


HUGE = ["9**9**9", "2 ** 10 ** 100", "10 ** 1000", "(10 ** 999) * 10", "1 / 10 ** 1000", "1e99999",
        "(2 ** 3000) ** (1 / 10 ** 900)", "-" * 1900 + "1", "9" * 2001]

# In a child process: without its guards, 9**9**9 would hold the GIL for minutes, past any in-process timeout.
_TIME_REFUSALS = """
import json, sys, time
from hflow.agent.calculator import evaluate
report = {}
for expression in json.loads(sys.argv[1]):
    start = time.perf_counter()
    try:
        outcome = "value " + evaluate(expression)[:40]
    except ValueError as exc:
        outcome = "ValueError " + str(exc)
    report[expression] = [outcome, time.perf_counter() - start]
print(json.dumps(report))
"""


def test_huge_results_are_refused_fast():
    try:
        run = subprocess.run([sys.executable, "-c", _TIME_REFUSALS, json.dumps(HUGE)], capture_output=True, text=True,
                             timeout=30, cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired:
        run = None
    if run is None:
        pytest.fail("evaluating the huge expressions did not end within 30 s: a size guard is missing")
    assert run.returncode == 0, run.stderr
    for expression, (outcome, seconds) in json.loads(run.stdout).items():
        assert outcome.startswith("ValueError"), (expression[:40], outcome)
        assert seconds < 0.1, (expression[:40], seconds)


def test_largest_allowed_result():
    assert len(evaluate(f"10 ** {MAX_DIGITS - 1} * 9")) == MAX_DIGITS


def test_irrational_powers_are_refused():
    with pytest.raises(ValueError, match="no exact rational value"):
        evaluate("2 ** 0.5")
    with pytest.raises(ValueError, match="not a real number"):
        evaluate("(-8) ** (1/3)")


def test_never_calls_eval(monkeypatch):
    import builtins

    def forbidden(*args, **kwargs):
        raise AssertionError("the calculator must not call eval or exec")

    for name in ("eval", "exec"):
        monkeypatch.setattr(builtins, name, forbidden)
    assert evaluate("6 * 7") == "42"
