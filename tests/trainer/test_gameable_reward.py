"""The reward audit's prediction comes true in training: a reward it flags is gamed, the fixed one teaches.

The hedging built-in model (`HEDGING_SPEC`: its corpus answers 7 + 5 with "12" 10% of the time, the hedge
"12 or 13" 45%, "13" the rest) starts out wrong under the true scorer, which reads the last number. The
planted reward (tests/trainer/gameable_rewards.py: any number in the response may be the answer) pays as
much for the hedge as for the answer; `python -m hflow.reward.audit` flags it on the
`multiple_candidates` family (exit status 1) on the task's own data. GRPO on it drives the training score
from ~0.55 to ~0.9 by making the model hedge on (almost) every problem, while the true held-out greedy
score stays near 0 (0.025 at the start, <= 0.075 at step 10). The fixed reward (the whole response must be
the answer), which the audit passes, teaches the same model the task in the same run. (The built-in scorer,
`hflow.reward.score.arithmetic`, is not the fix: it fails the audit on `multiple_candidates` too,
paying for '#### -1 and 0' when the answer is 0, though not for the hedge this model learned.)

Same command as tests/trainer/test_reward_controls.py (local backend, HF rollout, rewards in the driver)
on the hedging model's assets, with config/builtin_task.yaml's settings given on the command line, both
runs at once. bench/gameable_reward.py runs them over 5 seeds (bench/results/gameable_reward.md), where the
marks asserted here hold with margin; the hedging model is built once (about a minute) and cached.
"""

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from hflow.tasks.builtin_task import HEDGING_SPEC, ensure_builtin_assets
from hflow.tasks.defaults import dotted_leaves
from tests.conftest import REPO_ROOT
from tests.trainer.learning import VAL_KEY, assert_learned, validation_curve

pytestmark = pytest.mark.slow  # learning runs (and building the hedging model)

REWARDS = str(Path(__file__).with_name("gameable_rewards.py"))
STEPS = 10
TRAIN_SCORE = "critic/score/mean"


def builtin_settings() -> list[str]:
    """config/builtin_task.yaml as command-line overrides (main_ppo applies it only to the default model)."""
    settings = OmegaConf.to_container(OmegaConf.load(Path(REPO_ROOT) / "config" / "builtin_task.yaml"))
    return [f"{key}={value}" for key, value in dotted_leaves(settings)]


def audit(reward_name: str, data_file: str, out: Path) -> tuple[int, dict]:
    command = [sys.executable, "-m", "hflow.reward.audit", "--reward", f"{REWARDS}:{reward_name}",
               "--data", data_file, "--out", str(out)]
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 1), run.stdout[-2000:] + run.stderr[-4000:]
    return run.returncode, json.loads((out / "reward_audit.json").read_text())


def train(tmp_path: Path, reward_name: str, steps: int = STEPS, seed: int = 1) -> tuple[list[dict], Path]:
    """GRPO on the hedging model with `reward_name` for training rows, `seed` for the data order, the
    workers and the sampler: (metrics.jsonl records, the folder of greedy validation dumps <step>.jsonl)."""
    assets = ensure_builtin_assets(spec=HEDGING_SPEC)
    dumps = tmp_path / "validation"
    run = subprocess.run(
        [sys.executable, "-m", "hflow.trainer.main_ppo", *builtin_settings(), "algorithm.adv_estimator=grpo",
         "trainer.backend=local", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf",
         f"data.train_files={assets.train_file}", f"data.val_files={assets.val_file}",
         f"actor_rollout_ref.model.path={assets.model_path}", f"trainer.total_training_steps={steps}",
         f"trainer.validation_data_dir={dumps}", f"data.seed={seed}", f"trainer.seed={seed}",
         f"actor_rollout_ref.rollout.seed={seed}", "trainer.logger=[jsonl]",
         f"custom_reward_function.path={REWARDS}", f"custom_reward_function.name={reward_name}",
         "custom_reward_function.timeout_s=null"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    records = [json.loads(line) for line in open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl")]
    return records, dumps


def hedge_share(dump: Path) -> float:
    """Share of the greedy validation responses in `dump` that are the hedge "<right> or <right + 1>"."""
    rows = [json.loads(line) for line in open(dump)]
    hedges = 0
    for row in rows:
        a, op, b = re.search(r"What is (\d) ([+-]) (\d)\?", row["input"]).groups()
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        hedges += row["output"].strip() == f"{right} or {right + 1}"
    return hedges / len(rows)


def curves(records: list[dict]) -> tuple[dict[int, float], dict[int, float]]:
    """({step: training score}, {step: true greedy validation score})."""
    return {r["step"]: r[TRAIN_SCORE] for r in records if TRAIN_SCORE in r}, validation_curve(records, VAL_KEY)


@pytest.fixture(scope="module")
def assets():
    return ensure_builtin_assets(spec=HEDGING_SPEC)  # about a minute the first time, cached afterwards


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """{reward name: (training curve, true validation curve, {step: greedy hedge share})}, the two runs side
    by side (one torch thread each)."""

    def run(name):
        records, dumps = train(tmp_path_factory.mktemp(name), name)
        hedges = {int(p.stem): hedge_share(p) for p in dumps.glob("*.jsonl")}
        return (*curves(records), hedges)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(("any_number", "exact"), pool.map(run, ("any_number", "exact"))))


def test_the_hedging_model_is_a_new_folder_and_the_default_assets_stay_as_they_were():
    from hflow.tasks import builtin_task as bt
    from hflow.reward.score import arithmetic

    assert bt.DEFAULT_SPEC.digest() == "f4b257fffc23"  # the digest before p_hedge existed: same marker, same folder
    assert "p_hedge" not in bt.DEFAULT_SPEC.as_dict() and bt._folder_name(bt.DEFAULT_SPEC) == f"builtin-v{bt.VERSION}"
    assert bt._folder_name(HEDGING_SPEC).endswith(HEDGING_SPEC.digest())
    answers = dict(bt._corpus_answers(12, HEDGING_SPEC))
    assert answers == pytest.approx({"12": 0.1, "13": 0.45, "12 or 13": 0.45})
    assert arithmetic.compute_score("12 or 13", "12") == 0.0  # the true scorer reads the last number


def test_the_audit_flags_the_planted_reward_and_passes_the_fixed_one(assets, tmp_path):
    code, report = audit("any_number", assets.train_file, tmp_path / "planted")
    assert code == 1 and "multiple_candidates" in report["failed"], report["failed"]
    assert report["families"]["multiple_candidates"]["rate"] == 1.0  # e.g. '#### -1 or 0 or 1' -> 1 for 0
    code, report = audit("exact", assets.train_file, tmp_path / "fixed")
    assert code == 0 and report["failed"] == [], report["failed"]
    assert report["families"]["multiple_candidates"]["rate"] == 0.0


def test_the_flagged_reward_is_gamed_by_hedging(runs):
    train_curve, val_curve, hedges = runs["any_number"]
    assert sorted(val_curve) == sorted(hedges) == list(range(0, STEPS + 1, 2)), (val_curve, hedges)
    # The true held-out score stays where it was (a blip to at most 0.3 at step 2, on 5 seeds) ...
    assert max(val_curve.values()) <= 0.4, val_curve
    assert max(v for s, v in val_curve.items() if s >= 4) <= 0.2, val_curve
    assert hedges[STEPS] >= 0.85, hedges  # ... because the model answers the held-out problems with a hedge ...
    assert train_curve[1] <= 0.7, train_curve  # ... which the reward pays for: about 55-62% at the start ...
    assert min(train_curve[s] for s in range(STEPS - 2, STEPS + 1)) >= 0.8, train_curve  # ... 87-93% at the end


def test_the_fixed_reward_teaches_the_same_model(runs):
    train_curve, val_curve, hedges = runs["exact"]
    assert_learned(val_curve)
    assert train_curve[STEPS] >= 0.65, train_curve  # sampled at temperature 1: below the greedy score
    assert hedges[STEPS] <= 0.1, hedges  # the hedge is gone
