"""bench/placement.py's summaries on a hand-written metrics.jsonl (no trainer is started): which steps
are measured, the overlap, the validation curve's wall-clock, the table, and the model's formulas."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def placement():
    spec = importlib.util.spec_from_file_location("bench_placement", ROOT / "bench" / "placement.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_async_run(tmp_path: Path) -> list[dict]:
    """6 steps, validation before training and every 2 steps, as the async trainer logs them."""
    lines = [{"step": 0, "val-core/hflow/arithmetic/reward/mean@1": 0.0}]
    for step in range(1, 7):
        record = {"step": step, "timing_s/step": 2.0 + step, "timing_s/gen": 0.5 if step == 1 else 0.25,
                  "timing_s/generate_worker": 1.0, "timing_s/weight_stream": 0.125, "timing_s/old_log_prob": 0.5,
                  "timing_s/ref": 0.25, "timing_s/update_actor": 1.0, "timing_s/reward": 0.125,
                  "training/staleness": float(step > 1)}
        if step % 2 == 0:
            record["timing_s/testing"] = 1.0
            record["val-core/hflow/arithmetic/reward/mean@1"] = step / 10
        lines.append(record)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_measured_steps_skip_warmup_last_and_after_validation(placement, tmp_path):
    records = fake_async_run(tmp_path)
    # warm-up 1..2, step 3 and 5 follow a validation, 6 is the last: only step 4 is measured
    assert [r["step"] for r in placement.measured_steps(records, warmup=2)] == [4]
    assert [r["step"] for r in placement.measured_steps(records, warmup=0)] == [1, 2, 4]


def test_summary_overlap_and_phases(placement, tmp_path):
    records = fake_async_run(tmp_path)
    summary = placement.summarize(records, "async", warmup=0)
    assert summary["measured_steps"] == [1, 2, 4]
    assert summary["step"] == {"median": 4.0, "min": 3.0, "max": 6.0}
    # step 1 waited 0.5 of 1.0 s of generation, the others 0.25: 50 % and 75 % hidden
    assert summary["overlap"] == {"median": 0.75, "min": 0.5, "max": 0.75}
    assert summary["weights"]["median"] == 0.125
    assert summary["train"]["median"] == pytest.approx(0.5 + 0.25 + 1.0)  # old_log_prob + ref + update
    # every step and validation counts toward wall-clock: sum(3..8) + 3 validations
    assert summary["train_wall_s"] == pytest.approx(sum(range(3, 9)) + 3.0)
    # a synchronous placement hides nothing, whatever its timers say
    assert placement.summarize(records, "split", warmup=0)["overlap"]["max"] == 0.0
    assert placement.overlap({"timing_s/gen": 2.0, "timing_s/generate_worker": 1.0}, "async") == 0.0


def test_validation_curve_cumulative_seconds(placement, tmp_path):
    curve = placement.validation_curve(fake_async_run(tmp_path))
    assert [p["step"] for p in curve] == [0, 2, 4, 6]
    assert [p["score"] for p in curve] == [0.0, 0.2, 0.4, 0.6]
    # step 2: (3 + 4) s of steps + 1 s validation; step 4: + (5 + 6) + 1
    assert [p["wall_s"] for p in curve] == [0.0, 8.0, 20.0, 36.0]


def test_colocate_weights_come_from_the_in_worker_sync(placement):
    assert placement.weights_s({"timing_s/weight_sync": 0.5}) == 0.5
    assert placement.weights_s({"timing_s/weight_sync": 0.0, "timing_s/weight_stream": 0.25}) == 0.25
    assert placement.weights_s({}) == 0.0


def test_model_formulas(placement):
    # generation-bound, 8 devices, G = 3T: colocate G + T; async balances at R = D G / (G + T) = 6
    t = placement.model_step_s(G=3.0, T=1.0, D=8, R=6, W=0.0, S=0.0)
    assert t["colocate"] == 4.0 and t["async"] == 4.0
    assert t["split"] == pytest.approx(3.0 * 8 / 6 + 1.0 * 8 / 2)
    assert placement.best_rollout_devices(3.0, 1.0, 8) == {"split": 5, "async": 6}
    # every term enters where the formulas say
    t = placement.model_step_s(G=1.0, T=1.0, D=2, R=1, W=0.5, S=0.25, O=0.125)
    assert t == {"colocate": 2.375, "split": 2.0 + 0.5 + 2.0 + 0.125, "async": 0.5 + 2.0 + 0.125}


def test_table_has_one_row_per_run(placement, tmp_path):
    records = fake_async_run(tmp_path)
    results = {"builtin": {"async": {"runs": [{"summary": placement.summarize(records, "async", warmup=0),
                                               "curve": placement.validation_curve(records), "repetition": 0,
                                               "order": 1, "load_before": 1.5, "load_after": 2.25}]},
                           "split": {"runs": [{"error": "boom", "repetition": 0, "order": 0}]}}}
    text = placement.table(results)
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert rows[0].startswith("| 1 | builtin | split | 1 | failed: boom")  # in the order the runs were made
    assert rows[1].startswith("| 2 | builtin | async | 1 | 4.00 [3.00-6.00]")
    assert "75%" in rows[1] and "1.5 / 2.2" in rows[1]  # load before / after the run
    assert "6: 0.600 (36 s)" in placement.curve_table(results)


def test_schedule_interleaves_and_rotates(placement):
    # every repetition runs each configuration once before the next repetition starts (caught: all runs
    # of one configuration back to back), and the order rotates so no placement always goes first
    order = placement.schedule(["builtin"], ["colocate", "split", "async"], 3)
    assert [(rep, p) for rep, _, p in order] == [
        (0, "colocate"), (0, "split"), (0, "async"), (1, "split"), (1, "async"), (1, "colocate"),
        (2, "async"), (2, "colocate"), (2, "split")]


def fake_results(placement, steps_by_rep: dict[str, list[float]]) -> dict:
    """Runs whose every measured step takes the given seconds, one list entry per repetition."""
    pairs = {}
    for name, per_rep in steps_by_rep.items():
        runs = []
        for rep, seconds in enumerate(per_rep):
            records = [{"step": 0, "val-core/x/reward/mean@1": 0.0}] + [
                {"step": s, "timing_s/step": seconds, "timing_s/gen": 0.1, "timing_s/generate_worker": 0.2}
                for s in range(1, 6)]
            runs.append({"summary": placement.summarize(records, name, warmup=0), "repetition": rep,
                         "curve": placement.validation_curve(records)})
        pairs[name] = {"runs": runs, "summary": placement.aggregate(runs)}
    return {"builtin": pairs}


def test_conclusions_name_a_ranking_only_when_every_repetition_agrees(placement):
    stable = fake_results(placement, {"colocate": [1.0, 1.1, 0.9], "split": [2.0, 2.1, 1.9], "async": [1.5, 1.6, 1.4]})
    text = " ".join(placement.stable_conclusions(stable, "builtin"))
    assert "same ranking in all 3 repetitions" in text and "colocate < async < split" in text
    # repetition 2 flips colocate and async: no fastest placement, only the order that always held
    flipped = fake_results(placement, {"colocate": [1.0, 1.7, 0.9], "split": [2.0, 2.1, 1.9], "async": [1.5, 1.6, 1.4]})
    text = " ".join(placement.stable_conclusions(flipped, "builtin"))
    assert "not stable" in text and "same ranking" not in text
    assert "colocate faster than split" in text and "async faster than split" in text
    assert "colocate faster than async" not in text and "async faster than colocate" not in text
    assert flipped["builtin"]["colocate"]["summary"]["step"] == {"median": 1.0, "min": 0.9, "max": 1.7}


def test_report_renders_from_runs(placement, tmp_path):
    stable = fake_results(placement, {"colocate": [1.0, 1.1], "split": [2.0, 2.1], "async": [1.5, 1.6]})
    for pair in stable["builtin"].values():
        for entry in pair["runs"]:
            entry.pop("summary"), entry.pop("curve")
            entry["records"] = [{"step": 0, "val-core/x/reward/mean@1": 0.0}] + [
                {"step": s, "timing_s/step": 1.0, "timing_s/gen": 0.1, "timing_s/generate_worker": 0.2,
                 "timing_s/update_actor": 0.5} for s in range(1, 6)]
            entry.update(process_wall_s=10.0, load_before=1.0, load_after=1.0, order=0)
    report = {"results": stable, "settings": {"builtin": {"steps": 5, "test_freq": 5, "warmup": 0}},
              "machine": "m", "date": "d", "commit": "c", "command": "python bench/placement.py",
              "options": {"repeats": 2}, "load_at_start": "1 1 1", "load_at_end": "1 1 1",
              "order": [[0, "builtin", "colocate"]] * 6, "benchmark_wall_s": 60.0}
    placement.write_report(report, tmp_path / "placement")
    text = (tmp_path / "placement.md").read_text()
    assert "Made by `python bench/placement.py` at commit c" in text and '"repeats": 2' in text
    assert (tmp_path / "placement.png").exists() and json.loads((tmp_path / "placement.json").read_text())


def test_model_latency_bound_generation(placement):
    # alpha_gen = 0: one rollout device generates as fast as eight; async then hides training entirely
    t = placement.model_step_s(G=3.0, T=1.0, D=8, R=1, alpha_gen=0.0)
    assert t["async"] == 3.0 and t["split"] == pytest.approx(3.0 + 8 / 7)
    assert placement.best_rollout_devices(3.0, 1.0, 8, alpha_gen=0.0)["async"] == 1


def test_longtail_section_replaces_only_its_markers(placement, tmp_path):
    md = tmp_path / "placement.md"
    md.write_text("# Placement\n\nthe builtin report\n")
    placement.replace_section(md, "first")
    placement.replace_section(md, "second")
    text = md.read_text()
    assert text.startswith("# Placement\n\nthe builtin report\n")
    assert text.count("<!-- longtail:start -->") == 1 and "second" in text and "first" not in text


def test_longtail_model_waits_for_the_tail_in_sync_and_hides_it_in_async(placement, tmp_path):
    # G (p90 end) 0.25, L (last end) 1.5, T 1.0, W 0.125; sync waited 1.5 and its step took 2.75 (O = 0.125)
    stats = lambda v: {"median": v, "min": v, "max": v}  # noqa: E731
    sync = {"step": stats(2.75), "train_idle": stats(1.5), "train": stats(1.0), "weights": stats(0.125),
            "end_p90_s": stats(0.25), "end_max_s": stats(1.5), "generate_worker": stats(1.5)}
    # whole runs of 4 steps: the engine busy 6 s, training work 4.5 s, validations 2 s (sync)
    totals = {"steps": 4, "generate_worker": 6.0, "train_idle": 6.0, "work": 4.5, "testing": 2.0}
    run = lambda wall: [{"summary": {"totals": totals, "train_wall_s": wall}}]  # noqa: E731
    configs = {"sync": {"summary": sync, "runs": run(13.0)},
               "async2": {"summary": {**sync, "step": stats(1.6)}, "runs": run(8.5)}}
    model = placement.longtail_model(configs)
    assert model["predicted_run"]["sync"] == [{"predicted": 6.0 + 4.5 + 4 * 0.125 + 2.0, "measured": 13.0}]
    assert model["predicted_run"]["async2"] == [{"predicted": 6.0 + 2.0, "measured": 8.5}]
    assert model["predicted_2dev"]["sync"] == pytest.approx(1.5 + 0.125 + 1.0 + 0.125)
    assert model["predicted_2dev"]["async2"] == pytest.approx(1.5)  # the tail is longer than T + W + O
    assert model["measured_2dev"] == {"sync": 2.75, "async2": 1.6}
    gpu8 = model["gpu8"]
    assert gpu8["L"] == pytest.approx(3.0 * 1.5 / 0.25)  # the tail in the measured proportion to G
    assert all(row["async"] <= row["sync"] for row in gpu8["by_R"].values())
