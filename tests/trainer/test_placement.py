"""`trainer.placement=split`: the built-in task learns with generation on a rollout pool of its own, fed by
the weight stream after every update (one step off-policy, `trainer.async_steps=1`, is tested on two nodes in
test_multinode.py), and a checkpoint taken while a rollout is in flight resumes cleanly.

With 2 devices the training pool is one worker and the rollout pool one vLLM engine. In fp32 the engine's
log-probs equal the trainer's after every stream, which is what shows that every weight arrived.
"""

import json

from hydra import compose, initialize_config_dir

from hflow.trainer.main_ppo import CONFIG_DIR, run_ppo

VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"


def run_builtin(tmp_path, monkeypatch, *overrides: str) -> list[dict]:
    monkeypatch.chdir(tmp_path)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=["algorithm.adv_estimator=grpo", *overrides])
    run_ppo(config, frozenset(o.split("=", 1)[0] for o in overrides))
    with open(tmp_path / "logs" / "hflow" / "default" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _learned(records: list[dict]) -> list[float]:
    scores = [r[VAL_KEY] for r in records if VAL_KEY in r]
    assert scores[0] <= 0.2 and scores[-1] >= 0.8, scores
    return scores


def test_split_placement_learns_and_the_engine_matches_the_trainer_after_every_stream(
        ray_session, tmp_path, monkeypatch):
    records = run_builtin(tmp_path, monkeypatch, "trainer.placement=split", "trainer.rollout_n_gpus=1",
                          "trainer.total_training_steps=4", "trainer.test_freq=4")
    _learned(records)
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for step in steps:
        assert step["training/staleness"] == 0
        # the sampler's log-probs of its own tokens against the trainer's, after each update was streamed
        assert step["training/rollout_log_probs_diff_max"] < 1e-4, step
    streamed = [r for r in steps if "timing_s/weight_stream" in r]
    assert len(streamed) >= 3 and all(r["perf/weight_stream_gb"] > 0 for r in streamed)


def test_checkpoint_and_resume_with_a_rollout_in_flight(ray_session, tmp_path, monkeypatch):
    """A run saved while the next batch was being generated resumes at the next step and draws that batch
    again; the engines get the restored weights before they sample."""
    common = ("trainer.placement=split", "trainer.async_steps=1", "trainer.save_freq=2", "trainer.test_freq=-1",
              "trainer.val_before_train=false")
    first = run_builtin(tmp_path, monkeypatch, *common, "trainer.total_training_steps=2")
    assert [r["step"] for r in first if "actor/pg_loss" in r] == [1, 2]
    resumed = run_builtin(tmp_path, monkeypatch, *common, "trainer.total_training_steps=3")[len(first):]
    steps = [r for r in resumed if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [3]
    assert steps[0]["training/staleness"] == 0  # the engines sampled with the restored weights
