"""An OpenAI-compatible endpoint over the rollout engine, for agents hflow did not write.

While a step generates (`rollout.multi_turn.endpoint.enable`), each rollout rank serves
`/v1/chat/completions` and `/v1/completions` on localhost and runs the user's agent function once per
sample, in threads: ``run_episode(base_url, episode_id, row)``, typically with the `openai` client (the row:
its ``prompt``, ``extra_info``, the ``tools`` its prompt was rendered with, and ``env``, the entry of the
environment `multi_turn.env_config_path` gives it, ``{name, config}``, for an agent that builds its own). Every
request names its episode (header ``X-Episode-Id``, or the body's ``episode_id`` / ``user``); hflow keeps,
per episode, the same record as its own loop (`hflow.agent.loop.Episode`): the prompt's ids, each turn's ids
as the engine sampled them with their log-probs, and the ids it rendered for the messages the agent added.

Token in, token out holds as in the loop. An agent re-sends its whole history with every request; the
endpoint matches that history against the messages it recorded, message by message, and never encodes it
again: only the messages after the recorded ones (tool results, user turns) are rendered, alone, after the
last sampled turn (`ToolMessageEncoder`, as the loop renders tool messages), and appended with loss mask 0.
The first request must render to the row's prompt (the batch's prompt ids are the trajectory's). What cannot
be matched is refused with an HTTP error naming the episode and what differs: an unknown episode (404),
a changed history (400, the first differing message), a prompt or history past the length limits (400, the
length and the limit), a second request of an episode while one runs or after its end (409).

Requests become turns of the running engine (`TurnEngine.add_turn`), so they join its batch as the loop's
turns do; the rollout thread runs the engine (`run_external_agents`), the server's thread only checks and
records. A sampled turn's tool calls are read by the loop's tool-call parser and returned as OpenAI
``tool_calls``; the agent runs its tools itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hflow.agent.chat import ToolMessageEncoder
from hflow.agent.config import EPISODE_HEADER, open_endpoint_socket
from hflow.agent.failures import check_agent_failures, describe_agent_error
from hflow.agent.loop import Episode, TurnEngine, TurnResult
from hflow.agent.parsers import ToolCallParser

__all__ = ["Endpoint", "EndpointError", "EndpointServer", "run_external_agents"]


class EndpointError(Exception):
    """A request the endpoint refuses: its HTTP status and a message naming the episode and what to change."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class _Record:
    """One episode as the endpoint knows it."""

    episode_id: str
    key: int  # the sample's index in this rollout call (the engine's key, the request seeds')
    episode: Episode
    kind: str | None = None  # "chat" or "completion", fixed by the first request
    transcript: list[dict] = field(default_factory=list)  # chat: every message so far, normalised
    tools: list | None = None  # chat: the tool schemas of the first request
    text: str = ""  # completion: the prompt text and every text since, as the agent has it
    cut: bool = False  # the last turn stopped at the response budget: nothing can follow it
    refused_length: bool = False  # a request was refused for the length limits
    running: bool = False  # a request of this episode is in the engine
    over: str | None = None  # the agent function returned or was abandoned: no more requests


@dataclass
class _Turn:
    key: int
    ids: list[int]
    max_tokens: int
    sampling: dict  # temperature, top_p, seed: those the request set
    future: concurrent.futures.Future
    finish: Callable[[TurnResult], dict]  # records the sampled turn; returns the response body


class Endpoint:
    """The episodes of one rollout call and the checks of their requests (thread-safe)."""

    def __init__(self, tokenizer: Any, parser: ToolCallParser, eos_token_ids: Sequence[int], prompt_limit: int,
                 response_length: int, model_name: str = "hflow-policy", want_log_probs: bool = True) -> None:
        self.tokenizer = tokenizer
        self.parser = parser
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.prompt_limit = int(prompt_limit)
        self.response_length = int(response_length)
        self.model_name = model_name
        self.want_log_probs = want_log_probs
        self.records: dict[str, _Record] = {}
        self.turns: queue.Queue[_Turn] = queue.Queue()
        self.lock = threading.Lock()
        self.refused: dict[str, int] = {}  # error code -> count, for the metrics
        self._encoders: dict[str, ToolMessageEncoder] = {}

    def open(self, episode: Episode, key: int) -> str:
        """Register a sample's episode; returns its id."""
        episode_id = f"ep-{uuid.uuid4().hex[:12]}-{key}"
        self.records[episode_id] = _Record(episode_id, key, episode)
        return episode_id

    def close(self, episode_id: str, reason: str) -> None:
        with self.lock:
            self.records[episode_id].over = reason

    # ---- requests (the server's thread) -----------------------------------------------------------------

    def chat(self, body: Mapping[str, Any], header_id: str | None) -> concurrent.futures.Future:
        """Check a chat request against its episode and queue its turn; the future resolves to the response."""
        with self.lock:
            try:
                record = self._record(body, header_id, "chat")
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
                    raise EndpointError(400, f"episode {record.episode_id}: 'messages' must be a non-empty list of "
                                             "message objects", "invalid_messages")
                tools = body.get("tools") or None
                if record.kind is None:
                    self._first_chat(record, messages, tools)
                else:
                    self._continue_chat(record, messages, tools)
                return self._queue(record, body, lambda result: self._finish_chat(record, result, body))
            except EndpointError as err:
                self.refused[err.code] = self.refused.get(err.code, 0) + 1
                raise

    def completion(self, body: Mapping[str, Any], header_id: str | None) -> concurrent.futures.Future:
        """Check a completion request (prompt text or token ids) against its episode and queue its turn."""
        with self.lock:
            try:
                record = self._record(body, header_id, "completion")
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                    prompt = prompt[0]
                is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
                if not (isinstance(prompt, str) or is_ids) or not prompt:
                    raise EndpointError(400, f"episode {record.episode_id}: 'prompt' must be one text or one list of "
                                             "token ids", "invalid_prompt")
                if record.kind is None:
                    ids = list(prompt) if is_ids else self._encode(prompt)
                    self._check_prompt(record, ids)
                    record.kind = "completion"
                    record.text = prompt if not is_ids else self.tokenizer.decode(ids, skip_special_tokens=False)
                else:
                    self._continue_completion(record, prompt, is_ids)
                return self._queue(record, body, lambda result: self._finish_completion(record, result, body))
            except EndpointError as err:
                self.refused[err.code] = self.refused.get(err.code, 0) + 1
                raise

    def _record(self, body: Mapping[str, Any], header_id: str | None, kind: str) -> _Record:
        episode_id = header_id or body.get("episode_id") or body.get("user")
        if not episode_id:
            raise EndpointError(400, f"no episode id: send the episode_id given to the agent function as the "
                                     f"'{EPISODE_HEADER}' header (or the body's 'episode_id' or 'user')", "no_episode_id")
        record = self.records.get(str(episode_id))
        if record is None:
            known = sorted(self.records, key=lambda k: self.records[k].key)
            sample = f"{known[0]} ... {known[-1]}" if known else "none"
            raise EndpointError(404, f"unknown episode id {episode_id!r}: this step's episodes are {sample} "
                                     f"({len(known)}); use the episode_id hflow passed to the agent function",
                                "unknown_episode")
        where = f"episode {record.episode_id}"
        if record.over is not None:
            raise EndpointError(409, f"{where} is over ({record.over}); it takes no more requests", "episode_over")
        if record.running:
            raise EndpointError(409, f"{where} already has a request running; an episode's requests go one at a "
                                     "time (wait for the answer)", "episode_busy")
        if record.kind is not None and record.kind != kind:
            raise EndpointError(400, f"{where} is a {record.kind} episode; a {kind} request cannot continue it",
                                "mixed_episode")
        if record.cut and kind == "chat":
            raise EndpointError(400, f"{where}: its last turn ended without a stop token (finish_reason 'length'); "
                                     "a chat episode cannot go on from there (the turn's end would be missing from "
                                     "the trajectory)", "turn_not_ended")
        if int(body.get("n") or 1) != 1:
            raise EndpointError(400, f"{where}: n={body.get('n')}; the endpoint samples one choice per request "
                                     "(an episode is one trajectory)", "unsupported_n")
        if body.get("stream"):
            raise EndpointError(400, f"{where}: stream=true is not supported; ask without streaming",
                                "unsupported_stream")
        return record

    def _first_chat(self, record: _Record, messages: list, tools: list | None) -> None:
        """The first request: its messages (with its tools) must render to the row's prompt ids."""
        where = f"episode {record.episode_id}"
        for index, message in enumerate(messages):
            if message.get("role") == "assistant":
                raise EndpointError(400, f"{where}: message {index} is an assistant message before the episode's "
                                         "first turn; the first request sends the row's prompt", "changed_history")
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if tools:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)
        except Exception as err:  # a template that cannot render these messages
            raise EndpointError(400, f"{where}: the chat template cannot render the messages ({err})",
                                "invalid_messages") from None
        ids = self._encode(text)
        prompt = [_normal(m) for m in record.episode.row.get("prompt") or []]
        if prompt and ids != record.episode.prompt_ids and len(ids) <= self.prompt_limit:
            sent = [_normal(m) for m in messages]
            index, what = _first_difference(sent, prompt)
            if index is not None:
                raise EndpointError(400, f"{where}: message {index} differs from the row's prompt ({what}); the first "
                                         "request sends the row's prompt messages (row['prompt'])", "changed_history")
        self._check_prompt(record, ids, "with these tools" if tools else "")
        record.kind, record.transcript, record.tools = "chat", [_normal(m) for m in messages], tools

    def _check_prompt(self, record: _Record, ids: list[int], note: str = "") -> None:
        where = f"episode {record.episode_id}"
        if len(ids) > self.prompt_limit:
            record.refused_length = True
            raise EndpointError(400, f"{where}: the prompt is {len(ids)} tokens; the limit is {self.prompt_limit} "
                                     "(data.max_prompt_length)", "prompt_too_long")
        prompt = record.episode.prompt_ids
        if ids != prompt:
            at = next((i for i, (a, b) in enumerate(zip(ids, prompt)) if a != b), min(len(ids), len(prompt)))
            raise EndpointError(400, f"{where}: the first request's prompt{' ' + note if note else ''} is {len(ids)} "
                                     f"tokens that differ from the row's prompt ({len(prompt)} tokens) from token {at}; "
                                     "send the row's prompt (row['prompt'], with tools=row['tools'])",
                                "changed_history")

    def _continue_chat(self, record: _Record, messages: list, tools: list | None) -> None:
        """A later request: the recorded messages, as they were, then new non-assistant messages."""
        where = f"episode {record.episode_id}"
        sent = [_normal(m) for m in messages]
        recorded = record.transcript
        index, what = _first_difference(sent[: len(recorded)], recorded)
        if index is not None:
            raise EndpointError(400, f"{where}: message {index} differs from the episode's recorded message {index} "
                                     f"({what}); re-send the history as the endpoint returned it and add new messages "
                                     "after it", "changed_history")
        if len(sent) <= len(recorded):
            raise EndpointError(400, f"{where}: the request has {len(sent)} messages and the episode recorded "
                                     f"{len(recorded)}; send the whole history and the new messages (a tool result, a "
                                     "user turn) after it", "changed_history")
        new = sent[len(recorded):]
        for offset, message in enumerate(new):
            if message["role"] == "assistant":
                raise EndpointError(400, f"{where}: message {len(recorded) + offset} is an assistant message the "
                                         "endpoint did not sample; only tool, user and system messages can be added",
                                    "changed_history")
        if (tools or None) != record.tools:
            raise EndpointError(400, f"{where}: the request's tools differ from its first request's; the prompt "
                                     "rendered them, so they cannot change within an episode", "changed_history")
        ids = self._encoder(tools).encode([dict(m) for m in messages[len(recorded):]])
        self._check_room(record, len(ids))
        episode = record.episode
        episode.add_tool(ids)
        episode.messages.extend(new)
        episode.user_turns += 1
        record.transcript.extend(new)

    def _continue_completion(self, record: _Record, prompt: Any, is_ids: bool) -> None:
        where = f"episode {record.episode_id}"
        episode = record.episode
        if is_ids:
            recorded = episode.ids
            at = next((i for i, (a, b) in enumerate(zip(prompt, recorded)) if a != b), None)
            if at is not None or len(prompt) <= len(recorded):
                at = at if at is not None else len(prompt)
                raise EndpointError(400, f"{where}: the prompt's token {at} differs from the episode's recorded ids "
                                         f"({len(recorded)} so far); send them unchanged with new ids after them",
                                    "changed_history")
            ids, text = list(prompt[len(recorded):]), self.tokenizer.decode(prompt[len(recorded):],
                                                                            skip_special_tokens=False)
        else:
            if not prompt.startswith(record.text) or len(prompt) == len(record.text):
                at = next((i for i, (a, b) in enumerate(zip(prompt, record.text)) if a != b), len(prompt))
                raise EndpointError(400, f"{where}: the prompt's text differs from the episode's recorded text at "
                                         f"character {at} (of {len(record.text)}); send it unchanged with new text after "
                                         "it", "changed_history")
            text = prompt[len(record.text):]
            ids = self._encode(text)
        self._check_room(record, len(ids))
        episode.add_tool(ids)
        episode.messages.append({"role": "user", "content": text})
        episode.user_turns += 1
        record.text += text

    def _check_room(self, record: _Record, added: int) -> None:
        """The episode's response with `added` more ids must leave room for one sampled token."""
        length = len(record.episode.response_ids) + added
        if length + 1 > self.response_length:
            record.refused_length = True
            raise EndpointError(400, f"episode {record.episode_id}: with the new messages the episode's response "
                                     f"is {length} tokens after the prompt and the next turn needs at least one more; "
                                     f"the limit is {self.response_length} (data.max_response_length)",
                                "context_too_long")

    def _queue(self, record: _Record, body: Mapping[str, Any], finish: Callable[[TurnResult], dict]):
        room = self.response_length - len(record.episode.response_ids)
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None and int(asked) < 1:
            raise EndpointError(400, f"episode {record.episode_id}: max_tokens={asked}; ask for at least 1",
                                "invalid_max_tokens")
        sampling = {name: body[name] for name in ("temperature", "top_p", "seed") if body.get(name) is not None}
        future: concurrent.futures.Future = concurrent.futures.Future()
        record.running = True
        self.turns.put(_Turn(record.key, list(record.episode.ids), min(int(asked or room), room), sampling, future,
                             finish))
        return future

    # ---- sampled turns (the rollout's thread) ---------------------------------------------------------

    def _sampled(self, record: _Record, result: TurnResult) -> tuple[list[int], str]:
        episode = record.episode
        ids = result.token_ids
        episode.add_sampled(ids, result.log_probs, result.versions)
        episode.assistant_turns += 1
        record.cut = not result.stopped
        record.running = False
        body = ids[:-1] if result.stopped and ids and ids[-1] in self.eos_token_ids else ids
        return body, self.tokenizer.decode(body, skip_special_tokens=False)

    def _finish_chat(self, record: _Record, result: TurnResult, request: Mapping[str, Any]) -> dict:
        body, text = self._sampled(record, result)
        parsed = self.parser.parse(text)
        turn = record.episode.assistant_turns
        calls = [{"id": f"call_{turn}_{i}", "type": "function",
                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for i, c in enumerate(parsed.calls)]
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if calls:
            message["tool_calls"] = calls
        record.transcript.append(_normal(message))
        record.episode.tool_calls.extend({"name": c.name, "arguments": c.arguments, "result": None, "error": None,
                                          "seconds": 0.0, "reward": 0.0} for c in parsed.calls)  # the agent runs them
        record.episode.messages.append({"role": "assistant", "content": text})
        finish = "length" if not result.stopped else "tool_calls" if calls else "stop"
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if request.get("logprobs") and result.log_probs is not None:
            choice["logprobs"] = {"content": [
                {"token": self.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(result.token_ids, result.log_probs)]}
        return self._response("chat.completion", record, choice, result)

    def _finish_completion(self, record: _Record, result: TurnResult, request: Mapping[str, Any]) -> dict:
        self._sampled(record, result)
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=False)  # the stop token's text too
        record.text += text
        record.episode.messages.append({"role": "assistant", "content": text})
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "stop" if result.stopped else "length",
                                  "token_ids": list(result.token_ids), "logprobs": None}
        if request.get("logprobs") is not None and result.log_probs is not None:
            choice["logprobs"] = {"tokens": [self.tokenizer.decode([t]) for t in result.token_ids],
                                  "token_logprobs": list(result.log_probs), "text_offset": None, "top_logprobs": None}
        return self._response("text_completion", record, choice, result)

    def _response(self, kind: str, record: _Record, choice: dict, result: TurnResult) -> dict:
        prompt_tokens = len(record.episode.ids) - len(result.token_ids)
        return {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(result.token_ids),
                          "total_tokens": prompt_tokens + len(result.token_ids)}}

    def finish(self, turn: _Turn, result: TurnResult) -> None:
        try:
            with self.lock:
                response = turn.finish(result)
        except BaseException:
            turn.future.set_exception(EndpointError(500, "the endpoint failed to record the turn", "internal"))
            raise
        turn.future.set_result(response)

    def abandon(self, turns: Sequence[_Turn]) -> None:
        """Answer the requests no engine will finish (the rollout stopped): 503, so no agent waits forever."""
        while True:
            try:
                turns = [*turns, self.turns.get_nowait()]
            except queue.Empty:
                break
        for turn in turns:
            if not turn.future.done():
                turn.future.set_exception(EndpointError(503, "the rollout stopped before this request was sampled",
                                                        "rollout_stopped"))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encoder(self, tools: list | None) -> ToolMessageEncoder:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._encoders:
            self._encoders[key] = ToolMessageEncoder(self.tokenizer, tools)
        return self._encoders[key]


def _normal(message: Mapping[str, Any]) -> dict:
    """A message as the endpoint compares it: role, text content, and an assistant's calls (name, arguments)."""
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text
        content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    out = {"role": message.get("role"), "content": content or ""}
    if message.get("role") == "assistant":
        calls = []
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError:
                    pass
            calls.append({"name": function.get("name"), "arguments": arguments})
        out["tool_calls"] = calls
    return out


def _first_difference(sent: list[dict], recorded: list[dict]) -> tuple[int | None, str]:
    """The first index where two normalised message lists differ, and how."""
    for index, (a, b) in enumerate(zip(sent, recorded)):
        if a == b:
            continue
        if a["role"] != b["role"]:
            return index, f"role {a['role']!r}, recorded {b['role']!r}"
        if a["content"] != b["content"]:
            return index, f"{a['role']} content {_clip(a['content'])}, recorded {_clip(b['content'])}"
        return index, f"tool_calls {a.get('tool_calls')}, recorded {b.get('tool_calls')}"
    if len(sent) != len(recorded):
        return min(len(sent), len(recorded)), f"{len(sent)} messages, recorded {len(recorded)}"
    return None, ""


def _clip(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


class EndpointServer:
    """The HTTP side: three routes over an `Endpoint` (Starlette, which FastAPI is built on), served by uvicorn
    on a thread of its own."""

    def __init__(self, endpoint: Endpoint, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse

        async def answer(submit: Callable, request) -> JSONResponse:
            try:
                body = await request.json()
            except Exception:
                return _error(JSONResponse, EndpointError(400, "the request body is not JSON", "invalid_json"))
            if not isinstance(body, dict):
                return _error(JSONResponse, EndpointError(400, "the request body must be a JSON object", "invalid_json"))
            try:
                future = submit(body, request.headers.get(EPISODE_HEADER))
                return JSONResponse(await asyncio.wrap_future(future))
            except EndpointError as err:
                return _error(JSONResponse, err)

        async def chat(request) -> JSONResponse:
            return await answer(endpoint.chat, request)

        async def completions(request) -> JSONResponse:
            return await answer(endpoint.completion, request)

        async def models(request) -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": endpoint.model_name, "object": "model",
                                                              "owned_by": "hflow"}]})

        app = Starlette()
        app.add_route("/v1/chat/completions", chat, methods=["POST"])
        app.add_route("/v1/completions", completions, methods=["POST"])
        app.add_route("/v1/models", models, methods=["GET"])

        self.socket = open_endpoint_socket(host, int(port))  # a port in use: a ConfigError naming the key
        self.base_url = f"http://{host}:{self.socket.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       name="hflow-endpoint", daemon=True)

    def __enter__(self) -> EndpointServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {self.base_url}")
            time.sleep(0.005)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


def _error(response_class, err: EndpointError):
    return response_class({"error": {"message": str(err), "type": "invalid_request_error", "param": None,
                                     "code": err.code}}, status_code=err.status)


@dataclass
class _Agent:
    episode_id: str
    thread: threading.Thread | None = None
    started: float = 0.0
    outcome: Any = None
    error: str | None = None
    done: bool = False


def run_external_agents(endpoint: Endpoint, engine: TurnEngine, agent: Callable, rows: Sequence[Mapping[str, Any]],
                        set_sampling: Callable[[int, dict], None], config: Any) -> list[Episode]:
    """Run `agent(base_url, episode_id, row)` once per row of `endpoint`'s registered episodes (keys 0..), at most
    `config.max_concurrent_episodes` at once, serving their requests on `engine` until every agent has
    returned, failed or passed `config.episode_timeout_s`; returns the episodes in key order.

    `set_sampling(key, sampling)` gives the engine the request's temperature / top_p / seed for the next turn
    of `key`. An agent's return value is its episode's final reward (a number, or a dict with "reward";
    other keys are kept in the episode's info), credited to the episode's last sampled token. The info is
    where hflow's loop keeps an environment's step info: an environment the agent owns reports its verdict
    there, and a scorer of `extra_info["episode"]` reads it either way (the vault task's does)."""
    return _AgentRun(endpoint, engine, agent, rows, set_sampling, config).run()


class _AgentRun:
    def __init__(self, endpoint: Endpoint, engine: TurnEngine, agent: Callable, rows: Sequence[Mapping[str, Any]],
                 set_sampling: Callable[[int, dict], None], config: Any) -> None:
        self.endpoint, self.engine, self.agent, self.rows = endpoint, engine, agent, rows
        self.set_sampling, self.config = set_sampling, config
        self.records = sorted(endpoint.records.values(), key=lambda r: r.key)
        self.agents = [_Agent(r.episode_id) for r in self.records]
        self.in_engine: dict[int, _Turn] = {}  # key -> the request whose turn the engine runs

    def run(self) -> list[Episode]:
        with EndpointServer(self.endpoint, str(self.config.host), int(self.config.port)) as server:
            try:
                self._serve(server.base_url)
            finally:  # whatever stopped the rollout, no request is left waiting
                self.endpoint.abandon(list(self.in_engine.values()))
        episodes = [self._ended(record, state) for record, state in zip(self.records, self.agents)]
        check_agent_failures(episodes, [state.error for state in self.agents], self.config)
        return episodes

    def _call(self, state: _Agent, base_url: str, row: Mapping[str, Any]) -> None:
        try:
            state.outcome = self.agent(base_url, state.episode_id, dict(row))
        except BaseException as err:  # the agent's failure ends its episode; too many of them end the run
            state.error = describe_agent_error(err)
        finally:
            state.done = True

    def _serve(self, base_url: str) -> None:
        """Start agents up to the limit, feed their turns to the engine, hand back the finished ones, until
        every agent is done (or abandoned) and nothing runs."""
        endpoint, engine, agents = self.endpoint, self.engine, self.agents
        limit, timeout = int(self.config.max_concurrent_episodes), float(self.config.episode_timeout_s)
        waiting, running = list(range(len(agents))), []
        while True:
            for key in [k for k in running if agents[k].done or time.monotonic() - agents[k].started > timeout]:
                running.remove(key)  # a hung agent's thread is abandoned; its episode takes no more requests
                endpoint.close(agents[key].episode_id, "agent returned" if agents[key].done else "agent_timeout")
            while waiting and len(running) < limit:
                key = waiting.pop(0)
                state = agents[key]
                state.started = time.monotonic()
                row = {**self.rows[key], "episode_id": state.episode_id}
                state.thread = threading.Thread(target=self._call, args=(state, base_url, row),
                                                name=f"hflow-agent-{key}", daemon=True)
                state.thread.start()
                running.append(key)
            try:  # new turns; wait a moment for one when the engine has nothing to run
                turn = endpoint.turns.get(timeout=0.005 if not engine.busy() else 0)
                while True:
                    self.set_sampling(turn.key, turn.sampling)
                    engine.add_turn(turn.key, turn.ids, turn.max_tokens)
                    self.in_engine[turn.key] = turn
                    turn = endpoint.turns.get_nowait()
            except queue.Empty:
                pass
            for result in engine.poll():
                endpoint.finish(self.in_engine.pop(result.key), result)
            if not waiting and not running and not self.in_engine and endpoint.turns.empty():
                return

    @staticmethod
    def _ended(record: _Record, state: _Agent) -> Episode:
        """The episode as the agent left it: its return value credited, how it ended."""
        episode = record.episode
        outcome = state.outcome
        reward = outcome.get("reward") if isinstance(outcome, Mapping) else outcome
        if isinstance(outcome, Mapping):
            episode.info.append({k: v for k, v in outcome.items() if k != "reward"})
        if reward is not None:
            try:
                episode.credit("agent", float(reward))
            except (TypeError, ValueError):
                episode.problems.append("agent_malformed_reward")
        if state.error is not None:
            episode.info.append({"agent_error": state.error})
        episode.ended = ("agent_timeout" if not state.done else "agent_error" if state.error is not None
                         else "length" if record.cut or record.refused_length else "agent_done")
        if not episode.assistant_turns:
            episode.problems.append("agent_no_turns")
        return episode

