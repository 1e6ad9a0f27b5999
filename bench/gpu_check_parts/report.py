"""The GPU check's output: bench/results/gpu_check.md (the environment, a summary table of every part with
the gpu tests' result, then each part's details) and, beside it, the same as JSON with each part's data."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from .common import Part


def write_report(path: Path, env: dict[str, str], parts: list[Part], tests: tuple[int, str] | None,
                 smoke: bool) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# GPU check",
        "",
        f"Written by `scripts/gpu_check.sh` (`bench/gpu_check.py`) on {now}."
        + (" **Smoke run on CPU (`--smoke-cpu`): tiny sizes, the numbers mean nothing.**" if smoke else ""),
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in env.items()],
        "",
        "## Summary",
        "",
        "| part | result | target | status |",
        "|---|---|---|---|",
    ]
    if tests is not None:
        rc, summary = tests
        status = "PASS" if rc == 0 else "FAIL"
        lines.append(f"| tests marked `gpu` (`pytest -m gpu`) | {summary} | all pass | {status} |")
    for p in parts:
        lines.append(f"| {p.key}. {p.title} | {p.result} | {p.target} | {p.status} |")
    for p in parts:
        lines += ["", f"## {p.key}. {p.title}", "", f"Status: **{p.status}** ({p.seconds:.0f} s). {p.result}", ""]
        for detail in p.details:
            lines += [detail, ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip() + "\n")
    path.with_suffix(".json").write_text(json.dumps(
        {"environment": env, "tests": tests, "parts": {p.key: {"status": p.status, "result": p.result, **p.data}
                                                       for p in parts}}, indent=1, default=str) + "\n")

