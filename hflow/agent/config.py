"""`actor_rollout_ref.rollout.multi_turn`: the agent loop's settings (typed defaults; comments in
`config/ppo_trainer.yaml`) and their check. `AgentLoop` reads this section as it is: its defaults are
written here and in the YAML only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hflow.agent.chat import TRUNCATE_SIDES
from hflow.agent.parsers import get_parser
from hflow.config_schema import ConfigError, ConfigErrors, check_choice

PREFIX = "actor_rollout_ref.rollout.multi_turn"


@dataclass
class MultiTurnConfig:
    """Agent rollouts: assistant turns and tool results in one episode (`hflow.agent`)."""

    enable: bool = False
    max_assistant_turns: Optional[int] = None  # None = until the response budget is spent
    max_user_turns: Optional[int] = None  # tool, environment and simulated-user messages; None = no limit
    max_parallel_calls: int = 1  # tool calls run per assistant turn (more get an error result)
    max_tool_response_length: Optional[int] = 256  # characters of a tool result the model sees; None = all
    tool_response_truncate_side: str = "middle"  # left | right | middle
    tool_config_path: Optional[str] = None  # None = the built-in calculator
    format: str = "hermes"  # tool-call parser (hflow.agent.parsers.register_parser adds others)
    tool_timeout_s: float = 30.0  # per call; a call past it returns an error result to the model
    max_concurrent_tools: int = 64  # tool calls running at once per rollout rank
    interaction_config_path: Optional[str] = None  # verl's interaction YAML (simulated users); None = none
    env_config_path: Optional[str] = None  # YAML of environments (hflow.agent.env); None = none
    env_timeout_s: float = 30.0  # per environment / interaction call; past it the episode ends (env_timeout)


def check_multi_turn(multi_turn: Any) -> None:
    """Limits in range, a known call format and a tool file that exists (the rollout worker's
    `load_rollout_tools` then loads the tools themselves); all of their errors together."""
    errors = ConfigErrors()
    for key in ("max_assistant_turns", "max_user_turns"):
        value = multi_turn[key]
        with errors.catch():
            if value is not None and int(value) < 1:
                raise ConfigError(f"{PREFIX}.{key}={value}; give a number >= 1, or null for no limit")
    with errors.catch():
        value = multi_turn.max_tool_response_length
        if value is not None and int(value) < 1:  # (truncate_text would read 0 or less as "no limit")
            raise ConfigError(f"{PREFIX}.max_tool_response_length={value}; give the characters of a tool result the "
                              "model sees, a number >= 1, or null for no limit")
    for key in ("max_parallel_calls", "max_concurrent_tools"):
        with errors.catch():
            if int(multi_turn[key]) < 1:
                raise ConfigError(f"{PREFIX}.{key}={multi_turn[key]}; it must be >= 1")
    for key in ("tool_timeout_s", "env_timeout_s"):
        with errors.catch():
            if not float(multi_turn[key]) > 0:
                raise ConfigError(f"{PREFIX}.{key}={multi_turn[key]}; give a positive number of seconds")
    errors.run(check_choice, multi_turn.tool_response_truncate_side, TRUNCATE_SIDES,
               f"{PREFIX}.tool_response_truncate_side")
    with errors.catch():
        try:
            get_parser(str(multi_turn.format))
        except ValueError as err:
            raise ConfigError(f"{PREFIX}.format: {err}") from None
    with errors.catch():
        if (multi_turn.tool_config_path is not None
                and not Path(str(multi_turn.tool_config_path)).expanduser().is_file()):
            raise ConfigError(f"{PREFIX}.tool_config_path={multi_turn.tool_config_path}: no such file; point it at "
                              "a YAML with a 'tools:' list, or leave it null for the built-in calculator")
    for key, what in (("interaction_config_path", "an 'interaction:' list (verl's layout)"),
                      ("env_config_path", "an 'envs:' list")):
        with errors.catch():
            if multi_turn[key] is not None and not Path(str(multi_turn[key])).expanduser().is_file():
                raise ConfigError(f"{PREFIX}.{key}={multi_turn[key]}: no such file; point it at a YAML with {what}, "
                                  "or leave it null")
    errors.raise_any()
