"""The same training rows given as parquet, JSON lines and a `datasets` save_to_disk folder: a 2-step deterministic
run writes the same metrics from each (the dataset-level identity, fast, is tests/utils/test_data_formats.py)."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO_ROOT
from tests.trainer.test_deterministic import comparable
from tests.utils.test_data_formats import write_jsonl, write_saved_dataset


def run(run_dir, train_files):
    run_dir.mkdir()
    command = [sys.executable, "-m", "hflow.trainer.main_ppo", "algorithm.adv_estimator=grpo", "trainer.backend=local",
               "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2", "trainer.save_freq=-1",
               "trainer.test_freq=2", "trainer.deterministic=true", f"data.train_files={train_files}"]
    return subprocess.Popen(command, cwd=run_dir, env={**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"},
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
            lines = open(tmp_path / form / "logs" / "hflow" / "default" / "metrics.jsonl")
            metrics[form] = [comparable(json.loads(line)) for line in lines]
    assert len(metrics["parquet"]) >= 2 and any("actor/pg_loss" in r for r in metrics["parquet"])  # it trained
    assert any("val-core" in key for r in metrics["parquet"] for key in r)  # and validated
    assert metrics["jsonl"] == metrics["parquet"]
    assert metrics["save_to_disk"] == metrics["parquet"]
