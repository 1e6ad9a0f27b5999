"""The built-in vault task's score (`hflow.tasks.vault_task`): the environment's verdict.

The code lives only in the episode's environment (no row holds it), so the score is what the environment
said when it ended the episode: 1.0 when its step's info has ``opened: true``, else 0.0 (a wrong answer,
or an episode that ended before the environment judged an answer). An external agent that owns the episode's
environment (through the endpoint, `examples/agent/vault_agent.py`) returns that info, which the endpoint
keeps in the episode's info in the same place, so both are read alike. A response without an episode has no
verdict and scores 0.0 (a run of this data source without multi-turn stops in preflight first; the reward
probe before a run calls it so).
"""

from __future__ import annotations

from typing import Any


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    episode = (extra_info or {}).get("episode")
    if episode is None:
        return 0.0
    return float(any(info.get("opened") is True for info in episode.get("info") or []))
