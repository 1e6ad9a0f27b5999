"""`actor_rollout_ref.rollout.multi_turn`: the agent loop's settings (typed defaults; comments in
`config/ppo_trainer.yaml`) and their check. `AgentLoop` reads this section as it is: its defaults are
written here and in the YAML only."""

from __future__ import annotations

import errno
import inspect
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hflow.agent.chat import TRUNCATE_SIDES
from hflow.agent.parsers import get_parser
from hflow.config_schema import ConfigError, ConfigErrors, check_choice

PREFIX = "actor_rollout_ref.rollout.multi_turn"
EPISODE_HEADER = "X-Episode-Id"  # the header by which an agent's request names its episode (hflow.agent.endpoint)


@dataclass
class EndpointConfig:
    """An OpenAI-compatible endpoint on localhost while a step generates (`hflow.agent.endpoint`): the user's
    agent function runs each row's episode against it instead of hflow's own loop."""

    enable: bool = False  # true = episodes come from the agent function below, through the endpoint
    agent_path: Optional[str] = None  # Python file that defines the agent function
    agent_name: str = "run_episode"  # run_episode(base_url, episode_id, row) -> None | reward | {"reward": ..., ...}
    host: str = "127.0.0.1"  # the endpoint listens here (localhost: the agents run in the rollout worker)
    port: int = 0  # 0 = a free port for each rollout rank
    max_concurrent_episodes: int = 64  # agent functions running at once per rollout rank
    episode_timeout_s: float = 600.0  # an agent function still running after this is abandoned (agent_timeout)
    max_failed_share: float = 0.5  # stop the run when more of a rollout's episodes fail (the agent raised or sampled nothing); 1 = never


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
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)  # external agents (openai client)


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
    if multi_turn.get("endpoint") is not None and multi_turn.endpoint.enable:
        errors.run(check_endpoint, multi_turn.endpoint)
    errors.raise_any()


def check_endpoint(endpoint: Any) -> None:
    """`multi_turn.endpoint`: an agent file and function that load and take the endpoint's arguments, a port
    that is free (a fixed one: tried here, on the driver's node) and limits in range."""
    key = f"{PREFIX}.endpoint"
    if endpoint.agent_path is None:
        raise ConfigError(f"{key}.enable=true needs {key}.agent_path: a Python file defining "
                          f"{endpoint.agent_name}(base_url, episode_id, row) that runs one episode with the openai client")
    if not 0 <= int(endpoint.port) <= 65535:
        raise ConfigError(f"{key}.port={endpoint.port}; give a TCP port, or 0 for a free one per rollout rank")
    if int(endpoint.max_concurrent_episodes) < 1:
        raise ConfigError(f"{key}.max_concurrent_episodes={endpoint.max_concurrent_episodes}; it must be >= 1")
    if not float(endpoint.episode_timeout_s) > 0:
        raise ConfigError(f"{key}.episode_timeout_s={endpoint.episode_timeout_s}; give a positive number of seconds")
    if not 0 <= float(endpoint.max_failed_share) <= 1:
        raise ConfigError(f"{key}.max_failed_share={endpoint.max_failed_share}; give a share in [0, 1] (1 = never stop)")
    load_agent(endpoint)
    if int(endpoint.port):
        with open_endpoint_socket(str(endpoint.host), int(endpoint.port)):
            pass


def check_endpoint_port(multi_turn: Any, ranks_per_node: int) -> None:
    """A fixed `endpoint.port` serves one rollout rank per node: each rank runs its own endpoint for its own
    episodes, and two on one node cannot listen on the same port (or, where the system lets them, an agent's
    requests reach the other rank's endpoint, which does not know its episode)."""
    endpoint = multi_turn.get("endpoint")
    if not multi_turn.enable or endpoint is None or not endpoint.enable or not int(endpoint.port):
        return
    if ranks_per_node > 1:
        raise ConfigError(f"{PREFIX}.endpoint.port={endpoint.port} is one port, but {ranks_per_node} rollout ranks on a "
                          "node each serve their own episodes' endpoint; set it to 0 (a free port per rank, handed to "
                          "the agent as base_url), or run one rollout rank per node")


def open_endpoint_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: a free port), as the endpoint listens on it; a port taken by
    another process is a ConfigError naming the key."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            why, fix = ": another process holds it", "or stop what holds it"
        else:
            why, fix = "", f"and {PREFIX}.endpoint.host to an address of this machine (127.0.0.1: the agents run there)"
        raise ConfigError(f"{PREFIX}.endpoint.port={port}: the agent endpoint cannot listen on {host}:{port} "
                          f"({err.strerror or err}{why}); set {PREFIX}.endpoint.port=0 for a free port per rollout "
                          f"rank, {fix}") from None
    return sock


def load_agent(endpoint: Any):
    """The user's agent function (`endpoint.agent_path` / `agent_name`), which must take the endpoint's
    `(base_url, episode_id, row)`; errors name the keys."""
    from hflow.utils.errors import UserError
    from hflow.utils.user_code import FileFunction

    try:
        agent = FileFunction(str(endpoint.agent_path), str(endpoint.agent_name), config_key=f"{PREFIX}.endpoint")
    except UserError as err:
        message = str(err).replace(f"{PREFIX}.endpoint.path", f"{PREFIX}.endpoint.agent_path").replace(
            f"{PREFIX}.endpoint.name", f"{PREFIX}.endpoint.agent_name")
        raise ConfigError(message) from None
    try:
        signature = inspect.signature(agent.function)
    except (TypeError, ValueError):
        return agent  # no signature to read (a builtin): its first call will tell
    try:
        signature.bind("http://127.0.0.1:8000/v1", "ep-0", {})
    except TypeError as err:
        raise ConfigError(f"{PREFIX}.endpoint.agent_name={endpoint.agent_name!r}: {agent.path} defines "
                          f"{endpoint.agent_name}{signature}, which cannot be called as {endpoint.agent_name}(base_url, "
                          f"episode_id, row) ({err}); give it those three arguments") from None
    return agent
