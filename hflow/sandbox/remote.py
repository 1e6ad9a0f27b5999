"""`RemoteSandbox`: runs code on a Sandbox Fusion server (its ``/run_code`` request shape), stdlib HTTP only."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from http.client import HTTPException
from typing import Any

from hflow.sandbox.base import Sandbox, SandboxLimits, SandboxResult
from hflow.sandbox.base import classify_ending, decode_output, sandbox_error_result

__all__ = ["RemoteSandbox"]


class _Retryable(Exception):
    """A failure worth another try: the connection, a timeout, or an HTTP 5xx."""


class _Final(Exception):
    """A failure another try would repeat: an HTTP 4xx (the request is wrong), an oversized answer."""


class RemoteSandbox(Sandbox):
    """POSTs each run to `url` (the full endpoint, e.g. ``http://host:8080/run_code``).

    Connection errors, timeouts and HTTP 5xx are retried `max_retries` times with exponential backoff
    (`backoff_s`, doubling); a 4xx is not. A run that still fails returns status "sandbox_error" with
    the last error in stderr: `run` never raises and is bounded by about
    (max_retries + 1) * timeout_s + backoff_s * 2**max_retries. `network_isolated` is False: the server's
    isolation cannot be checked from here.
    """

    def __init__(
        self,
        url: str,
        *,
        limits: SandboxLimits | None = None,
        timeout_s: float | None = None,
        max_retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"sandbox url={url!r}; give the full http(s) endpoint, e.g. http://host:8080/run_code")
        if max_retries < 0 or backoff_s < 0:
            raise ValueError(f"max_retries={max_retries}, backoff_s={backoff_s}; neither may be negative")
        self.url = url
        self.limits = limits or SandboxLimits()
        # The server may take the whole wall time, plus its own start-up and the transfer.
        self.timeout_s = timeout_s if timeout_s is not None else self.limits.wall_time_s + 10.0
        self.max_retries = max_retries
        self.backoff_s = backoff_s

    def run(self, code: str, *, stdin: str = "", language: str = "python") -> SandboxResult:
        start = time.monotonic()
        body = json.dumps(
            {
                "code": code,
                "language": language,
                "stdin": stdin,
                "run_timeout": self.limits.wall_time_s,
                "memory_limit_MB": self.limits.memory_mb,
            }
        ).encode()
        error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                raw = self._post(body)
            except _Retryable as err:
                error = str(err)
                continue
            except _Final as err:
                return sandbox_error_result(str(err), start)
            return self._parse(raw, start)
        return sandbox_error_result(f"{error} (after {self.max_retries + 1} attempts)", start)

    def _post(self, body: bytes) -> bytes:
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        deadline = time.monotonic() + self.timeout_s
        # JSON may escape each output byte into up to 6; anything larger is not a sane answer.
        max_answer = 12 * self.limits.max_output_bytes + 2**20
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = b""
                # timeout_s bounds each socket read; the deadline bounds a server that answers in drips.
                while chunk := response.read(65536):
                    answer += chunk
                    if time.monotonic() > deadline:
                        raise TimeoutError()
                    if len(answer) > max_answer:
                        raise _Final(f"remote sandbox {self.url} answered more than {max_answer} bytes")
                return answer
        except urllib.error.HTTPError as err:
            detail = err.read(200).decode("utf-8", errors="replace")
            message = f"remote sandbox {self.url} answered HTTP {err.code}: {detail}"
            if err.code >= 500:
                raise _Retryable(message) from None
            raise _Final(message) from None
        except (urllib.error.URLError, HTTPException, OSError) as err:  # refused, reset, timed out, DNS
            reason = getattr(err, "reason", err)
            if isinstance(reason, TimeoutError):  # socket.timeout is TimeoutError
                reason = f"no answer within timeout_s={self.timeout_s}"
            raise _Retryable(f"remote sandbox {self.url} unreachable: {reason}") from None

    def _parse(self, raw: bytes, start: float) -> SandboxResult:
        text = raw.decode("utf-8", errors="replace")
        try:
            answer = json.loads(text)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            what = f"something other than a JSON object: {text[:200]!r}"
            return sandbox_error_result(f"remote sandbox {self.url} answered {what}", start)
        if answer.get("status") == "SandboxError":
            return sandbox_error_result(f"remote sandbox error: {answer.get('message') or text[:200]}", start)
        run = answer.get("run_result")
        if not isinstance(run, dict):
            compiled = answer.get("compile_result")
            if isinstance(compiled, dict):  # compilation failed, so nothing ran
                return self._result("error", compiled, None, start)
            return sandbox_error_result(f"remote sandbox answer has no run_result: {text[:200]!r}", start)
        run_status = run.get("status")
        if run_status == "TimeLimitExceeded":
            return self._result("limit", run, "wall_time", start)
        if run_status == "Error":  # the server could not run the command at all
            why = run.get("stderr") or answer.get("message")
            return sandbox_error_result(f"remote sandbox could not run the code: {why}", start)
        exit_code = run.get("return_code")
        limit = classify_ending(exit_code, str(run.get("stderr") or ""))
        if limit is None and self._too_long(run):
            limit = "output"
        status = "limit" if limit else ("ok" if exit_code == 0 else "error")
        return self._result(status, run, limit, start)

    def _too_long(self, run: dict[str, Any]) -> bool:
        return any(len(str(run.get(key) or "").encode()) > self.limits.max_output_bytes for key in ("stdout", "stderr"))

    def _result(self, status: str, run: dict[str, Any], limit: str | None, start: float) -> SandboxResult:
        cap = self.limits.max_output_bytes
        duration = run.get("execution_time")
        return SandboxResult(
            status=status,
            exit_code=run.get("return_code"),
            stdout=decode_output(str(run.get("stdout") or "").encode(), cap),
            stderr=decode_output(str(run.get("stderr") or "").encode(), cap),
            limit_hit=limit,
            duration_s=float(duration) if isinstance(duration, (int, float)) else time.monotonic() - start,
            network_isolated=False,
        )
