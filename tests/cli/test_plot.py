"""python -m hflow.cli.plot draws several runs' metrics into one PNG."""

import json

import pytest

from hflow.cli.plot import main
from hflow.utils.plotting import read_metrics


def write_run(path, scale):
    path.parent.mkdir(parents=True)
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0, "val-core/hflow/arithmetic/reward/mean@1": 0.1}) + "\n")
        for step in range(1, 6):
            f.write(json.dumps({"step": step, "critic/score/mean": scale * step, "critic/rewards/mean": step,
                                "actor/entropy": 1.0 / step, "actor/ppo_kl": None, "response_length/mean": 10,
                                "timing_s/gen": 0.5, "timing_s/update_actor": 0.3}) + "\n")


def test_plot_overlays_runs_into_one_png(tmp_path, capsys):
    a, b = tmp_path / "a" / "metrics.jsonl", tmp_path / "b" / "metrics.jsonl"
    write_run(a, 0.1)
    write_run(b, 0.2)
    out = tmp_path / "curves.png"
    main([str(a), str(b), "-o", str(out), "--labels", "grpo", "gae"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert str(out) in capsys.readouterr().out
    assert read_metrics(a)[2]["critic/score/mean"] == pytest.approx(0.2)


def test_plot_rejects_mismatched_labels(tmp_path):
    a = tmp_path / "a" / "metrics.jsonl"
    write_run(a, 0.1)
    with pytest.raises(SystemExit):
        main([str(a), "-o", str(tmp_path / "x.png"), "--labels", "one", "two"])
