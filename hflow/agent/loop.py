"""The multi-turn agent loop: episodes of assistant turns and tool messages over a generation engine.

One `Episode` per sample holds a token list that only grows (token in, token out): the prompt's ids,
each assistant turn's ids exactly as the engine sampled them, and each tool message's ids as
`ToolMessageEncoder` renders them. Beside the ids grow the loss mask (1 = sampled) and the sampler's
log-probs. Text is decoded from the sampled ids for the tool-call parser, the tools, the reward and the
logs, and is never encoded back into the trajectory.

Samples advance independently (`run`): a turn that ends with tool calls hands them to the tool runner
(an event loop on its own thread, `max_concurrent_tools` calls at once) and the sample waits there while
the engine keeps stepping the other samples; when its results are back, its next turn is added to the
running engine batch. A slow tool delays only its own sample. Engines that cannot take requests while
they run (HF `generate`) advance in waves instead (`TurnEngine.streams = False`): every sample that is
ready when a wave starts is in it.

An episode ends when a turn has no tool call (`answer`), when a turn is cut by the response budget
(`length`), when the turn limits are reached (`max_assistant_turns`, `max_user_turns`), or when the next
tool message would not leave room for one more sampled token (`length`, the message is not added). The
last token of an episode is therefore always a sampled one, where the outcome reward goes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hflow.agent.chat import ToolMessageEncoder, truncate_text
from hflow.agent.config import MultiTurnConfig
from hflow.agent.parsers import ToolCallParser
from hflow.agent.tools import BaseTool, ToolOutcome, malformed_outcome, run_tool_call, use_tool_threads

__all__ = ["AgentLoop", "Episode", "ToolRunner", "TurnEngine", "TurnResult", "agent_metrics",
           "final_assistant_text"]

ENDINGS = ("answer", "length", "max_assistant_turns", "max_user_turns")
ADMIT_POLL_S = 0.005  # with `admit`: how long a loop with nothing to step waits for a tool before asking again


@dataclass
class Episode:
    """One sample's trajectory and what happened in it."""

    prompt_ids: list[int]
    tools_kwargs: Mapping[str, Any] = field(default_factory=dict)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy, 0 = tool message
    log_probs: list[float] = field(default_factory=list)  # sampler log-prob, 0.0 on tool tokens
    versions: list[int] = field(default_factory=list)  # policy version that sampled each token; -1: tool token or unknown
    messages: list[dict[str, Any]] = field(default_factory=list)  # assistant and tool messages, for rewards and logs
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    ended: str | None = None
    finished_s: float | None = None  # seconds from the rollout's start to the episode's end

    @property
    def done(self) -> bool:
        return self.ended is not None

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def truncated(self) -> bool:
        return self.ended == "length"

    def add_sampled(self, ids: Sequence[int], log_probs: Sequence[float] | None,
                    versions: Sequence[int] | None = None) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))
        self.versions.extend(versions if versions is not None else [-1] * len(ids))

    def add_tool(self, ids: Sequence[int]) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.log_probs.extend([0.0] * len(ids))
        self.versions.extend([-1] * len(ids))

    def summary(self) -> dict[str, Any]:
        """The episode for rewards (`extra_info["episode"]`) and logs: JSON-serialisable."""
        return {
            "messages": self.messages,
            "tool_calls": self.tool_calls,
            "num_turns": self.assistant_turns,
            "num_tool_turns": self.user_turns,
            "ended": self.ended,
            "truncated": self.truncated,
            "finished_s": self.finished_s,
        }


@dataclass(frozen=True)
class TurnResult:
    key: int  # the episode's index
    token_ids: list[int]
    log_probs: list[float] | None
    stopped: bool  # ended with a stop token (False: cut by max_tokens)
    versions: list[int] | None = None  # per token, the policy version that sampled it (engines that know)


class TurnEngine(ABC):
    """What the loop needs from a generation engine: take turns, hand back finished ones."""

    streams: bool = True  # can take new requests while earlier ones run

    @abstractmethod
    def add_turn(self, key: int, ids: list[int], max_tokens: int) -> None:
        """Queue one assistant turn continuing `ids` for at most `max_tokens` tokens."""

    @abstractmethod
    def poll(self) -> list[TurnResult]:
        """Advance the engine (one scheduler step, or one wave) and return the turns that finished."""

    @abstractmethod
    def busy(self) -> bool:
        """Turns are queued or running."""


class ToolRunner:
    """An event loop on a thread of its own, where every tool call of a rollout runs.

    Sync tools and the sandbox run in the tool thread pool, sized to `max_concurrent` threads, so that
    many slow calls wait side by side instead of in a queue of a handful of threads.
    """

    def __init__(self, max_concurrent: int) -> None:
        use_tool_threads(max_concurrent)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hflow-tools", daemon=True)
        self._thread.start()

    def run_soon(self, coroutine) -> concurrent.futures.Future:
        """Schedule `coroutine` on the tool thread's loop; its future resolves when it finishes."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


class AgentLoop:
    """Runs episodes to their end on a `TurnEngine`; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        config: MultiTurnConfig,
        tools: Mapping[str, BaseTool],
        parser: ToolCallParser,
        response_length: int,
        tool_schemas: Sequence[dict] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config  # rollout.multi_turn as validated (the dataclass or its DictConfig)
        self.tools = dict(tools)
        self.parser = parser
        self.response_length = int(response_length)
        self.encoder = ToolMessageEncoder(tokenizer, tool_schemas)

    # ---- the loop ------------------------------------------------------------------------------------

    def run(
        self,
        engine: TurnEngine,
        prompts: Sequence[list[int]],
        eos_token_ids: Sequence[int],
        tools_kwargs: Sequence[Mapping[str, Any]] | None = None,
        agree: Callable[[list], list] | None = None,
        all_done: Callable[[bool], bool] | None = None,
        admit: Callable[[list[Episode]], list | None] | None = None,
    ) -> list[Episode]:
        """Episodes for `prompts` (one each, in order); a turn ends at any of `eos_token_ids`.

        `agree` makes ranks that drive one engine together (tensor parallelism) see the same tool
        results at the same step: it takes this rank's arrivals and returns the leader's (only the
        leader runs tools). `all_done` (waves on several ranks) tells whether every rank has finished.
        `admit` (continuous admission, `hflow.workers.rollout.router`) is asked between engine steps for
        more episodes, (prompt ids, tools kwargs) each, appended to the list; None when no more will come.
        """
        kwargs = tools_kwargs if tools_kwargs is not None else [{}] * len(prompts)
        episodes = [Episode(prompt_ids=list(p), tools_kwargs=dict(k or {})) for p, k in zip(prompts, kwargs)]
        runs_tools = agree is None or getattr(agree, "is_leader", True)
        runner = ToolRunner(self.config.max_concurrent_tools) if runs_tools else None
        pending: dict[concurrent.futures.Future, int] = {}  # a turn's tool calls in flight -> its episode
        waiting: set[int] = set()  # episodes whose tool results are not back yet
        ready = list(range(len(episodes)))
        started = time.perf_counter()
        try:
            while True:
                if not engine.streams and pending:  # a wave starts when every tool result is back
                    concurrent.futures.wait(pending)
                idle = not engine.busy() and not ready and bool(pending)
                # admitting: wait for a tool at most a moment, new episodes may be waiting to start
                arrivals = self._collect(pending, block=idle, timeout=ADMIT_POLL_S if admit is not None else None)
                if agree is not None:
                    arrivals = agree(arrivals)
                for key, outcomes in arrivals:
                    waiting.discard(key)
                    if self._add_tool_results(episodes[key], outcomes):
                        ready.append(key)
                    else:
                        episodes[key].finished_s = time.perf_counter() - started
                if admit is not None:
                    new = admit(episodes)
                    if new is None:
                        admit = None
                    for ids, kwargs in new or []:
                        ready.append(len(episodes))
                        episodes.append(Episode(prompt_ids=list(ids), tools_kwargs=dict(kwargs or {})))
                for key in ready:
                    episode = episodes[key]
                    engine.add_turn(key, episode.ids, self.response_length - len(episode.response_ids))
                ready = []
                finished = self._all_finished(episodes) and not waiting and admit is None
                if all_done is not None:
                    finished = all_done(finished)
                if finished:
                    break
                for result in engine.poll():
                    episode = episodes[result.key]
                    calls = self._end_turn(episode, result, eos_token_ids)
                    if calls is None:
                        episode.finished_s = time.perf_counter() - started
                        continue
                    waiting.add(result.key)
                    if runner is not None:
                        future = runner.run_soon(self._run_calls(episode, *calls))
                        pending[future] = result.key
        finally:
            if runner is not None:
                runner.close()
        return episodes

    @staticmethod
    def _all_finished(episodes: list[Episode]) -> bool:
        return all(e.done for e in episodes)

    def _collect(self, pending: dict, block: bool, timeout: float | None = None) -> list[tuple[int, list]]:
        """Tool results that are back, as (episode index, outcomes); waits for one (at most `timeout`) when `block`."""
        if block:
            concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        arrivals = []
        for future in [f for f in pending if f.done()]:
            arrivals.append((pending.pop(future), future.result()))
        return arrivals

    # ---- one turn ------------------------------------------------------------------------------------

    def _end_turn(self, episode: Episode, result: TurnResult, eos_token_ids: Sequence[int]) -> tuple[list, list[str]] | None:
        """Record a finished assistant turn; returns its (calls, malformed) when tools must run next."""
        ids = result.token_ids
        episode.add_sampled(ids, result.log_probs, result.versions)
        episode.assistant_turns += 1
        body = ids[:-1] if result.stopped and ids and ids[-1] in eos_token_ids else ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        parsed = self.parser.parse(text)
        episode.messages.append({"role": "assistant", "content": text})
        config = self.config
        if not result.stopped:
            episode.ended = "length"
        elif not parsed.calls and not parsed.malformed:
            episode.ended = "answer"
        elif config.max_assistant_turns is not None and episode.assistant_turns >= config.max_assistant_turns:
            episode.ended = "max_assistant_turns"
        elif config.max_user_turns is not None and episode.user_turns >= config.max_user_turns:
            episode.ended = "max_user_turns"
        else:
            return parsed.calls, parsed.malformed
        return None

    async def _run_calls(self, episode: Episode, calls: list, malformed: list[str]) -> list[tuple[Any, ToolOutcome]]:
        """The turn's tool calls, at most `max_parallel_calls` of them, concurrently: (call, outcome) each,
        in order: malformed blocks first (call None), then the calls (those over the limit get an error)."""
        limit = self.config.max_parallel_calls
        outcomes = [malformed_outcome(message) for message in malformed]
        outcomes += await asyncio.gather(*(
            run_tool_call(self.tools, call, tools_kwargs=episode.tools_kwargs, timeout_s=self.config.tool_timeout_s)
            for call in calls[:limit]
        ))
        outcomes += [
            ToolOutcome(text=f"Error: at most {limit} tool call(s) per turn; this call was not run.",
                        error="too_many_calls", seconds=0.0)
            for _ in calls[limit:]
        ]
        return list(zip([None] * len(malformed) + list(calls), outcomes))

    def _add_tool_results(self, episode: Episode, results: list[tuple[Any, ToolOutcome]]) -> bool:
        """Record the calls and append the tool messages; False (and the episode ends) when the messages
        leave no room to answer."""
        config = self.config
        outcomes = [outcome for _, outcome in results]
        for call, outcome in results:
            episode.tool_calls.append({
                "name": call.name if call else None,
                "arguments": call.arguments if call else None,
                "result": outcome.text,
                "error": outcome.error,
                "seconds": outcome.seconds,
                "reward": outcome.reward,
            })
        messages = [
            {"role": "tool", "content": truncate_text(o.text, config.max_tool_response_length,
                                                      config.tool_response_truncate_side)}
            for o in outcomes
        ]
        ids = self.encoder.encode(messages)
        if len(episode.response_ids) + len(ids) + 1 > self.response_length:
            episode.ended = "length"
            return False
        episode.add_tool(ids)
        episode.messages.extend(messages)
        episode.user_turns += 1
        return True


def final_assistant_text(episode: Mapping[str, Any]) -> str:
    """The last assistant message of an episode summary: what a reward judges as `solution_str`."""
    for message in reversed(episode["messages"]):
        if message["role"] == "assistant":
            return message["content"]
    return ""


def agent_metrics(episodes: Sequence[Episode], elapsed_s: float) -> dict[str, float]:
    """`agent/*` metrics of one rollout: turns, calls, errors per kind (per episode), tool time, truncation."""
    count = max(len(episodes), 1)
    calls = [c for e in episodes for c in e.tool_calls]
    metrics = {
        "agent/num_turns/mean": sum(e.assistant_turns for e in episodes) / count,
        "agent/num_turns/max": float(max((e.assistant_turns for e in episodes), default=0)),
        "agent/tool_calls/mean": len(calls) / count,
        "agent/tool_time_s": sum(c["seconds"] for c in calls),
        "agent/truncated_frac": sum(e.truncated for e in episodes) / count,
        "agent/rollout_s": elapsed_s,
    }
    for kind in sorted({c["error"] for c in calls if c["error"]}):
        metrics[f"agent/tool_errors/{kind}"] = sum(c["error"] == kind for c in calls) / count
    for ending in ENDINGS:
        metrics[f"agent/ended/{ending}"] = sum(e.ended == ending for e in episodes) / count
    return metrics
