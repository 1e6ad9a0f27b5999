"""When the user's agent function fails (`hflow.agent.endpoint`): each failure ends its own episode, never the
step; too many in one rollout end the run, saying how they failed and where.

An agent that raises on every row, or returns without one request to the endpoint, gives episodes without a
sampled token: zero loss, zero gradient, a run that trains on nothing and looks healthy. `check_agent_failures`
stops it at the first rollout that shows it (the first validation, or the first step before its update).
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hflow.agent.config import EPISODE_HEADER, PREFIX
from hflow.agent.loop import Episode
from hflow.utils import user_code
from hflow.utils.errors import UserError

__all__ = ["AgentFailureError", "check_agent_failures", "describe_agent_error"]


class AgentFailureError(UserError, RuntimeError):
    """Too many of a rollout's episodes failed in the user's agent function; the message says how and where."""


def check_agent_failures(episodes: Sequence[Episode], errors: Sequence[str | None], config: Any) -> None:
    """Stop the run when more than `config.max_failed_share` (the endpoint section) of a rollout's episodes
    failed: the agent raised (`errors[key]`, its `describe_agent_error`), or its episode ended without a sampled
    turn (it never called the endpoint, or every request was refused)."""
    raised = [key for key, error in enumerate(errors) if error is not None]
    empty = [key for key, episode in enumerate(episodes) if not episode.assistant_turns and errors[key] is None]
    share = float(config.max_failed_share)
    failed = len(raised) + len(empty)
    if not episodes or failed <= share * len(episodes):
        return
    how = []
    if raised:
        how.append(f"{len(raised)} raised in the agent function {config.agent_name} of {config.agent_path}; the first "
                   f"(sample {raised[0]} of this batch): {errors[raised[0]]}")
    if empty:
        how.append(f"{len(empty)} ended without a sampled turn (the first: sample {empty[0]} of this batch): the agent "
                   f"must send its requests to the base_url it is given, naming its episode_id (header "
                   f"{EPISODE_HEADER}); an HTTP error the endpoint answered says why a request was refused")
    raise AgentFailureError(
        f"{PREFIX}.endpoint: {failed} of {len(episodes)} episodes of this rollout failed, more than "
        f"{PREFIX}.endpoint.max_failed_share={share:g} of them, and a failed episode has nothing to train on: "
        f"{'; '.join(how)}. Fix the agent, or raise max_failed_share to train on the episodes that succeed")


def describe_agent_error(err: BaseException) -> str:
    """`Type: message (file line N)`: the exception, and the line of the agent's own file it left from (the first
    frame outside hflow's is the agent function; the last frame in that file is where it was)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename not in _HFLOW_FRAMES]
    where = ""
    if frames:
        own = [f for f in frames if f.filename == frames[0].filename]
        where = f" ({own[-1].filename} line {own[-1].lineno})"
    return f"{type(err).__name__}: {' '.join(str(err).split())}{where}"


# the files between the rollout's thread and the agent function
_HFLOW_FRAMES = {str(Path(__file__).with_name("endpoint.py")), user_code.__file__}
