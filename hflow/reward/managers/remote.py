"""Score responses with a remote scoring service over HTTP (``custom_reward_function.url``).

The protocol (JSON, one POST per chunk of up to ``batch_size`` samples)::

    POST <url>   {"items": [{"data_source": "...", "solution_str": "...", "ground_truth": ..., "extra_info": {...}},
                            ...],
                  "reward_kwargs": {...}}          # only when custom_reward_function.reward_kwargs is set
    200          {"scores": [1.0, {"score": 0.5, "acc": false}, ...]}   # one per item, in order

Each score follows the local function's rules (a number, or a dict whose ``score`` is the score and whose
other keys become ``reward_extra_info``). Values that JSON cannot hold (numpy arrays and scalars) are sent as
lists and numbers, anything else as its ``str``.

`RemoteScorer` sends the chunks concurrently (at most ``max_concurrency`` in flight), each with a limit of
``request_timeout_s``. A connection error, a timeout or a 5xx answer is retried up to ``max_retries`` times,
after 0.5 s, 1 s, 2 s, ... (exponential backoff); a 4xx answer is the request's fault and is not retried, and
neither is a 200 whose body cannot be read. A chunk that still fails fails its samples with a reason that
names the URL, the samples and the server's answer (status and the start of its body); the reward manager
then stops the run or, with ``on_error=zero``, scores them 0. The whole call is bounded: no chunk waits
longer than (max_retries + 1) x request_timeout_s plus the backoff.

For another protocol, subclass `RemoteScorer` and override `build_request` (the JSON body for a chunk)
and/or `parse_response` (the per-item results from the decoded answer), then hand an instance to a reward
manager (``NaiveRewardManager(..., remote=MyScorer(url))``), e.g. in a manager your reward file registers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from typing import Any

import aiohttp
import numpy as np

from hflow.reward.runner import CallResult

__all__ = ["ITEM_KEYS", "RemoteScorer"]

ITEM_KEYS = ("data_source", "solution_str", "ground_truth", "extra_info")
_BODY_EXCERPT = 200  # characters of a server's answer quoted in an error


class RemoteScorer:
    """An asynchronous HTTP client for a scoring service; `score` is what the reward manager calls.

    Args:
        url: the service's endpoint (http or https).
        max_concurrency: requests in flight at once.
        batch_size: samples per request.
        request_timeout_s: one request's limit in seconds (connecting, sending and reading the answer).
        max_retries: retries of a request after a connection error, a timeout or a 5xx answer.
        backoff_s: the wait before the first retry; it doubles for each further one.
        reward_kwargs: sent as the body's ``reward_kwargs`` when not empty.
        headers: extra HTTP headers (e.g. an authorization token).
    """

    def __init__(self, url: str, max_concurrency: int = 8, batch_size: int = 32, request_timeout_s: float = 60.0,
                 max_retries: int = 3, backoff_s: float = 0.5, reward_kwargs: dict[str, Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        if not str(url).startswith(("http://", "https://")):
            raise ValueError(f"custom_reward_function.url={url!r}: give an http:// or https:// URL")
        for key, value, least in (("max_concurrency", max_concurrency, 1), ("batch_size", batch_size, 1),
                                  ("max_retries", max_retries, 0)):
            if int(value) < least:
                raise ValueError(f"custom_reward_function.{key}={value}; it must be >= {least}")
        if not request_timeout_s > 0:
            raise ValueError(f"custom_reward_function.request_timeout_s={request_timeout_s}; give a positive number")
        self.url = str(url)
        self.max_concurrency = int(max_concurrency)
        self.batch_size = int(batch_size)
        self.request_timeout_s = float(request_timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.reward_kwargs = dict(reward_kwargs or {})
        self.headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # ---- the protocol: override these for another one ------------------------------------------------

    def build_request(self, items: list[dict[str, Any]]) -> Any:
        """The JSON body of one request; `items` hold `ITEM_KEYS` per sample."""
        body: dict[str, Any] = {"items": items}
        if self.reward_kwargs:
            body["reward_kwargs"] = self.reward_kwargs
        return body

    def parse_response(self, body: Any, num_items: int) -> list[Any]:
        """One result per item (a number, or a dict with a ``score`` key) from the decoded JSON answer; raise
        ValueError when the answer cannot be read."""
        scores = body.get("scores") if isinstance(body, dict) else None
        if not isinstance(scores, list):
            raise ValueError('expected an object with a "scores" list')
        if len(scores) != num_items:
            raise ValueError(f"{len(scores)} scores for {num_items} items")
        return scores

    # ---- the client ---------------------------------------------------------------------------------

    def score(self, calls: list[dict[str, Any]]) -> list[CallResult]:
        """One outcome per call (the reward manager's per-sample keyword arguments), in order."""
        items = [{key: call.get(key) for key in ITEM_KEYS} for call in calls]
        starts = range(0, len(items), self.batch_size)
        chunks = [(start, items[start:start + self.batch_size]) for start in starts]
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no event loop in this thread
            results = asyncio.run(self._score_chunks(chunks))
        else:  # called from inside an event loop: run ours in a thread of its own
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                results = pool.submit(asyncio.run, self._score_chunks(chunks)).result()
        return [outcome for chunk in results for outcome in chunk]

    async def _score_chunks(self, chunks: list[tuple[int, list[dict[str, Any]]]]) -> list[list[CallResult]]:
        limit = asyncio.Semaphore(self.max_concurrency)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await asyncio.gather(*(self._score_chunk(session, limit, start, items) for start, items in chunks))

    async def _score_chunk(self, session: aiohttp.ClientSession, limit: asyncio.Semaphore, start: int,
                           items: list[dict[str, Any]]) -> list[CallResult]:
        where = f"POST {self.url} (samples {start}-{start + len(items) - 1})"

        def fail(reason: str) -> list[CallResult]:
            return [CallResult(error=f"{where}: {reason}")] * len(items)

        try:
            data = json.dumps(self.build_request(items), default=_jsonable)
        except (TypeError, ValueError) as err:
            return fail(f"the request could not be encoded as JSON: {err}")
        headers = {"Content-Type": "application/json", **self.headers}
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with limit, session.post(self.url, data=data, headers=headers) as response:
                    status, text = response.status, await response.text(errors="replace")
            except asyncio.TimeoutError:
                last = f"no answer within request_timeout_s={self.request_timeout_s:g}"
                continue
            except (aiohttp.ClientError, OSError) as err:
                last = f"{type(err).__name__}: {err}"
                continue
            if status >= 500:
                last = f"the server answered {status}: {_excerpt(text)}"
                continue
            if status >= 400:
                return fail(f"the server answered {status} (not retried): {_excerpt(text)}")
            try:
                values = self.parse_response(json.loads(text), len(items))
            except (ValueError, TypeError, KeyError) as err:
                return fail(f"the server's answer (status {status}) could not be read ({err}): {_excerpt(text)}")
            return [CallResult(value=value) for value in values]
        return fail(f"gave up after {self.max_retries + 1} attempts; the last: {last}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= _BODY_EXCERPT else text[:_BODY_EXCERPT] + "...")
