"""The step folders every trainer (PPO, SFT, reward model) keeps under `trainer.default_local_dir`:

    global_step_<N>/<role>/...        each worker group's own checkpoint (hflow.workers.fsdp.checkpoint)
    global_step_<N>/data/state.pt     the driver's state (data loader position, ...)
    latest_checkpointed_iteration.txt the newest complete step, written last (atomically)

A step counts only once the marker names it, so a save that dies half-way is never resumed from.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import torch

from hflow.config_schema import ConfigError

LATEST_MARKER = "latest_checkpointed_iteration.txt"

__all__ = ["LATEST_MARKER", "StepCheckpoints"]


class StepCheckpoints:
    """Paths, the `latest` marker, pruning and resume lookup of one run's step folders."""

    def __init__(self, root: str | Path, resume_mode: str = "auto", resume_from_path: str | None = None,
                 keep: int | None = None):
        # Absolute: every worker writes its own shards there, whatever its working directory.
        self.root = Path(root).expanduser().resolve()
        self.resume_mode = resume_mode
        self.resume_from_path = resume_from_path
        self.keep = keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def check_shared(self, worker_group) -> None:
        """Every rank writes its shards here and rank 0 reads them all on resume, so every node must see
        one directory: fail now, not at the first save, when they do not."""
        self.root.mkdir(parents=True, exist_ok=True)
        probe = self.root / f".hflow_shared_dir_probe_{uuid.uuid4().hex}"
        probe.write_text("written by the trainer's driver")
        try:
            seen = worker_group.execute_all_sync("path_exists", str(probe))
        finally:
            probe.unlink(missing_ok=True)
        blind = [name for name, ok in zip(worker_group.worker_names, seen) if not ok]
        if blind:
            raise ConfigError(
                f"trainer.default_local_dir={self.root} is not shared with every node: workers "
                f"{', '.join(blind)} cannot see a file the driver wrote there. Point it at a file system all nodes "
                "mount (NFS, a shared volume) at the same path.")

    def save_driver_state(self, step: int, state: dict) -> None:
        data_dir = self.step_dir(step) / "data"
        data_dir.mkdir(parents=True, exist_ok=True)
        torch.save(state, data_dir / "state.pt")

    def load_driver_state(self, step_dir: Path) -> dict:
        return torch.load(step_dir / "data" / "state.pt", weights_only=True)  # never runs code

    def commit(self, step: int) -> None:
        """Mark `step` complete (after every group saved), then drop the oldest beyond `keep`."""
        marker = self.root / LATEST_MARKER
        tmp_marker = marker.with_suffix(".tmp")
        tmp_marker.write_text(str(step))
        tmp_marker.replace(marker)
        if not self.keep:
            return
        steps = sorted(int(p.name.removeprefix("global_step_")) for p in self.root.glob("global_step_*")
                       if p.name.removeprefix("global_step_").isdigit())
        for old in steps[:-int(self.keep)]:
            shutil.rmtree(self.step_dir(old), ignore_errors=True)

    def find(self) -> Path | None:
        """The step folder to resume from (resume_mode auto: the marker's; resume_path: the given one)."""
        if self.resume_mode == "disable":
            return None
        if self.resume_mode == "resume_path":
            return Path(self.resume_from_path)
        marker = self.root / LATEST_MARKER
        if not marker.exists():
            return None
        return self.step_dir(int(marker.read_text().strip()))

    @staticmethod
    def step_of(step_dir: Path) -> int:
        return int(step_dir.name.removeprefix("global_step_"))
