"""The seed's `MyTask` as a plain HTTP function: sleep, report progress, say hello.

It is the proof that the dispatcher contract needs nothing but the standard
library: no AMQP, no SDK, no framework. It reads the CloudEvents binary-mode
headers the dispatcher sends, POSTs progress to `X-Conveyor-Progress-Url`, and
answers with plain JSON. It also carries the knobs the tests and the chaos run
need (`failRate`, `hostile`, `FAIL_FIRST_N_CALLS_PER_TASK`, `CALL_LOG`).

Environment:
    HOST, PORT                     where to listen (default 127.0.0.1:8080)
    CALL_LOG                       append `<ce-id>\\t<attempt>\\t<outcome>` per call
    FAIL_FIRST_N_CALLS_PER_TASK    answer 503 to the first N calls of each task
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PROGRESS_TIMEOUT_S = 2.0
MAX_BODY_BYTES = 1 << 20


class BadRequest(Exception):
    """The body does not describe a sleeper task; answered with 400."""


class CallLog:
    """Counts calls per task and, when CALL_LOG is set, appends one line per call."""

    def __init__(self, path: str | None) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._file = open(path, "a", encoding="utf-8") if path else None

    def count_call(self, task_id: str) -> int:
        with self._lock:
            self._calls[task_id] = self._calls.get(task_id, 0) + 1
            return self._calls[task_id]

    def record(self, task_id: str, attempt: str, outcome: str) -> None:
        if self._file is None:
            return
        with self._lock:
            self._file.write(f"{task_id}\t{attempt}\t{outcome}\n")
            self._file.flush()


CALLS = CallLog(os.environ.get("CALL_LOG"))
FAIL_FIRST_N = int(os.environ.get("FAIL_FIRST_N_CALLS_PER_TASK", "0") or 0)


def parse_task(raw: bytes) -> tuple[float, bool, float]:
    """Returns (sleep seconds, mustSucceed, failRate) or raises BadRequest."""
    try:
        body = json.loads(raw or b"null")
    except ValueError as exc:
        raise BadRequest("invalid JSON") from exc
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    sleep = body.get("sleep")
    if isinstance(sleep, bool) or not isinstance(sleep, int | float) or sleep < 0:
        raise BadRequest("'sleep' must be a number of seconds >= 0")
    must_succeed = body.get("mustSucceed", True)
    if not isinstance(must_succeed, bool):
        raise BadRequest("'mustSucceed' must be a boolean")
    fail_rate = body.get("failRate", 0)
    if isinstance(fail_rate, bool) or not isinstance(fail_rate, int | float):
        raise BadRequest("'failRate' must be a number between 0 and 1")
    if not 0 <= fail_rate <= 1:
        raise BadRequest("'failRate' must be a number between 0 and 1")
    return float(sleep), must_succeed, float(fail_rate)


def _hostile_kind(raw: bytes) -> str | None:
    try:
        body = json.loads(raw or b"null")
    except ValueError:
        return None
    kind = body.get("hostile") if isinstance(body, dict) else None
    return kind if kind in ("nul", "deep", "huge", "trickle") else None


def doomed(task_id: str, fail_rate: float) -> bool:
    """Decides failure from the task id alone, so every attempt decides the same way."""
    digest = int(hashlib.sha256(task_id.encode()).hexdigest(), 16)
    return digest % 1000 < fail_rate * 1000


def post_progress(url: str, value: float) -> None:
    """Best effort: a lost progress report must never fail the task."""
    data = json.dumps({"progress": round(value, 2)}).encode()
    request = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=PROGRESS_TIMEOUT_S) as answer:
            answer.read()
    except (OSError, ValueError):
        pass


def peer_gone(sock: socket.socket) -> bool:
    """True when the caller closed the connection (e.g. the dispatcher aborted the call)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "conveyor-sleeper/1"

    def handle(self) -> None:
        """A caller that went away (a call cut at its deadline) ends its connection quietly:
        http.server would print a traceback for each such call."""
        try:
            super().handle()
        except ConnectionError:
            self.close_connection = True

    def do_GET(self) -> None:
        if self.path in ("/healthz", "/readyz"):
            self.answer(200, {"status": "ok"})
        else:
            self.answer(404, {"errorMessage": "not found"})

    def do_POST(self) -> None:
        task_id = self.headers.get("ce-id") or self.headers.get("X-Conveyor-Task-Id") or "-"
        attempt = self.headers.get("X-Conveyor-Attempt") or "-"
        raw = self.read_body()
        print(f"call ce-id={task_id} attempt={attempt}", flush=True)
        hostile = _hostile_kind(raw)
        if hostile:
            CALLS.record(task_id, attempt, f"hostile-{hostile}")
            self.hostile(hostile)
            return
        if CALLS.count_call(task_id) <= FAIL_FIRST_N:
            self.finish_call(task_id, attempt, "unavailable", 503, {"errorMessage": "warming up"})
            return
        try:
            sleep, must_succeed, fail_rate = parse_task(raw)
        except BadRequest as exc:
            self.finish_call(task_id, attempt, "invalid", 400, {"errorMessage": str(exc)})
            return
        if not must_succeed:
            self.finish_call(task_id, attempt, "failure", 422, {"errorMessage": "Argh!"})
            return
        if not self.work(sleep, self.headers.get("X-Conveyor-Progress-Url")):
            CALLS.record(task_id, attempt, "aborted")
            self.close_connection = True
            return
        if doomed(task_id, fail_rate):
            self.finish_call(task_id, attempt, "failure", 422, {"errorMessage": "Argh!"})
            return
        self.finish_call(task_id, attempt, "success", 200, {"hello": "world"})

    def work(self, sleep: float, progress_url: str | None) -> bool:
        """Sleeps, reporting progress each second; False if the caller went away."""
        start = time.monotonic()
        second = 0
        while (elapsed := time.monotonic() - start) < sleep:
            if peer_gone(self.connection):
                return False
            time.sleep(min(1.0 - (elapsed % 1.0), sleep - elapsed))
            done = int(time.monotonic() - start)
            if done > second and done < sleep:
                second = done
                if progress_url:
                    post_progress(progress_url, 100 * second / sleep)
        return True

    def hostile(self, kind: str) -> None:
        """Answers a platform must survive: a NUL byte, JSON 100,000 deep, 16 MiB, or a body
        trickled a byte a second until the caller gives up."""
        body = {
            "nul": b"text with a \x00 in it",
            "deep": b"[" * 100_000 + b"]" * 100_000,
            "huge": b'"' + b"x" * (16 << 20) + b'"',
        }.get(kind, b'{"slow": true}' + b" " * 3600)
        content_type = "text/plain" if kind == "nul" else "application/json"
        try:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if kind != "trickle":
                self.wfile.write(body)
                return
            for i in range(len(body)):
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                time.sleep(1.0)
        except OSError:
            self.close_connection = True  # the caller hung up, as it should

    def read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(min(length, MAX_BODY_BYTES)) if length else b""

    def finish_call(
        self, task_id: str, attempt: str, outcome: str, status: int, payload: dict[str, Any]
    ) -> None:
        CALLS.record(task_id, attempt, outcome)
        self.answer(status, payload)

    def answer(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Silences the per-request access log: `do_POST` logs its own line."""


def serve(host: str, port: int) -> None:
    """Serves until SIGTERM or SIGINT, then stops accepting and returns."""
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()
    print(f"sleeper listening on http://{host}:{server.server_port}/", flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()
    server.server_close()
    print("sleeper stopped", flush=True)


if __name__ == "__main__":
    serve(os.environ.get("HOST", "127.0.0.1"), int(os.environ.get("PORT", "8080")))
    sys.exit(0)
