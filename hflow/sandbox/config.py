"""The run's ``sandbox`` section (config/ppo_trainer.yaml): typed defaults, comments in the YAML."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SandboxConfig"]


@dataclass
class SandboxConfig:
    """Where model-written code runs: the agent's python tool and code rewards (`hflow.sandbox`)."""

    # True: run it in the local sandbox even where the kernel refuses the namespaces that isolate it
    # (a warning at every start, recorded in <trainer.log_dir>/sandbox.jsonl); False: stop in preflight.
    allow_unisolated: bool = False
