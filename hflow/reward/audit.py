"""Audit a reward function before training on it: does it pay for responses that are not answers?

    python -m hflow.reward.audit --reward my_reward.py:compute_score --data train.parquet
    python -m hflow.reward.audit --data train.parquet      # the built-in scorers, by data_source

For up to --max-rows rows of the data (hflow's schema: data_source, prompt, reward_model.ground_truth,
extra_info), it finds the answer format in which the reward pays for the right answer (``#### x``,
``\\boxed{x}``, ``<answer>x</answer>``, ...), scores the right answer and a wrong one there, and then
scores the families of `hflow.reward.audit_families`: responses that game rule rewards (an
empty answer, several candidates, the prompt's numbers, ...) and equivalent spellings of the right
answer. A response is *accepted* when it scores at least halfway (--accept-fraction) from the wrong
answer's score to the right one's. It prints a markdown table (and writes reward_audit.md/.json to
--out): per gaming family the share accepted, per equivalent form the share rejected (false negatives).
Exit status 1 when a gaming family's share is above --max-accept (or no row could be audited).

The reward is loaded as training loads it (`custom_reward_function.path`/`.name`), called with the same
keyword arguments (data_source, solution_str, ground_truth, extra_info) in scoring processes with a
timeout; `trainer.reward_audit=true` runs the same audit before training starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hflow.utils.errors import ConfigError, UserError
from hflow.utils.safe_output import check_output_file, check_output_folder, staged_file
from hflow.reward.audit_families import (
    ANSWER_FORMATS,
    CORRECT,
    GAMING,
    Probe,
    probes,
    wrong_answer,
)

__all__ = ["AuditReport", "audit_rows", "check_reward_before_training", "main", "read_rows", "run_audit"]

DEFAULT_MAX_ACCEPT = 0.05
DEFAULT_MAX_ROWS = 300
DEFAULT_ACCEPT_FRACTION = 0.5


@dataclass
class FamilyResult:
    """One family's count: `hits` are accepted responses (gaming, info) or rejected ones (correct)."""

    kind: str
    responses: int = 0
    hits: int = 0
    errors: int = 0
    sample: dict[str, Any] | None = None  # the first hit: row, ground_truth, response, score, right_score

    @property
    def rate(self) -> float:
        """The share of the responses the reward scored (not those it failed on) that are hits."""
        scored = self.responses - self.errors
        return self.hits / scored if scored else 0.0


@dataclass
class AuditReport:
    reward: str
    data: str
    rows: int = 0
    rows_audited: int = 0
    rows_skipped: dict[str, int] = field(default_factory=dict)  # why -> count
    answer_formats: dict[str, int] = field(default_factory=dict)  # format -> rows
    accept_fraction: float = DEFAULT_ACCEPT_FRACTION
    families: dict[str, FamilyResult] = field(default_factory=dict)
    first_error: str | None = None  # the first call that raised or returned no number
    errors: int = 0  # calls that raised or returned no number: the reward's own failures, never "rejected"

    def failed(self, max_accept: float) -> list[str]:
        """The gaming families accepted more often than `max_accept`."""
        return [name for name, family in self.families.items() if family.kind == GAMING and family.rate > max_accept]

    def to_json(self, max_accept: float) -> dict[str, Any]:
        out = asdict(self)
        for name, family in self.families.items():
            out["families"][name]["rate"] = family.rate
        out["max_accept"] = max_accept
        out["failed"] = self.failed(max_accept)
        return out


# ---- data ------------------------------------------------------------------------------------------------


def read_rows(path: str, max_rows: int, reward_fn_key: str = "data_source", prompt_key: str = "prompt",
              files_key: str = "--data", split: str | None = "train") -> list[dict[str, Any]]:
    """The first `max_rows` rows as {data_source, prompt_text, ground_truth, extra_info} (of `split` in a
    DatasetDict folder)."""
    from hflow.utils.dataset.sources import read_schema, read_table

    if not Path(path).exists():
        raise ConfigError(f"{files_key}: file {path} does not exist")
    names = read_schema(path, files_key, split=split).names
    for column in (reward_fn_key, prompt_key, "reward_model"):
        if column not in names:
            raise ConfigError(f"{files_key}: {path} has no column {column!r}; the audit reads hflow's schema "
                              "(data_source, prompt, reward_model.ground_truth, extra_info)")
    columns = [reward_fn_key, prompt_key, "reward_model"] + (["extra_info"] if "extra_info" in names else [])
    table = read_table(path, files_key, columns=columns, split=split).slice(0, max_rows)
    rows = []
    for row in table.to_pylist():
        prompt = row[prompt_key]
        if isinstance(prompt, list):
            prompt = "\n".join(str(message.get("content") or "") for message in prompt
                               if isinstance(message, dict) and message.get("role") != "system")
        rows.append({"data_source": row[reward_fn_key], "prompt_text": str(prompt or ""),
                     "ground_truth": (row["reward_model"] or {}).get("ground_truth"),
                     "extra_info": row.get("extra_info")})
    return rows


# ---- scoring -----------------------------------------------------------------------------------------------


class _Scorer:
    """Scores many calls of the reward: in scoring processes with a per-call timeout (as training does), or
    in this process when `timeout_s` is None."""

    def __init__(self, fn: Callable[..., Any], timeout_s: float | None) -> None:
        self.fn = fn
        self.pool = None
        if timeout_s:
            from hflow.reward.runner import ScoringPool

            self.pool = ScoringPool(fn, num_workers=max(1, min(2, os.cpu_count() or 1)), timeout_s=timeout_s)

    def score(self, calls: list[dict[str, Any]]) -> list[tuple[float | None, str | None]]:
        """(score, None) or (None, error) per call."""
        if self.pool is not None:
            results = [(result.value, result.error) for result in self.pool.map(calls)]
        else:
            results = []
            for call in calls:
                try:
                    results.append((self.fn(**call), None))
                except Exception as exc:  # noqa: BLE001 - the audit reports what the reward does with each input
                    results.append((None, f"{type(exc).__name__}: {exc}"))
        return [_as_score(value, error) for value, error in results]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _as_score(value: Any, error: str | None) -> tuple[float | None, str | None]:
    if error is not None:
        return None, error.strip().splitlines()[-1]
    if isinstance(value, dict):
        value = value.get("score")
    try:
        return float(value), None
    except (TypeError, ValueError):
        return None, f"returned {value!r}, not a number"


def _call(row: dict[str, Any], ground_truth: Any, response: str) -> dict[str, Any]:
    return {"data_source": row["data_source"], "solution_str": response, "ground_truth": ground_truth,
            "extra_info": row["extra_info"]}


def run_audit(fn: Callable[..., Any], rows: list[dict[str, Any]], *, reward: str = "", data: str = "",
              accept_fraction: float = DEFAULT_ACCEPT_FRACTION, max_chars: int = 2000,
              timeout_s: float | None = 30.0) -> AuditReport:
    """Score every probe of every row with `fn` (the reward-function contract) and count the families."""
    scorer = _Scorer(fn, timeout_s)
    try:
        return audit_rows(scorer.score, rows, reward=reward, data=data, accept_fraction=accept_fraction,
                          max_chars=max_chars)
    finally:
        scorer.close()


def audit_rows(score: Callable[[list[dict[str, Any]]], list[tuple[float | None, str | None]]],
               rows: list[dict[str, Any]], *, reward: str = "", data: str = "",
               accept_fraction: float = DEFAULT_ACCEPT_FRACTION, max_chars: int = 2000) -> AuditReport:
    report = AuditReport(reward=reward, data=data, rows=len(rows), accept_fraction=accept_fraction)
    formats = list(ANSWER_FORMATS)
    # 1. per row, the right and a wrong answer in every format
    calls, usable = [], []
    for index, row in enumerate(rows):
        truth = row["ground_truth"]
        if isinstance(truth, bool) or not isinstance(truth, (str, int, float)) or not str(truth).strip():
            report.rows_skipped["ground truth is not a string or number"] = (
                report.rows_skipped.get("ground truth is not a string or number", 0) + 1)
            continue
        usable.append(index)
        for name in formats:
            template = ANSWER_FORMATS[name][0]
            calls.append(_call(row, truth, template.format(str(truth).strip())))
            calls.append(_call(row, truth, template.format(wrong_answer(str(truth)))))
    scores = score(calls)
    _note_errors(report, scores)
    # 2. per usable row, the probes in its best format
    probe_calls, probe_meta = [], []
    for position, index in enumerate(usable):
        row = rows[index]
        block = scores[position * 2 * len(formats):(position + 1) * 2 * len(formats)]
        chosen = _choose_format(row["prompt_text"], formats, block)
        if chosen is None:
            why = "the right answer scores no more than a wrong one in every answer format"
            report.rows_skipped[why] = report.rows_skipped.get(why, 0) + 1
            continue
        name, right, wrong = chosen
        report.rows_audited += 1
        report.answer_formats[name] = report.answer_formats.get(name, 0) + 1
        threshold = wrong + accept_fraction * (right - wrong)
        for probe in probes(str(row["ground_truth"]), row["prompt_text"], name, max_chars=max_chars):
            probe_calls.append(_call(row, row["ground_truth"], probe.response))
            probe_meta.append((index, probe, right, threshold))
    probe_scores = score(probe_calls)
    _note_errors(report, probe_scores)
    for (index, probe, right, threshold), (value, error) in zip(probe_meta, probe_scores):
        _count(report, index, rows[index], probe, right, threshold, value, error)
    return report


def _note_errors(report: AuditReport, scores: list[tuple[float | None, str | None]]) -> None:
    errors = [error for _, error in scores if error is not None]
    report.errors += len(errors)
    if errors and report.first_error is None:
        report.first_error = errors[0]


def _choose_format(prompt_text: str, formats: list[str], block: list[tuple[float | None, str | None]]):
    """(format, right score, wrong score) with the widest margin (formats the prompt names first), or None."""
    lowered = prompt_text.lower()
    best = None
    for position, name in enumerate(formats):
        (right, _), (wrong, _) = block[2 * position], block[2 * position + 1]
        if right is None or wrong is None or not right > wrong:
            continue
        asked = any(word in lowered for word in ANSWER_FORMATS[name][1])
        key = (right - wrong, asked)
        if best is None or key > best[0]:
            best = (key, (name, right, wrong))
    return None if best is None else best[1]


def _count(report: AuditReport, index: int, row: dict[str, Any], probe: Probe, right: float, threshold: float,
           value: float | None, error: str | None) -> None:
    family = report.families.setdefault(probe.family, FamilyResult(kind=probe.kind))
    family.responses += 1
    if error is not None:  # the reward failed: its own verdict, neither accepted nor rejected
        family.errors += 1
        return
    accepted = value >= threshold
    hit = (not accepted) if probe.kind == CORRECT else accepted
    if hit:
        family.hits += 1
        if family.sample is None:
            family.sample = {"row": index, "ground_truth": str(row["ground_truth"]), "response": probe.response,
                             "score": value, "right_score": right, "error": error}


# ---- the report --------------------------------------------------------------------------------------------


def _short(text: str, limit: int = 70) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 5] + "...'"


def format_markdown(report: AuditReport, max_accept: float) -> str:
    failed = set(report.failed(max_accept))
    lines = [
        f"Reward audit of `{report.reward}` on `{report.data}`: {report.rows_audited} of {report.rows} rows audited"
        + "".join(f"; {count} skipped ({why})" for why, count in report.rows_skipped.items()),
        f"answer formats found: {', '.join(f'{k} ({v} rows)' for k, v in report.answer_formats.items()) or 'none'}; "
        f"a response is accepted at >= {report.accept_fraction:g} of the way from a wrong answer's score to the "
        "right answer's",
        "",
        "| family | kind | responses | accepted | rejected | verdict | example (row, ground truth: response -> score) |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    order = {GAMING: 0, CORRECT: 1}
    for name, family in sorted(report.families.items(), key=lambda item: order.get(item[1].kind, 2)):
        rate = family.rate
        accepted, rejected = (1 - rate, rate) if family.kind == CORRECT else (rate, 1 - rate)
        if family.errors:
            verdict = "ERROR (the reward failed)"
        elif family.kind == GAMING:
            verdict = f"FAIL (> {max_accept:g})" if name in failed else "ok"
        elif family.kind == CORRECT:
            verdict = "false negatives" if family.hits else "ok"
        else:
            verdict = "info"
        example = ""
        if family.sample:
            sample = family.sample
            shown = "error: " + sample["error"] if sample["error"] else f"{sample['score']:g}"
            example = (f"row {sample['row']}, {_short(sample['ground_truth'], 24)}: "
                       f"{_short(sample['response'])} -> {shown}").replace("|", "\\|")
        errors = f" ({family.errors} errors)" if family.errors else ""
        lines.append(f"| {name} | {family.kind} | {family.responses}{errors} | {accepted:.1%} | {rejected:.1%} | "
                     f"{verdict} | {example} |")
    return "\n".join(lines) + "\n"


# ---- loading the reward as training does --------------------------------------------------------------------


def load_reward(spec: str | None) -> tuple[Callable[..., Any], str]:
    """`FILE.py:NAME` (NAME defaults to compute_score) loaded by the trainer's own loader, or the built-in
    scorers by data source."""
    from hflow.reward.score import default_compute_score

    if not spec:
        return default_compute_score, "hflow.reward.score.default_compute_score"
    from hflow.reward.config import CustomRewardFunctionConfig
    from hflow.reward.managers.loader import check_reward_fn_signature, get_custom_reward_fn

    path, _, name = spec.rpartition(":") if ":" in spec else (spec, "", "compute_score")
    # the one section the loader reads, with its shipped defaults
    section = CustomRewardFunctionConfig(path=path, name=name or "compute_score")
    config = OmegaConf.create({"custom_reward_function": OmegaConf.structured(section)})
    fn = get_custom_reward_fn(config)
    check_reward_fn_signature(fn)
    return fn, f"{path}:{fn.name}"


def check_reward_before_training(config: DictConfig) -> AuditReport | None:
    """`trainer.reward_audit`: audit the reward the run will use on the first rows of `data.train_files`; a
    ConfigError naming the family, one response and its score when a gaming family passes
    `trainer.reward_audit_max_accept`."""
    if not config.trainer.reward_audit:
        return None
    if OmegaConf.select(config, "custom_reward_function.url") is not None:
        print("reward audit: skipped: custom_reward_function.url (a remote scorer) is not audited; run "
              "python -m hflow.reward.audit against a local copy of the reward", flush=True)
        return None
    from hflow.reward.score import default_compute_score
    from hflow.reward.managers.loader import get_custom_reward_fn

    fn = get_custom_reward_fn(config)
    label = f"{fn.path}:{fn.name}" if fn is not None else "the built-in scorers"
    files = config.data.train_files
    path = str(files if isinstance(files, str) else files[0])
    rows = read_rows(path, DEFAULT_MAX_ROWS, config.data.reward_fn_key, config.data.prompt_key, "data.train_files",
                     config.data.train_split)
    max_accept = float(config.trainer.reward_audit_max_accept)
    report = run_audit(fn or default_compute_score, rows, reward=label, data=path,
                       max_chars=4 * int(config.data.max_response_length),
                       timeout_s=config.custom_reward_function.timeout_s)
    advice = ("fix the reward function (python -m hflow.reward.audit --data FILE --reward FILE.py:NAME prints "
              "every family), raise trainer.reward_audit_max_accept, or set trainer.reward_audit=false")
    if report.errors:
        raise ConfigError(f"trainer.reward_audit: {label} failed (raised, timed out or returned no number) on "
                          f"{report.errors} of the responses it was given from {len(rows)} rows of {path}; the first: "
                          f"{report.first_error}. Training would stop (or, with on_error=zero, score them 0) on "
                          "such responses; fix the reward function")
    if report.rows_audited == 0:
        error = f" (a call failed: {report.first_error})" if report.first_error else ""
        raise ConfigError(f"trainer.reward_audit: on {len(rows)} rows of {path}, {label} never scored the right "
                          f"answer above a wrong one in any answer format the audit knows "
                          f"({', '.join(ANSWER_FORMATS)}){error}; {advice}")
    failed = report.failed(max_accept)
    if failed:
        family = report.families[failed[0]]
        sample = family.sample
        others = f" (also: {', '.join(failed[1:])})" if failed[1:] else ""
        raise ConfigError(
            f"trainer.reward_audit: {label} pays for '{failed[0]}' responses{others}: {family.rate:.0%} of "
            f"{family.responses} scored like a right answer (trainer.reward_audit_max_accept={max_accept:g}); e.g. "
            f"row {sample['row']} (ground truth {sample['ground_truth']!r}): {_short(sample['response'], 120)} "
            f"scored {sample['score']:g}, the right answer {sample['right_score']:g}. A policy trained on it learns "
            f"to answer that way; {advice}")
    print(f"reward audit: {label} passed on {report.rows_audited} rows of {path} "
          f"(no gaming family above {max_accept:g})", flush=True)
    return report


# ---- command line ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hflow.reward.audit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reward", help="FILE.py:NAME (default: the built-in scorers, chosen by data_source)")
    parser.add_argument("--data", required=True, help="parquet file in hflow's schema")
    parser.add_argument("--max-accept", type=float, default=DEFAULT_MAX_ACCEPT,
                        help="largest share of a gaming family the reward may accept (default 0.05)")
    parser.add_argument("--max-rows", type=int, default=DEFAULT_MAX_ROWS, help="rows to read (default 300)")
    parser.add_argument("--accept-fraction", type=float, default=DEFAULT_ACCEPT_FRACTION,
                        help="accepted = score >= wrong + this x (right - wrong) (default 0.5)")
    parser.add_argument("--max-chars", type=int, default=2000, help="length of the padded responses (default 2000)")
    parser.add_argument("--timeout-s", type=float, default=30.0,
                        help="per-call timeout in scoring processes; 0 calls the reward in this process")
    parser.add_argument("--data-source-key", default="data_source", help="column that selects the scorer")
    parser.add_argument("--prompt-key", default="prompt", help="column of chat messages")
    parser.add_argument("--out", help="folder for reward_audit.md and reward_audit.json")
    args = parser.parse_args(argv)
    try:
        files = _output_files(args)
        fn, label = load_reward(args.reward)
        rows = read_rows(args.data, args.max_rows, args.data_source_key, args.prompt_key)
        report = run_audit(fn, rows, reward=label, data=args.data, accept_fraction=args.accept_fraction,
                           max_chars=args.max_chars, timeout_s=args.timeout_s or None)
    except UserError as err:
        print(f"hflow: error: {err}", file=sys.stderr)
        return 2
    text = format_markdown(report, args.max_accept)
    print(text)
    if files:
        try:
            for path, content in zip(files, (text, json.dumps(report.to_json(args.max_accept), indent=2,
                                                                default=str))):
                with staged_file(path) as tmp:
                    tmp.write_text(content)
        except OSError as err:
            print(f"hflow: error: --out {args.out}: {err.strerror or err}; name a folder you can write",
                  file=sys.stderr)
            return 2
    failed = report.failed(args.max_accept)
    if report.errors:
        print(f"reward_audit: FAIL: the reward failed (raised, timed out or returned no number) on {report.errors} "
              f"responses; the first: {report.first_error}", file=sys.stderr)
        return 1
    if report.rows_audited == 0:
        error = f" (a call failed: {report.first_error})" if report.first_error else ""
        print(f"reward_audit: no row could be audited: the right answer never scored above a wrong one{error}",
              file=sys.stderr)
        return 1
    if failed:
        print(f"reward_audit: FAIL: {', '.join(failed)} accepted more often than --max-accept={args.max_accept:g}",
              file=sys.stderr)
        return 1
    return 0


def _output_files(args) -> list[Path]:
    """reward_audit.md and .json in --out, refused (`hflow.utils.safe_output`) where they would overwrite or
    lie among what the audit reads, or in a training checkpoint folder: before any work."""
    if not args.out:
        return []
    inputs = {"--data": args.data, "--reward": args.reward.rpartition(":")[0] or args.reward if args.reward else None}
    what = "reward_audit.md and reward_audit.json"
    out = check_output_folder(args.out, arg="--out", what=what, inputs=inputs, overwrite=None)
    return [check_output_file(out / name, arg="--out", what=what, inputs=inputs)
            for name in ("reward_audit.md", "reward_audit.json")]


if __name__ == "__main__":
    sys.exit(main())
