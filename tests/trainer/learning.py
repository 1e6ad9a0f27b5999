"""The pass mark that every learning test on the built-in task shares.

The built-in model starts out wrong (greedy validation 0.0) and, with the real reward, is at 0.85 or more by
step 2 and never below 0.90 from step 4 on, on every seed of bench/results/reward_controls.md; a coin-flip
reward never takes it above 0.225 there. The mark sits between the two: it fails a run whose learning came from
drift rather than from the reward, and leaves room for the small differences between backends and placements.
"""

VAL_KEY = "val-core/hflow/arithmetic/reward/mean@1"
START_AT_MOST = 0.2  # the pre-trained model's habit is the wrong answer
END_AT_LEAST = 0.9
SETTLED_FROM_STEP = 4  # validation points from this step on must average at least SETTLED_MEAN
SETTLED_MEAN = 0.8


def validation_curve(records: list[dict], key: str = VAL_KEY) -> dict[int, float]:
    """{step: greedy validation score} from a run's metrics.jsonl records (`key`: the task's metric)."""
    return {r["step"]: r[key] for r in records if key in r}


def assert_learned(curve: dict[int, float], end_at_least: float = END_AT_LEAST) -> None:
    """Starts wrong, ends right, and stays right once learned (not one lucky validation at the end).
    `end_at_least`: lower only for a run whose samples are deliberately stale, and say why where it is lowered."""
    steps = sorted(curve)
    assert len(steps) >= 2 and steps[0] == 0, f"need validation before training and after it: {curve}"
    assert curve[0] <= START_AT_MOST, f"the built-in model should start out wrong: {curve}"
    assert curve[steps[-1]] >= end_at_least, f"did not learn: {curve}"
    settled = [curve[s] for s in steps if s >= SETTLED_FROM_STEP]
    assert sum(settled) / len(settled) >= SETTLED_MEAN, f"learned, but did not stay learned: {curve}"
