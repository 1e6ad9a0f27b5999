"""Experiment tracking: one `log(metrics, step)` call fans out to the configured backends.

Backends (`trainer.logger`): `console` (one line per step, `step:N - key:value - ...`, 3 decimals, the
format log parsers of verl expect), `jsonl` (one JSON object per step in `<log_dir>/metrics.jsonl`),
`tensorboard`, `wandb`, `mlflow` (each needs its package; a missing one is an error naming it).
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Any

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


def check_backends(backends) -> list[str]:
    backends = [backends] if isinstance(backends, str) else list(backends or [])
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ValueError(f"trainer.logger has unknown backends {unknown}; choose from {list(BACKENDS)}")
    return backends


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Number):
        return float(value)
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        return float(value.item())
    return None


class Tracking:
    def __init__(self, project_name: str, experiment_name: str, backends, log_dir: str | Path,
                 config: dict | None = None):
        self.backends = check_backends(backends)
        self.log_dir = Path(log_dir)
        self._writers: dict[str, Any] = {}
        if "jsonl" in self.backends:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.metrics_file = self.log_dir / "metrics.jsonl"
            self._writers["jsonl"] = open(self.metrics_file, "a")
        if "tensorboard" in self.backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError("trainer.logger has 'tensorboard' but it is not installed: pip install tensorboard") from err
            self._writers["tensorboard"] = SummaryWriter(log_dir=str(self.log_dir / "tensorboard"))
        if "wandb" in self.backends:
            try:
                import wandb
            except ImportError as err:
                raise ImportError("trainer.logger has 'wandb' but it is not installed: pip install wandb") from err
            wandb.init(project=project_name, name=experiment_name, config=config)
            self._writers["wandb"] = wandb
        if "mlflow" in self.backends:
            try:
                import mlflow
            except ImportError as err:
                raise ImportError("trainer.logger has 'mlflow' but it is not installed: pip install mlflow") from err
            mlflow.set_experiment(project_name)
            mlflow.start_run(run_name=experiment_name)
            if config:
                mlflow.log_params({k: v for k, v in _flatten(config).items() if v is not None})
            self._writers["mlflow"] = mlflow

    def log(self, metrics: dict[str, Any], step: int) -> None:
        scalars = {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
        if "console" in self.backends:
            print(f"step:{step} - " + " - ".join(f"{k}:{v:.3f}" for k, v in sorted(scalars.items())), flush=True)
        if "jsonl" in self._writers:
            clean = {k: (v if math.isfinite(v) else None) for k, v in scalars.items()}
            self._writers["jsonl"].write(json.dumps({"step": step, **clean}) + "\n")
            self._writers["jsonl"].flush()
        if "tensorboard" in self._writers:
            for key, value in scalars.items():
                self._writers["tensorboard"].add_scalar(key, value, step)
        if "wandb" in self._writers:
            self._writers["wandb"].log(scalars, step=step)
        if "mlflow" in self._writers:
            self._writers["mlflow"].log_metrics({k.replace("@", "_at_"): v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        if "jsonl" in self._writers:
            self._writers["jsonl"].close()
        if "tensorboard" in self._writers:
            self._writers["tensorboard"].close()
        if "wandb" in self._writers:
            self._writers["wandb"].finish()
        if "mlflow" in self._writers:
            self._writers["mlflow"].end_run()
        self._writers.clear()


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
