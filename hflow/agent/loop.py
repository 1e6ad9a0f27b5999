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

Each episode has an `EpisodeSession` (`hflow.agent.session`) on the tool runner's loop: one instance
of every tool for the whole episode, and the row's environment or simulated user, if any. A turn without
tool calls is answered by the environment's step, else the simulated user, else it is the answer. Their
messages enter the trajectory as the chat template renders them (loss mask 0), their rewards sit on the
last sampled token of the turn they judge (`Episode.rewards`), and the session is closed (final tool
rewards, every release) when the episode ends, or when the rollout stops for any reason.

An episode ends when a turn has no tool call and nothing answers it (`answer`), when a turn is cut by the
response budget (`length`), when the turn limits are reached (`max_assistant_turns`, `max_user_turns`),
when the environment or the simulated user ends it (`env_done`, `interaction_done`) or fails
(`env_error`, `env_timeout`, `env_malformed`, `interaction_*`), or when the next message would not
leave room for one more sampled token (`length`, the message is not added). The last token of an episode
is therefore always a sampled one, where the outcome reward goes.
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

from hflow.agent.chat import ToolMessageEncoder
from hflow.agent.config import MultiTurnConfig
from hflow.agent.env import EnvTable
from hflow.agent.interactions import InteractionTable
from hflow.agent.parsers import ToolCallParser
from hflow.agent.session import EpisodeSession, Reply
from hflow.agent.tools import BaseTool, use_tool_threads

__all__ = ["AgentLoop", "Episode", "ToolRunner", "TurnEngine", "TurnResult", "agent_metrics",
           "final_assistant_text"]

ENDINGS = ("answer", "length", "max_assistant_turns", "max_user_turns", "env_done", "interaction_done",
           "env_error", "env_timeout", "env_malformed", "interaction_error", "interaction_timeout",
           "interaction_malformed",
           "agent_done", "agent_error", "agent_timeout")  # the last three: external agents (hflow.agent.endpoint)
ADMIT_POLL_S = 0.005  # with `admit`: how long a loop with nothing to step waits for a reply before asking again


@dataclass
class Episode:
    """One sample's trajectory and what happened in it."""

    prompt_ids: list[int]
    tools_kwargs: Mapping[str, Any] = field(default_factory=dict)
    row: Mapping[str, Any] = field(default_factory=dict)  # data_source, agent_name, extra_info, prompt
    env_spec: Any = None  # the row's environment (hflow.agent.env.EnvSpec), if any
    interaction: Any = None  # the row's simulated user, if any
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy, 0 = tool/user message
    log_probs: list[float] = field(default_factory=list)  # sampler log-prob, 0.0 on tool tokens
    versions: list[int] = field(default_factory=list)  # policy version that sampled each token; -1: tool token or unknown
    messages: list[dict[str, Any]] = field(default_factory=list)  # assistant, tool and user messages, for rewards and logs
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[dict[str, Any]] = field(default_factory=list)  # step/turn rewards: source, reward, turn, position
    problems: list[str] = field(default_factory=list)  # failures that did not end the episode (release timeouts...)
    info: list[dict[str, Any]] = field(default_factory=list)  # the environment's / simulated user's per turn
    assistant_turns: int = 0
    user_turns: int = 0
    ended: str | None = None
    end_after_turn: str | None = None  # the session failed at its start: the first turn is the last
    closed: bool = False  # the session's close came back (final rewards placed, everything released)
    finished_s: float | None = None  # seconds from the rollout's start to the episode's end

    @property
    def responder(self) -> str | None:
        """What answers a turn without tool calls: "env", else "interaction", else nothing (the turn is the answer)."""
        return "env" if self.env_spec is not None else "interaction" if self.interaction is not None else None

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

    def credit(self, source: str, reward: float) -> None:
        """A step or turn reward, on the last sampled token so far: the end of the turn it judges."""
        position = max((i for i, m in enumerate(self.loss_mask) if m), default=None)
        if position is None:  # (rewards come after a turn; kept out of the trajectory otherwise)
            self.problems.append("reward_before_first_turn")
            return
        self.rewards.append({"source": source, "reward": float(reward), "turn": self.assistant_turns,
                             "position": position})

    def token_rewards(self, width: int) -> list[float]:
        """Per response token, the step/turn rewards credited there (0.0 elsewhere), `width` long."""
        out = [0.0] * width
        for reward in self.rewards:
            if reward["position"] < width:
                out[reward["position"]] += reward["reward"]
        return out

    def summary(self) -> dict[str, Any]:
        """The episode for rewards (`extra_info["episode"]`) and logs: JSON-serialisable."""
        return {
            "messages": self.messages,
            "tool_calls": self.tool_calls,
            "rewards": self.rewards,
            "info": self.info,
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
        envs: EnvTable | None = None,
        interactions: InteractionTable | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config  # rollout.multi_turn as validated (the dataclass or its DictConfig)
        self.tools = dict(tools)
        self.parser = parser
        self.response_length = int(response_length)
        self.encoder = ToolMessageEncoder(tokenizer, tool_schemas)
        self.envs = envs
        self.interactions = interactions

    # ---- the loop ------------------------------------------------------------------------------------

    def run(
        self,
        engine: TurnEngine,
        prompts: Sequence[list[int]],
        eos_token_ids: Sequence[int],
        tools_kwargs: Sequence[Mapping[str, Any]] | None = None,
        agree: Callable[[list], list] | None = None,
        all_done: Callable[[bool], bool] | None = None,
        rows: Sequence[Mapping[str, Any]] | None = None,
        admit: Callable[[list[Episode]], list | None] | None = None,
    ) -> list[Episode]:
        """Episodes for `prompts` (one each, in order); a turn ends at any of `eos_token_ids`.

        `rows` are the samples' ``data_source``, ``agent_name``, ``extra_info`` and ``prompt`` (messages):
        they choose the environment and the simulated user. `agree` makes ranks that drive one engine
        together (tensor parallelism) see the same replies at the same step: it takes this rank's arrivals
        and returns the leader's (only the leader runs tools and environments). `all_done` (waves on
        several ranks) tells whether every rank has finished. `admit` (continuous admission,
        `hflow.workers.rollout.router`) is asked between engine steps for more episodes, (prompt ids, tools
        kwargs, row) each, appended to the list; it returns None when no more will come.
        """
        kwargs = tools_kwargs if tools_kwargs is not None else [{}] * len(prompts)
        rows = rows if rows is not None else [{}] * len(prompts)
        episodes = [self._episode(p, k, r, i) for i, (p, k, r) in enumerate(zip(prompts, kwargs, rows))]
        runs_tools = agree is None or getattr(agree, "is_leader", True)
        runner = ToolRunner(self.config.max_concurrent_tools) if runs_tools else None
        sessions = [self._session(e) for e in episodes] if runner is not None else []
        pending: dict[concurrent.futures.Future, int] = {}  # a session call in flight -> its episode
        waiting: set[int] = set(range(len(episodes)))  # episodes whose reply is not back yet (starts first)
        if runner is not None:
            for key, session in enumerate(sessions):
                pending[runner.run_soon(session.start())] = key
        ready: list[int] = []
        started = time.perf_counter()

        def end(key: int) -> None:  # the episode is over: close its session (final rewards, releases)
            waiting.add(key)
            if runner is not None:
                pending[runner.run_soon(sessions[key].close())] = key

        try:
            while True:
                if not engine.streams and pending:  # a wave starts when every reply is back
                    concurrent.futures.wait(pending)
                idle = not engine.busy() and not ready and bool(pending)
                # admitting: wait for a tool at most a moment, new episodes may be waiting to start
                arrivals = self._collect(pending, block=idle, timeout=ADMIT_POLL_S if admit is not None else None)
                if agree is not None:
                    arrivals = agree(arrivals)
                for key, reply in arrivals:
                    waiting.discard(key)
                    episode = episodes[key]
                    if self._apply(episode, reply):
                        ready.append(key)
                    elif reply.stage == "close":
                        episode.closed = True
                        episode.finished_s = time.perf_counter() - started
                    else:
                        end(key)
                if admit is not None:
                    new = admit(episodes)
                    if new is None:
                        admit = None
                    for ids, kwargs, row in new or []:  # started like the first ones: the session first
                        key = len(episodes)
                        episodes.append(self._episode(ids, kwargs, row, key))
                        waiting.add(key)
                        if runner is not None:
                            sessions.append(self._session(episodes[key]))
                            pending[runner.run_soon(sessions[key].start())] = key
                for key in ready:
                    episode = episodes[key]
                    engine.add_turn(key, episode.ids, self.response_length - len(episode.response_ids))
                ready = []
                finished = all(e.closed for e in episodes) and not waiting and admit is None
                if all_done is not None:
                    finished = all_done(finished)
                if finished:
                    break
                for result in engine.poll():
                    episode = episodes[result.key]
                    calls = self._end_turn(episode, result, eos_token_ids)
                    if calls is None:
                        end(result.key)
                        continue
                    waiting.add(result.key)
                    if runner is not None:
                        future = runner.run_soon(sessions[result.key].respond(*calls, list(episode.messages)))
                        pending[future] = result.key
        finally:
            if runner is not None:
                self._close_all(runner, sessions, pending)
                runner.close()
        return episodes

    def _episode(self, prompt: list[int], tools_kwargs: Mapping | None, row: Mapping, index: int) -> Episode:
        """The sample's episode; its environment and simulated user are chosen here, on every rank alike."""
        row = dict(row or {})
        where = f"sample {index} of this batch (data_source {row.get('data_source')!r})"
        extra_info = row.get("extra_info") or {}
        return Episode(
            prompt_ids=list(prompt), tools_kwargs=dict(tools_kwargs or {}), row=row,
            env_spec=self.envs.for_row(row, where) if self.envs is not None else None,
            interaction=(self.interactions.for_row(extra_info.get("interaction_kwargs"), where)
                         if self.interactions is not None else None))

    def _session(self, episode: Episode) -> EpisodeSession:
        return EpisodeSession(self.config, self.tools, episode.tools_kwargs, episode.row,
                              env_spec=episode.env_spec, interaction=episode.interaction)

    def _close_all(self, runner: ToolRunner, sessions: list[EpisodeSession], pending: dict) -> None:
        """Whatever stopped the rollout, every session is closed (idempotent) before the runner goes;
        each call in a close is bounded, so this is too."""
        async def close_all() -> None:
            await asyncio.gather(*(s.close() for s in sessions if not s.closing))

        bound = 2 * (float(self.config.tool_timeout_s) + float(self.config.env_timeout_s)) + 5
        futures = [f for f in pending if not f.done()] + [runner.run_soon(close_all())]
        concurrent.futures.wait(futures, timeout=bound)

    @staticmethod
    def _collect(pending: dict, block: bool, timeout: float | None = None) -> list[tuple[int, Reply]]:
        """Session replies that are back, as (episode index, reply); waits for one (at most `timeout`)
        when `block`."""
        if block:
            concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        arrivals = []
        for future in [f for f in pending if f.done()]:
            arrivals.append((pending.pop(future), future.result()))
        return arrivals

    # ---- one turn ------------------------------------------------------------------------------------

    def _end_turn(self, episode: Episode, result: TurnResult, eos_token_ids: Sequence[int]) -> tuple[list, list[str]] | None:
        """Record a finished assistant turn; returns its (calls, malformed) when the session answers next."""
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
        elif episode.end_after_turn is not None:
            episode.ended = episode.end_after_turn
        elif not parsed.calls and not parsed.malformed and episode.responder is None:
            episode.ended = "answer"
        elif config.max_assistant_turns is not None and episode.assistant_turns >= config.max_assistant_turns:
            episode.ended = "max_assistant_turns"
        elif config.max_user_turns is not None and episode.user_turns >= config.max_user_turns:
            episode.ended = "max_user_turns"
        else:
            return parsed.calls, parsed.malformed
        return None

    def _apply(self, episode: Episode, reply: Reply) -> bool:
        """Apply a session's reply to the episode; True when the episode goes on with a new turn."""
        episode.tool_calls.extend(reply.tool_calls)
        episode.problems.extend(reply.problems)
        for source, reward in reply.rewards:
            episode.credit(source, reward)
        if reply.info and reply.stage == "turn":
            episode.info.append(reply.info)
        if reply.stage == "close":
            return False
        if reply.stage == "start":
            if reply.end is not None:
                episode.end_after_turn = reply.end
                episode.info.append(reply.info)
            if reply.messages:  # the first observation, after an empty assistant turn
                ids = self.encoder.after_prompt(reply.messages)
                if len(ids) + 1 > self.response_length:
                    episode.end_after_turn = "length"
                else:
                    episode.add_tool(ids)
                    episode.messages.extend([{"role": "assistant", "content": ""}, *reply.messages])
            return True
        if reply.end is not None:
            episode.ended = reply.end
            return False
        ids = self.encoder.encode(reply.messages)
        if len(episode.response_ids) + len(ids) + 1 > self.response_length:
            episode.ended = "length"
            return False
        episode.add_tool(ids)
        episode.messages.extend(reply.messages)
        episode.user_turns += 1
        return True


def final_assistant_text(episode: Mapping[str, Any]) -> str:
    """The last assistant message of an episode summary: what a reward judges as `solution_str`."""
    for message in reversed(episode["messages"]):
        if message["role"] == "assistant":
            return message["content"]
    return ""


def agent_metrics(episodes: Sequence[Episode], elapsed_s: float) -> dict[str, float]:
    """`agent/*` metrics of one rollout: turns, calls, errors per kind (per episode), tool time, truncation,
    how episodes ended, step/turn rewards."""
    count = max(len(episodes), 1)
    calls = [c for e in episodes for c in e.tool_calls]
    metrics = {
        "agent/num_turns/mean": sum(e.assistant_turns for e in episodes) / count,
        "agent/num_turns/max": float(max((e.assistant_turns for e in episodes), default=0)),
        "agent/user_turns/mean": sum(e.user_turns for e in episodes) / count,
        "agent/tool_calls/mean": len(calls) / count,
        "agent/tool_time_s": sum(c["seconds"] for c in calls),
        "agent/truncated_frac": sum(e.truncated for e in episodes) / count,
        "agent/turn_reward/mean": sum(r["reward"] for e in episodes for r in e.rewards) / count,
        "agent/rollout_s": elapsed_s,
    }
    for kind in sorted({c["error"] for c in calls if c["error"]}):
        metrics[f"agent/tool_errors/{kind}"] = sum(c["error"] == kind for c in calls) / count
    for kind in sorted({p for e in episodes for p in e.problems}):
        metrics[f"agent/problems/{kind}"] = sum(p == kind for e in episodes for p in e.problems) / count
    for ending in ENDINGS:
        metrics[f"agent/ended/{ending}"] = sum(e.ended == ending for e in episodes) / count
    return metrics
