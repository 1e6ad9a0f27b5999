"""The same training rows given as parquet, JSON lines and a `datasets` save_to_disk folder: a 2-step deterministic
run writes the same metrics from each (the dataset-level identity, fast, is tests/utils/test_data_formats.py); a
streamed run resumed mid-epoch trains like the uninterrupted one (the loader-level resume, fast, is
tests/utils/test_data_streaming.py)."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO_ROOT
from tests.trainer.test_deterministic import comparable
from tests.utils.test_data_formats import write_jsonl, write_saved_dataset


def command(run_dir, train_files, *overrides):
    return [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
            "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2", "trainer.save_freq=-1",
            "trainer.test_freq=2", "trainer.deterministic=true", f"data.train_files={train_files}",
            f"trainer.default_local_dir={run_dir / 'ckpt'}", *overrides]


def environment():
    return {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}


def run(run_dir, train_files, *overrides):
    """A 2-step deterministic run on the local backend (the built-in model; `train_files`, null: the built-in
    data), started in `run_dir`."""
    run_dir.mkdir()
    return subprocess.Popen(command(run_dir, train_files, *overrides), cwd=run_dir, env=environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # three training runs
def test_the_same_rows_in_three_formats_train_the_same(tmp_path):
    from hflow.tasks.builtin_task import ensure_builtin_assets

    parquet = ensure_builtin_assets().train_file
    records = pq.read_table(parquet).to_pylist()
    forms = {"parquet": parquet, "jsonl": write_jsonl(tmp_path / "train.jsonl", records),
             "save_to_disk": write_saved_dataset(tmp_path / "train_saved", records, shards=2)}
    metrics = {}
    for group in (("parquet", "jsonl"), ("save_to_disk",)):  # two at a time: this machine's two cores
        runs = {form: run(tmp_path / form, forms[form]) for form in group}
        for form, process in runs.items():
            out, err = process.communicate(timeout=900)
            assert process.returncode == 0, out[-2000:] + err[-4000:]
            metrics[form] = [comparable(m) for m in metrics_of(tmp_path / form)]
    assert len(metrics["parquet"]) >= 2 and any("actor/pg_loss" in r for r in metrics["parquet"])  # it trained
    assert any("val-core" in key for r in metrics["parquet"] for key in r)  # and validated
    assert metrics["jsonl"] == metrics["parquet"]
    assert metrics["save_to_disk"] == metrics["parquet"]


def metrics_of(run_dir):
    return [json.loads(line) for line in open(run_dir / "logs" / "hflow" / "default" / "metrics.jsonl")]


@pytest.mark.slow  # three training runs
def test_a_streamed_run_resumed_mid_epoch_trains_like_the_uninterrupted_one(tmp_path):
    """data.streaming=true through the trainer: the checkpoint after step 1 holds the stream's position, and the
    restarted process's steps 2 (the rest of the epoch) and 3 (the next epoch) are the uninterrupted run's: the same
    batches, samples, losses."""
    stream = ["data.streaming=true", "data.shuffle_buffer=64", "trainer.test_freq=-1"]
    whole = run(tmp_path / "whole", "null", "trainer.total_training_steps=3", *stream)
    half = run(tmp_path / "half", "null", "trainer.total_training_steps=1", "trainer.save_freq=1", *stream)
    for process in (whole, half):
        out, err = process.communicate(timeout=900)
        assert process.returncode == 0, out[-2000:] + err[-4000:]
    logged = len(metrics_of(tmp_path / "half"))  # the first process's records
    resumed = subprocess.run(command(tmp_path / "half", "null", "trainer.total_training_steps=3",
                                     "trainer.resume_mode=auto", *stream),
                             cwd=tmp_path / "half", env=environment(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    expected = {m["step"]: comparable(m) for m in metrics_of(tmp_path / "whole")}
    after = [comparable(m) for m in metrics_of(tmp_path / "half")][logged:]
    assert [m["step"] for m in after] == [2, 3]  # the restart logged only the steps after the checkpoint
    assert expected[3]["training/epoch"] == 1  # (the built-in data's epoch is 2 steps: step 3 starts the next)
    for step in after:
        want = expected[step["step"]]
        assert step.keys() == want.keys()
        for key in want:
            assert step[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (step["step"], key)


@pytest.mark.slow  # a training run
def test_a_mixture_run_logs_the_prompts_drawn_from_each_file(tmp_path):
    """data.mixture through the trainer: items carry their file to the step's metrics (the sampler's proportions and
    resume, fast, are tests/utils/test_data_mixture.py)."""
    from hflow.tasks.builtin_task import ensure_builtin_assets

    parquet = ensure_builtin_assets().train_file
    jsonl = write_jsonl(tmp_path / "copy.jsonl", pq.read_table(parquet).to_pylist())
    process = run(tmp_path / "mix", f"[{parquet},{jsonl}]", "data.mixture=[3,1]", "trainer.total_training_steps=2",
                  "trainer.test_freq=-1")
    out, err = process.communicate(timeout=900)
    assert process.returncode == 0, out[-2000:] + err[-4000:]
    steps = [m for m in metrics_of(tmp_path / "mix") if "actor/pg_loss" in m]
    assert len(steps) == 2
    for step in steps:
        drawn = (step["data/rows_from/0_train.parquet"], step["data/rows_from/1_copy.jsonl"])
        assert sum(drawn) == 32 and drawn[0] > drawn[1], drawn  # the step's 32 prompts, most from the heavier file
