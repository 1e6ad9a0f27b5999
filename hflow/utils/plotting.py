"""Learning curves from `metrics.jsonl` files: reward, score, KL, entropy, response length and phase times."""

from __future__ import annotations

import json
from pathlib import Path

# (panel title, metric keys tried in order: the first one present in a run is drawn)
PANELS = [
    ("validation score", ["val-core/*/reward/mean@1", "val-core/*"]),
    ("training score", ["critic/score/mean"]),
    ("reward", ["critic/rewards/mean"]),
    ("KL", ["actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl"]),
    ("entropy", ["actor/entropy"]),
    ("response length", ["response_length/mean"]),
]
PHASES = ["gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor"]


def read_metrics(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _match(record: dict, pattern: str) -> list[str]:
    if "*" not in pattern:
        return [pattern] if record.get(pattern) is not None else []
    head, _, tail = pattern.partition("*")
    return sorted(k for k in record if k.startswith(head) and k.endswith(tail) and record[k] is not None)


def _series(records: list[dict], patterns: list[str]) -> tuple[str, list[int], list[float]] | None:
    for pattern in patterns:
        keys = sorted({k for r in records for k in _match(r, pattern)})
        if keys:
            key = keys[0]
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            return key, [p[0] for p in points], [p[1] for p in points]
    return None


def plot_runs(metrics_files: list[str | Path], output: str | Path, labels: list[str] | None = None) -> Path:
    """Draw every run of `metrics_files` into one PNG (one panel per quantity, runs overlaid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_metrics(path) for path in metrics_files]
    labels = labels or [Path(p).parent.name or str(p) for p in metrics_files]
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    axes = axes.ravel()
    for ax, (title, patterns) in zip(axes, PANELS):
        for records, label in zip(runs, labels):
            found = _series(records, patterns)
            if found:
                key, steps, values = found
                ax.plot(steps, values, marker="o", markersize=3, label=f"{label}: {key}" if len(runs) == 1 else label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    time_ax = axes[len(PANELS)]
    for records, label in zip(runs, labels):
        for phase in PHASES:
            found = _series(records, [f"timing_s/{phase}"])
            if found:
                _, steps, values = found
                time_ax.plot(steps, values, label=f"{label} {phase}" if len(runs) > 1 else phase)
    time_ax.set_title("time per phase (s)")
    time_ax.set_xlabel("step")
    time_ax.grid(alpha=0.3)
    if time_ax.lines:
        time_ax.legend(fontsize=7)
    for ax in axes[len(PANELS) + 1:]:
        ax.axis("off")
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=90)
    plt.close(fig)
    return output
