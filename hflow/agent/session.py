"""One episode's stateful side: its tool instances, its environment and its simulated user.

An `EpisodeSession` lives on the tool runner's event loop from the episode's start to its end. `start`
creates one instance of every tool (the row's ``create_kwargs``), the environment (``cls(config)``,
``reset(row)``) and the interaction (``start_interaction``); `respond` answers an assistant turn (its
tool calls on those instances; else the environment's ``step``; else the interaction's
``generate_response``); `close` asks each tool's ``calc_reward``, then releases everything (``release``,
``close``, ``finalize_interaction``). `close` runs once, whatever ended the episode, and never raises.

Every call into user code is bounded (``tool_timeout_s`` for tools, ``env_timeout_s`` for environments
and interactions); sync methods run in the tool thread pool. What comes back is a `Reply`: plain data
that the agent loop applies to the episode's ids on every rank alike.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hflow.agent.chat import truncate_text
from hflow.agent.tools import (BaseTool, ToolOutcome, create_instance, finished_within, malformed_outcome,
                               run_in_thread, run_tool_call)

__all__ = ["EpisodeSession", "Reply", "bounded"]

MESSAGE_CHARS = 300


@dataclass
class Reply:
    """What a session call came to, for the loop to apply to the episode."""

    stage: str  # "start" | "turn" | "close"
    messages: list[dict] = field(default_factory=list)  # role tool or user, to append (mask 0)
    rewards: list[tuple[str, float]] = field(default_factory=list)  # (source, amount) for the turn just ended
    end: str | None = None  # the episode ends for this reason (its messages are not appended)
    tool_calls: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # kinds of failure that did not end the episode
    info: dict = field(default_factory=dict)  # the environment's info / the interaction's extra data


async def bounded(fn: Any, /, *args: Any, timeout_s: float, **kwargs: Any) -> tuple[str | None, Any]:
    """``fn(*args, **kwargs)`` (sync in a pool thread, or async) within `timeout_s`: (None, result), or
    ("timeout" | "raised", message)."""

    async def call() -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        result = await run_in_thread(fn, *args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    task = asyncio.ensure_future(call())
    if not await finished_within(task, timeout_s):
        return "timeout", f"{_name(fn)} did not return within {timeout_s:g} s"
    try:
        return None, task.result()
    except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - user code: any failure is an outcome
        return "raised", f"{_name(fn)} raised {type(exc).__name__}: {str(exc)[:MESSAGE_CHARS]}"


class EpisodeSession:
    """See the module docstring. `row` is the sample's ``data_source``, ``agent_name``, ``extra_info`` and
    ``prompt`` (its messages); `env_spec` / `interaction` the row's (or None)."""

    def __init__(self, config: Any, tools: Mapping[str, BaseTool], tools_kwargs: Mapping[str, Any],
                 row: Mapping[str, Any], env_spec: Any = None, interaction: Any = None) -> None:
        self.config = config
        self.tools = tools
        self.tools_kwargs = tools_kwargs or {}
        self.row = row
        self.env_spec = env_spec
        self.env: Any = None
        self.interaction = interaction
        self.interaction_kwargs = dict((row.get("extra_info") or {}).get("interaction_kwargs") or {})
        self.interaction_id: str | None = None
        self.instances: dict[str, str] = {}  # tool name -> this episode's instance
        self.create_errors: dict[str, str] = {}
        self.closing = False

    def _kwargs(self, tool: str, key: str) -> dict:
        return dict((self.tools_kwargs.get(tool) or {}).get(key) or {})

    # ---- start ---------------------------------------------------------------------------------------

    async def start(self) -> Reply:
        reply = Reply("start")
        tool_timeout, env_timeout = float(self.config.tool_timeout_s), float(self.config.env_timeout_s)
        names = list(self.tools)
        created = await asyncio.gather(*(
            bounded(create_instance, self.tools[name], self._kwargs(name, "create_kwargs"), timeout_s=tool_timeout)
            for name in names))
        for name, (error, value) in zip(names, created):
            if error is None:
                self.instances[name] = value
            else:
                self.create_errors[name] = value
                reply.problems.append("tool_create_failed")
        if self.interaction is not None:
            error, value = await bounded(self.interaction.start_interaction, uuid.uuid4().hex,
                                         timeout_s=env_timeout, **self.interaction_kwargs)
            if error is None and isinstance(value, str):
                self.interaction_id = value
            else:
                reply.end = f"interaction_{'timeout' if error == 'timeout' else 'error'}"
                reply.info = {"error": value if error else f"start_interaction returned {value!r}, not an id"}
                return reply
        if self.env_spec is not None:
            error, value = await bounded(self.env_spec.make, timeout_s=env_timeout)
            if error is None:
                self.env = value
                error, value = await bounded(self.env.reset, self._env_row(), timeout_s=env_timeout)
            if error is not None:
                reply.end, reply.info = f"env_{error if error == 'timeout' else 'error'}", {"error": value}
            elif value is not None and not isinstance(value, str):
                reply.end = "env_malformed"
                reply.info = {"error": f"reset returned {type(value).__name__}, not the first observation (str) or None"}
            elif value:
                reply.messages.append({"role": "user", "content": value})
        return reply

    def _env_row(self) -> dict:
        return {key: self.row.get(key) for key in ("data_source", "agent_name", "extra_info")}

    # ---- one turn ------------------------------------------------------------------------------------

    async def respond(self, calls: Sequence, malformed: Sequence[str], messages: Sequence[dict]) -> Reply:
        """The answer to an assistant turn: its tool calls' results, else the environment's step on its
        text, else the simulated user's message. `messages` is the episode's conversation after the prompt."""
        if calls or malformed:
            return await self._run_tools(list(calls), list(malformed))
        if self.env is not None:
            return await self._step_env(messages[-1]["content"])
        return await self._interact(messages)

    async def _run_tools(self, calls: list, malformed: list[str]) -> Reply:
        config = self.config
        limit = int(config.max_parallel_calls)
        outcomes = [malformed_outcome(message) for message in malformed]
        outcomes += await asyncio.gather(*(self._call(call) for call in calls[:limit]))
        outcomes += [ToolOutcome(text=f"Error: at most {limit} tool call(s) per turn; this call was not run.",
                                 error="too_many_calls", seconds=0.0) for _ in calls[limit:]]
        reply = Reply("turn")
        for call, outcome in zip([None] * len(malformed) + calls, outcomes):
            reply.tool_calls.append({"name": call.name if call else None, "arguments": call.arguments if call else None,
                                     "result": outcome.text, "error": outcome.error, "seconds": outcome.seconds,
                                     "reward": outcome.reward})
            if outcome.reward:
                reply.rewards.append((f"tool:{call.name}", float(outcome.reward)))
            reply.messages.append({"role": "tool", "content": truncate_text(
                outcome.text, config.max_tool_response_length, config.tool_response_truncate_side)})
        return reply

    async def _call(self, call: Any) -> ToolOutcome:
        if call.name in self.create_errors:
            return ToolOutcome(text=f"Error: the tool {call.name} could not start: {self.create_errors[call.name]}",
                               error="create_failed", seconds=0.0)
        return await run_tool_call(self.tools, call, tools_kwargs=self.tools_kwargs,
                                   timeout_s=float(self.config.tool_timeout_s), instances=self.instances)

    async def _step_env(self, action: str) -> Reply:
        reply = Reply("turn")
        error, value = await bounded(self.env.step, action, timeout_s=float(self.config.env_timeout_s))
        if error is not None:
            reply.end, reply.info = f"env_{error if error == 'timeout' else 'error'}", {"error": value}
            return reply
        problem = _malformed_step(value)
        if problem:
            reply.end, reply.info = "env_malformed", {"error": f"step returned {problem}"}
            return reply
        observation, reward, done, info = value
        reply.rewards.append(("env", float(_plain_number(reward))))
        done = _plain_bool(done)
        reply.info = dict(info or {})
        if done:
            reply.end = "env_done"
        else:
            reply.messages.append({"role": "user", "content": observation})
        return reply

    async def _interact(self, messages: Sequence[dict]) -> Reply:
        reply = Reply("turn")
        conversation = [*(self.row.get("prompt") or []), *messages]
        error, value = await bounded(self.interaction.generate_response, self.interaction_id, conversation,
                                     timeout_s=float(self.config.env_timeout_s), **self.interaction_kwargs)
        if error is not None:
            reply.end, reply.info = f"interaction_{error if error == 'timeout' else 'error'}", {"error": value}
            return reply
        problem = _malformed_response(value)
        if problem:
            reply.end, reply.info = "interaction_malformed", {"error": f"generate_response returned {problem}"}
            return reply
        terminate, content, score, extra = value
        if score is not None:
            reply.rewards.append(("interaction", float(score)))
        reply.info = dict(extra or {})
        if terminate:
            reply.end = "interaction_done"
        else:
            reply.messages.append({"role": "user", "content": content})
        return reply

    # ---- end -----------------------------------------------------------------------------------------

    async def close(self) -> Reply:
        """Final tool rewards (``calc_reward``), then every release; once, never raising."""
        reply = Reply("close")
        if self.closing:
            return reply
        self.closing = True
        started = time.perf_counter()
        tool_timeout, env_timeout = float(self.config.tool_timeout_s), float(self.config.env_timeout_s)

        async def finish_tool(name: str, instance_id: str) -> None:
            tool = self.tools[name]
            error, value = await bounded(tool.calc_reward, instance_id, timeout_s=tool_timeout,
                                         **self._kwargs(name, "calc_reward_kwargs"))
            if error is not None:
                reply.problems.append(f"calc_reward_{error}")
            elif isinstance(value, (int, float)) and math.isfinite(value):
                if value:
                    reply.rewards.append((f"tool_final:{name}", float(value)))
            else:
                reply.problems.append("calc_reward_malformed")
            error, _ = await bounded(tool.release, instance_id, timeout_s=tool_timeout,
                                     **self._kwargs(name, "release_kwargs"))
            if error is not None:
                reply.problems.append(f"release_{error}")

        await asyncio.gather(*(finish_tool(name, instance_id) for name, instance_id in self.instances.items()))
        if self.env is not None and callable(getattr(self.env, "close", None)):
            error, _ = await bounded(self.env.close, timeout_s=env_timeout)
            if error is not None:
                reply.problems.append(f"env_close_{error}")
        if self.interaction is not None and self.interaction_id is not None:
            error, _ = await bounded(self.interaction.finalize_interaction, self.interaction_id, timeout_s=env_timeout)
            if error is not None:
                reply.problems.append(f"finalize_interaction_{error}")
        reply.info = {"close_s": time.perf_counter() - started}
        return reply


def _malformed_step(value: Any) -> str | None:
    """What is wrong with a step's (observation, reward, done, info); None when fine."""
    if not (isinstance(value, tuple) and len(value) == 4):
        return f"{_clip(value)}, not (observation, reward, done, info)"
    observation, reward, done, info = value
    reward = _plain_number(reward)
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        return f"reward {_clip(reward)}, not a finite number"
    if not isinstance(_plain_bool(done), bool):
        return f"done {_clip(done)}, not True or False"
    if not done and not isinstance(observation, str):
        return f"observation {_clip(observation)} with done=False; give the next observation (str)"
    if info is not None and not isinstance(info, Mapping):
        return f"info {_clip(info)}, not a dict"
    return None


def _malformed_response(value: Any) -> str | None:
    """What is wrong with generate_response's (should_terminate, content, score, extra); None when fine."""
    if not (isinstance(value, tuple) and len(value) == 4):
        return f"{_clip(value)}, not (should_terminate_sequence, content, score, extra)"
    terminate, content, score, extra = value
    if not isinstance(terminate, bool):
        return f"should_terminate_sequence {_clip(terminate)}, not True or False"
    if not terminate and not isinstance(content, str):
        return f"content {_clip(content)}, not the user's message (str)"
    if score is not None and (not isinstance(score, (int, float)) or isinstance(score, bool) or not math.isfinite(score)):
        return f"score {_clip(score)}, not a finite number"
    if extra is not None and not isinstance(extra, Mapping):
        return f"extra {_clip(extra)}, not a dict"
    return None


def _plain_bool(value: Any) -> Any:
    """A numpy bool as a Python one (environments often compute done with numpy)."""
    item = getattr(value, "item", None)
    return item() if callable(item) and type(value).__name__ == "bool_" else value


def _plain_number(value: Any) -> Any:
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "shape", None) == () else value


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
