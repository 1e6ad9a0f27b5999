"""RemoteSandbox against a local stand-in that answers like Sandbox Fusion's /run_code."""

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hflow.sandbox import RemoteSandbox, SandboxLimits, make_sandbox

pytestmark = pytest.mark.alone  # retries and timeouts measured in wall time

REPO_ROOT = Path(__file__).resolve().parents[2]


def fusion(stdout="", stderr="", return_code=0, run_status="Finished", status=None):
    """A Sandbox Fusion answer."""
    if status is None:
        status = "Success" if run_status == "Finished" and return_code == 0 else "Failed"
    run = {"status": run_status, "execution_time": 0.25, "return_code": return_code, "stdout": stdout, "stderr": stderr}
    return 200, json.dumps({"status": status, "message": "", "compile_result": None, "run_result": run}).encode()


class StandIn:
    """An HTTP server on 127.0.0.1 that gives the queued answers in turn (the last one from then on)."""

    def __init__(self, *answers):
        self.answers = list(answers)  # (http status, body) or (http status, body, delay_s)
        self.requests = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                stand_in.requests.append(json.loads(body))
                answer = stand_in.answers[min(len(stand_in.requests), len(stand_in.answers)) - 1]
                if len(answer) == 3:
                    time.sleep(answer[2])
                try:
                    self.send_response(answer[0])
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer[1])))
                    self.end_headers()
                    self.wfile.write(answer[1])
                except OSError:  # the client gave up first
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/run_code"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def remote(url, **kwargs):
    kwargs = {"limits": SandboxLimits(wall_time_s=3, memory_mb=512), "backoff_s": 0.01, **kwargs}
    return RemoteSandbox(url, **kwargs)


def test_success_and_request_shape():
    with StandIn(fusion(stdout="hi\n")) as server:
        result = remote(server.url).run("print(input())", stdin="hi\n")
    assert (result.status, result.exit_code, result.stdout, result.limit_hit) == ("ok", 0, "hi\n", None)
    assert result.duration_s == 0.25 and result.network_isolated is False
    assert server.requests == [
        {"code": "print(input())", "language": "python", "stdin": "hi\n", "run_timeout": 3, "memory_limit_MB": 512}
    ]


@pytest.mark.parametrize(
    ("answer", "status", "limit"),
    [
        (fusion(stderr="ZeroDivisionError: division by zero", return_code=1), "error", None),
        (fusion(run_status="TimeLimitExceeded", return_code=-9), "limit", "wall_time"),
        (fusion(stderr="MemoryError", return_code=1), "limit", "memory"),
        (fusion(stdout="x" * 5000), "limit", "output"),
    ],
)
def test_run_results_are_mapped(answer, status, limit):
    with StandIn(answer) as server:
        result = remote(server.url, limits=SandboxLimits(max_output_bytes=1000)).run("code")
    assert (result.status, result.limit_hit) == (status, limit)
    assert len(result.stdout) <= 1000


def test_compile_failure_is_an_error():
    answer = {"status": "Failed", "message": "", "run_result": None,
              "compile_result": {"status": "Finished", "return_code": 1, "stdout": "", "stderr": "bad syntax"}}
    with StandIn((200, json.dumps(answer).encode())) as server:
        result = remote(server.url).run("int main(", language="cpp")
    assert (result.status, result.exit_code, result.stderr) == ("error", 1, "bad syntax")
    assert server.requests[0]["language"] == "cpp"


def test_sandbox_error_answers():
    answer = {"status": "SandboxError", "message": "no runner for language", "run_result": None}
    with StandIn((200, json.dumps(answer).encode())) as server:
        result = remote(server.url).run("x")
    assert result.status == "sandbox_error" and "no runner for language" in result.stderr
    answer = {"status": "Failed", "message": "", "run_result": {"status": "Error", "stderr": "exec failed"}}
    with StandIn((200, json.dumps(answer).encode())) as server:
        assert remote(server.url).run("x").status == "sandbox_error"


def test_two_server_errors_then_success_is_retried():
    with StandIn((500, b"busy"), (502, b"busy"), fusion(stdout="ok\n")) as server:
        result = remote(server.url, max_retries=3).run("print('ok')")
    assert result.status == "ok" and result.stdout == "ok\n" and len(server.requests) == 3


def test_server_errors_exhaust_retries_in_bounded_time():
    with StandIn((503, b"overloaded")) as server:
        start = time.monotonic()
        result = remote(server.url, max_retries=2, backoff_s=0.05).run("x")
        elapsed = time.monotonic() - start
    assert result.status == "sandbox_error" and len(server.requests) == 3
    assert "HTTP 503" in result.stderr and "overloaded" in result.stderr and "after 3 attempts" in result.stderr
    assert 0.15 <= elapsed < 3  # backoff 0.05 + 0.1


def test_client_error_is_not_retried():
    with StandIn((400, b'{"detail": "bad request"}')) as server:
        result = remote(server.url).run("x")
    assert result.status == "sandbox_error" and "HTTP 400" in result.stderr and len(server.requests) == 1


def test_a_server_slower_than_the_timeout_gives_up_in_bounded_time():
    with StandIn(fusion(stdout="late") + (5,)) as server:
        start = time.monotonic()
        result = remote(server.url, timeout_s=0.3, max_retries=1).run("x")
        elapsed = time.monotonic() - start
    assert result.status == "sandbox_error" and "timeout_s=0.3" in result.stderr
    assert elapsed < 2.5 and len(server.requests) == 2


@pytest.mark.parametrize("body", [b"<html>Bad Gateway</html>" + b"!" * 500, b"[1, 2]", b'{"status": "Success"}'])
def test_malformed_answers_are_sandbox_errors(body):
    with StandIn((200, body)) as server:
        result = remote(server.url).run("x")
    assert result.status == "sandbox_error" and len(server.requests) == 1
    assert body[:20].decode() in result.stderr and len(result.stderr) < 400


def test_connection_refused():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.monotonic()
    result = remote(f"http://127.0.0.1:{port}/run_code", max_retries=2).run("x")
    assert result.status == "sandbox_error" and "unreachable" in result.stderr and "refused" in result.stderr.lower()
    assert time.monotonic() - start < 2


def test_default_timeout_is_wall_time_plus_ten():
    assert remote("http://h/run_code").timeout_s == 13
    assert make_sandbox({"backend": "remote", "url": "http://h/run_code", "timeout_s": 2}).timeout_s == 2


def test_cli_with_url(tmp_path):
    program = tmp_path / "p.py"
    program.write_text("print('hi')")
    with StandIn(fusion(stdout="hi\n")) as server:
        done = subprocess.run(
            [sys.executable, "-m", "hflow.sandbox", str(program), "--url", server.url, "--wall-time-s", "4"],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
        )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stdout"] == "hi\n" and server.requests[0]["run_timeout"] == 4
