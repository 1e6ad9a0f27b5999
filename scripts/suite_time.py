#!/usr/bin/env python3
"""Turn a duration record of scripts/test.sh into the tables of bench/results/suite_time.md.

    HFLOW_TEST_RECORD=record scripts/test.sh -q -p no:cacheprovider
    python scripts/suite_time.py record --out bench/results/suite_time.md [--note "quiet machine"]

The record is what scripts/test.sh wrote: one junit XML per part (`parallel.xml`, `alone.xml`, or
`paths.xml` for a run of named paths; each test's seconds, setup + call + teardown, and its tier, which
tests/conftest.py adds) and run.json/end.json (commit, load average at both ends). Prints markdown: the
parts' wall times, each tier's tests and time (the fast tier's wall estimated from a whole run), and every
file's seconds, heaviest first.
"""

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARTS = ("parallel", "alone", "paths")


def test_file(classname: str) -> str:
    """tests.trainer.test_e2e[.TestClass] -> tests/trainer/test_e2e.py"""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (REPO / path).is_file():
            return path
    return "/".join(parts) + ".py"


def read_part(xml_path: Path) -> dict:
    """{"wall": seconds, "tests": [(file, name, seconds, tier, outcome)]} of one junit XML."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests, busy = [], defaultdict(float)
    for case in root.iter("testcase"):
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        tests.append((test_file(case.get("classname", "")), case.get("name"), float(case.get("time", 0)),
                      properties.get("tier", "fast"), outcome))
        busy[properties.get("worker", "main")] += float(case.get("time", 0))
    return {"wall": sum(float(s.get("time", 0)) for s in suites), "tests": tests, "busy": dict(busy)}


def load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def tables(record: Path, note: str = "") -> str:
    parts = {name: read_part(record / f"{name}.xml") for name in PARTS if (record / f"{name}.xml").is_file()}
    if not parts:
        sys.exit(f"suite_time: no parallel.xml, alone.xml or paths.xml in {record}: was it run with "
                 "HFLOW_TEST_RECORD set to this folder?")
    run = {**load_json(record / "run.json"), **load_json(record / "end.json")}
    commit = run.get("commit", "?") + (" (with uncommitted changes)" if run.get("dirty") else "")
    lines = [f"## {run.get('started', '?')} - {run.get('ended', '?')}, commit {commit}, {run.get('tier', '?')} run",
             "", f"On {run.get('cpus', '?')} CPUs; load average (1, 5, 15 min) {run.get('load_at_start', '?')} at the "
             f"start, {run.get('load_at_end', '?')} at the end.{' ' + note if note else ''}", "",
             "| part | tests | passed | failed | skipped | wall (s) | test time (s) |", "|---|---|---|---|---|---|---|"]
    for name, part in parts.items():
        outcomes = defaultdict(int)
        for *_, outcome in part["tests"]:
            outcomes["failed" if outcome in ("failure", "error") else outcome] += 1
        lines.append(f"| {name} | {len(part['tests'])} | {outcomes['passed']} | {outcomes['failed']} | "
                     f"{outcomes['skipped']} | {part['wall']:.0f} | {sum(t[2] for t in part['tests']):.0f} |")

    for name, part in parts.items():
        if len(part["busy"]) > 1:  # how evenly the parallel part's workers were loaded
            lines += ["", f"{name}: seconds of tests per worker " + ", ".join(
                f"{worker} {seconds:.0f}" for worker, seconds in sorted(part["busy"].items())) + f" in {part['wall']:.0f} s of wall."]

    lines += ["", "Per tier (test time: seconds of setup + call + teardown, summed over tests; the parallel part's "
              "share of its wall is in proportion to its test time):", "",
              "| tier | tests | parallel part (s) | alone part (s) | estimated wall (s) |", "|---|---|---|---|---|"]
    for tier in ("fast", "slow"):
        count, wall, seconds = 0, 0.0, {}
        for name, part in parts.items():
            mine = [t[2] for t in part["tests"] if t[3] == tier]
            total = sum(t[2] for t in part["tests"]) or 1.0
            count += len(mine)
            seconds[name] = sum(mine)
            wall += part["wall"] * seconds[name] / total if name != "alone" else seconds[name]
        lines.append(f"| {tier} | {count} | {seconds.get('parallel', seconds.get('paths', 0)):.0f} | "
                     f"{seconds.get('alone', 0):.0f} | {wall:.0f} |")

    per_file = defaultdict(lambda: {"fast": 0, "slow": 0, "seconds": 0.0, "slow_seconds": 0.0})
    for part in parts.values():
        for file, _, seconds, tier, _ in part["tests"]:
            row = per_file[file]
            row[tier] += 1
            row["seconds"] += seconds
            row["slow_seconds"] += seconds if tier == "slow" else 0.0
    lines += ["", "Per file, heaviest first:", "", "| file | fast tests | slow tests | seconds | of which slow |",
              "|---|---|---|---|---|"]
    for file, row in sorted(per_file.items(), key=lambda item: -item[1]["seconds"]):
        lines.append(f"| `{file}` | {row['fast']} | {row['slow']} | {row['seconds']:.1f} | {row['slow_seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path, help="the folder HFLOW_TEST_RECORD named")
    parser.add_argument("--out", type=Path, help="add the tables to the top of this file (default: print them)")
    parser.add_argument("--note", default="", help="a sentence to add under the heading (what else ran, say)")
    args = parser.parse_args()
    text = tables(args.record, args.note)
    if args.out:  # the newest record first, under the file's title; the earlier ones stay below it
        title, _, earlier = args.out.read_text().partition("\n") if args.out.is_file() else ("", "", "")
        if not title.startswith("# "):
            title, earlier = "# Suite time, measured (scripts/test.sh)", ""
        args.out.write_text(f"{title}\n\n{text}\n{earlier.lstrip()}")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
