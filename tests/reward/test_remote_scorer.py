"""The remote scorer (custom_reward_function.url) against a scoring server on 127.0.0.1 that is slow, answers
5xx for a while, drops connections, answers 4xx or malformed JSON: every run either scores everything
correctly or stops naming the samples and the server's answer, in bounded time."""

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from omegaconf import OmegaConf

from hflow.reward.managers import NaiveRewardManager, RemoteScorer, RewardFunctionError, load_reward_manager
from hflow.reward.managers.remote import ITEM_KEYS
from tests.reward.test_reward_manager import _config, make_batch, tokenizer  # noqa: F401


def _calls(n):
    return [{"data_source": "src", "solution_str": f"answer {i % 3}", "ground_truth": "0", "extra_info": {"i": i},
             "unused_kwarg": 1} for i in range(n)]


class _Handler(BaseHTTPRequestHandler):
    """Answers by `server.script`: a list of behaviours, one per request (the last repeats); "flaky" answers
    503 to every fifth request and is "ok" otherwise."""

    def do_POST(self):  # noqa: N802
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.bodies.append(body)
            behaviour = server.script[min(len(server.bodies) - 1, len(server.script) - 1)]
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
            self._answer(behaviour, body)
        finally:
            with server.lock:
                server.in_flight -= 1

    def _answer(self, behaviour, body):
        if behaviour == "flaky":
            behaviour = "status503" if len(self.server.bodies) % 5 == 0 else "ok"
        if behaviour == "drop":  # close the connection without an answer
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if behaviour == "slow":
            time.sleep(1.0)
        if behaviour.startswith("status"):
            self._send(int(behaviour[6:]), b"<html>upstream scorer unavailable</html>")
            return
        if behaviour == "malformed":
            self._send(200, b'{"scores": [1.0, 0.0')
            return
        items = body.get("items") or body.get("inputs")
        scores = [{"score": self.server.score(item), "len": len(item["solution_str"])} for item in items]
        if behaviour == "nested":
            self._send(200, json.dumps({"result": {"rewards": [s["score"] for s in scores]}}).encode())
            return
        if behaviour == "pause":
            time.sleep(0.2)
        self._send(200, json.dumps({"scores": scores}).encode())

    def _send(self, status, payload):
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client that gave up on a slow answer closes the socket the handler then writes to


def start_server(script, score=lambda item: float(item["solution_str"].endswith(item["ground_truth"]))):
    """A scoring server on 127.0.0.1 answering by `script` (see `_Handler`) with `score` per item; `.url`,
    `.bodies` (the requests), `.max_in_flight`; stop it with `shutdown()` and `server_close()`."""
    srv = _QuietServer(("127.0.0.1", 0), _Handler)
    srv.script, srv.score, srv.bodies, srv.lock, srv.in_flight, srv.max_in_flight = (
        script, score, [], threading.Lock(), 0, 0)
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/score"
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv


@pytest.fixture
def server():
    """A scoring server; set `.script` before use."""
    srv = start_server(["ok"])
    yield srv
    srv.shutdown()
    srv.server_close()


def _scorer(server, **kwargs):
    return RemoteScorer(server.url, **{"backoff_s": 0.01, "request_timeout_s": 5, **kwargs})


def _timed(scorer, calls, limit_s=20.0):
    """The outcomes and the seconds they took; fails (rather than hangs) when the scorer has not returned
    within `limit_s`."""
    done = []
    start = time.monotonic()
    worker = threading.Thread(target=lambda: done.append(scorer.score(calls)), daemon=True)
    worker.start()
    worker.join(limit_s)
    assert done, f"the scorer did not return within {limit_s} s"
    return done[0], time.monotonic() - start


def test_batches_concurrency_and_the_protocol(server):
    server.script = ["pause"]
    outcomes, _ = _timed(_scorer(server, batch_size=3, max_concurrency=2, reward_kwargs={"k": 1}), _calls(10))
    assert [o.value["score"] for o in outcomes] == [1.0 if i % 3 == 0 else 0.0 for i in range(10)]
    assert sorted(len(body["items"]) for body in server.bodies) == [1, 3, 3, 3]
    assert server.max_in_flight == 2
    assert all(set(item) == set(ITEM_KEYS) for body in server.bodies for item in body["items"])
    assert server.bodies[0]["reward_kwargs"] == {"k": 1}


def test_5xx_and_dropped_connections_are_retried_until_it_scores(server):
    server.script = ["status500", "drop", "status503", "ok"]
    outcomes, took = _timed(_scorer(server, max_retries=3), _calls(4))
    assert all(o.ok for o in outcomes) and [o.value["score"] for o in outcomes] == [1.0, 0.0, 0.0, 1.0]
    assert len(server.bodies) == 4 and took < 5


@pytest.mark.parametrize("script,attempts,named", [
    (["status500"], 3, r"gave up after 3 attempts; the last: the server answered 500: '<html>upstream scorer"),
    (["drop"], 3, r"gave up after 3 attempts; the last: ServerDisconnectedError"),
    (["slow"], 3, r"gave up after 3 attempts; the last: no answer within request_timeout_s=0.3"),
    (["status400"], 1, r"the server answered 400 \(not retried\): '<html>upstream scorer unavailable</html>'"),
    (["malformed"], 1, r"the server's answer \(status 200\) could not be read .*'\{\"scores\": \[1.0, 0.0'"),
    (["nested"], 1, r'could not be read \(expected an object with a "scores" list\)'),
])
def test_failures_name_the_samples_and_the_answer_in_bounded_time(server, script, attempts, named):
    server.script = script
    outcomes, took = _timed(_scorer(server, max_retries=2, request_timeout_s=0.3, batch_size=8), _calls(4))
    assert len(server.bodies) == attempts
    assert all(not o.ok for o in outcomes)
    assert f"POST {server.url} (samples 0-3)" in outcomes[0].error
    assert re.search(named, outcomes[0].error), outcomes[0].error
    assert took < 3 * 0.3 + 2  # three attempts of 0.3 s at most, and the backoff


def test_the_manager_stops_or_scores_zero_by_on_error(tokenizer, server):
    samples = [("What is 2 + 3?", "Answer: 5", "hflow/arithmetic", "5")] * 4
    server.script = ["ok", "status404"]  # the second request (samples 2-3) is refused
    config = _config(**{"custom_reward_function.url": server.url, "custom_reward_function.batch_size": 2,
                        "custom_reward_function.max_concurrency": 1})
    with pytest.raises(RewardFunctionError, match=r"sample 2 \(data_source='hflow/arithmetic'\).*samples 2-3.*404"):
        load_reward_manager(config, tokenizer, num_examine=0)(make_batch(tokenizer, samples))
    server.bodies.clear()
    OmegaConf.update(config, "custom_reward_function.on_error", "zero")
    out = load_reward_manager(config, tokenizer, num_examine=0)(make_batch(tokenizer, samples), return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert out["reward_metrics"]["reward/errors"] == 2 and out["reward_extra_info"]["len"][:2] == [9, 9]


def test_a_subclass_speaks_another_protocol(tokenizer, server):
    class Nested(RemoteScorer):
        def build_request(self, items):
            return {"inputs": items}

        def parse_response(self, body, num_items):
            return body["result"]["rewards"]

    server.script = ["nested"]
    manager = NaiveRewardManager(tokenizer, 0, remote=Nested(server.url))
    scores = manager(make_batch(tokenizer, [("What is 2 + 3?", "Answer: 5", "hflow/arithmetic", "5")]))
    assert scores.sum().item() == 1.0 and "inputs" in server.bodies[0]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="http:// or https://"):
        RemoteScorer("127.0.0.1:8000")
    with pytest.raises(ValueError, match="batch_size=0"):
        RemoteScorer("http://127.0.0.1:1", batch_size=0)
    with pytest.raises(ValueError, match="either .path"):
        NaiveRewardManager(None, 0, compute_score=len, remote=RemoteScorer("http://127.0.0.1:1"))
