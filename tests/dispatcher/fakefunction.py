"""A configurable HTTP function for the dispatcher's tests (stdlib only).

    python -m tests.dispatcher.fakefunction --port 8080 --log calls.jsonl [--start-delay 2]

Each task's body says how the function behaves for it, so one process serves
every scenario of a test:

    {"statuses": [503, 200],        # answer per call of this ce-id (last one repeats)
     "retryAfter": "1",             # Retry-After header on non-2xx answers (sent as UTF-8)
     "error": {...} | "text",       # body of non-2xx answers
     "sleep": 2.5,                  # seconds before answering ...
     "sleepOnAttempts": [1],        # ... only for these X-Conveyor-Attempt values
     "progress": [10, 50],          # POSTed to X-Conveyor-Progress-Url first
     "progressPause": 0.1,
     "response": {...},             # 2xx JSON body (default: {"echo": <body>})
     "rawResponse": "text",         # 2xx raw body instead
     "hostile": "deep" | "trickle" | "huge" | "crowded" | "twice" | "garbage" | "latin1-location"
                | "cut-headers" | "bad-gzip",
     "status": 400,                 # with "bad-gzip": the status of that answer
     "size": 1000000}               # bytes of a huge answer

Every call is logged twice to the JSON-lines file: `"phase": "start"` with its
headers and body when it arrives, `"phase": "end"` with the answer (and the
progress endpoint's answers) when it is sent.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class Journal:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}

    def next_call(self, task_id: str) -> int:
        with self._lock:
            self._calls[task_id] = self._calls.get(task_id, 0) + 1
            return self._calls[task_id]

    def write(self, entry: dict[str, Any]) -> None:
        line = json.dumps({"time": time.time(), **entry}) + "\n"
        with self._lock, self._path.open("a") as out:
            out.write(line)


def post_progress(url: str, value: Any) -> int:
    request = urllib.request.Request(
        url,
        data=json.dumps({"progress": value}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return -1


class Handler(BaseHTTPRequestHandler):
    journal: Journal
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._answer(200, b'{"ok": true}', {})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        spec = body if isinstance(body, dict) else {}
        task_id = headers.get("ce-id", "")
        call = self.journal.next_call(task_id)
        self.journal.write(
            {"phase": "start", "id": task_id, "call": call, "headers": headers, "body": body}
        )

        attempt = int(headers.get("x-conveyor-attempt", "0") or 0)
        if spec.get("sleep") and attempt in spec.get("sleepOnAttempts", [attempt]):
            time.sleep(float(spec["sleep"]))
        progress_answers = []
        for value in spec.get("progress", []):
            progress_answers.append(post_progress(headers["x-conveyor-progress-url"], value))
            time.sleep(float(spec.get("progressPause", 0)))

        if spec.get("hostile"):
            self.journal.write({"phase": "end", "id": task_id, "call": call, "status": 200})
            self._hostile(spec)
            return
        statuses = spec.get("statuses") or [200]
        status = int(statuses[min(call, len(statuses)) - 1])
        extra: dict[str, str] = {}
        if 200 <= status < 300:
            if "rawResponse" in spec:
                payload = str(spec["rawResponse"]).encode()
            else:
                payload = json.dumps(spec.get("response", {"echo": body})).encode()
        else:
            error = spec.get("error", {"errorMessage": "failed on purpose"})
            payload = error.encode() if isinstance(error, str) else json.dumps(error).encode()
            if "retryAfter" in spec:
                # http.server writes headers as latin-1: these bytes are the value's UTF-8.
                extra["Retry-After"] = str(spec["retryAfter"]).encode().decode("latin-1")
        self.journal.write(
            {
                "phase": "end",
                "id": task_id,
                "call": call,
                "status": status,
                "progress": progress_answers,
            }
        )
        self._answer(status, payload, extra)

    def _hostile(self, spec: dict[str, Any]) -> None:
        """Answers no dispatcher should trust: 100,000-deep JSON, a body trickled one byte
        a second, a body of `size` bytes, (crowded) an array of `count` empty objects, (twice) a second, stray answer written on the
        idle keep-alive connection 50 ms after the real one, logged as `"phase": "stray"`,
        (garbage) a status line that is not HTTP, (latin1-location) a 302 whose Location
        header holds bytes that are not UTF-8, (cut-headers) a connection closed in the
        middle of the answer's headers, or (bad-gzip) an answer of `status` whose body says
        `Content-Encoding: gzip` and is not."""
        kind = spec["hostile"]
        try:
            if kind == "deep":
                self._answer(200, b"[" * 100_000 + b"]" * 100_000, {})
            elif kind == "crowded":  # `count` empty objects: cheap bytes, dear once read
                self._answer(200, b"[" + b"{}," * (int(spec["count"]) - 1) + b"{}]", {})
            elif kind == "huge":
                self._answer(200, b'"' + b"x" * int(spec.get("size", 1_000_000)) + b'"', {})
            elif kind == "garbage":
                self.wfile.write(b"hello there\r\n\r\n")
                self.close_connection = True
            elif kind == "latin1-location":  # a redirect whose Location is not UTF-8
                self.wfile.write(
                    b"HTTP/1.1 302 Found\r\nLocation: http://x/caf\xe9\xff\r\n"
                    b"Content-Length: 0\r\n\r\n"
                )
            elif kind == "bad-gzip":
                status = int(spec.get("status", 400))
                self._answer(status, b"not gzip at all", {"Content-Encoding": "gzip"})
            elif kind == "cut-headers":
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Le")
                self.close_connection = True
            elif kind == "twice":
                self._answer(200, json.dumps({"answered": self.headers["ce-id"]}).encode(), {})
                self.wfile.flush()
                time.sleep(0.05)  # after the dispatcher has put the connection back
                self._answer(200, b'{"stray": "an answer to no request"}', {})
                self.wfile.flush()
                self.journal.write({"phase": "stray", "id": self.headers["ce-id"]})
            elif kind == "trickle":
                payload = b'{"slow": "' + b"x" * 120 + b'"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                for byte in payload:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(1.0)
        except OSError:
            self.journal.write({"phase": "disconnected", "id": self.headers.get("ce-id", "")})

    def _answer(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            pass  # the dispatcher gave up on this call (abort on shutdown)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--start-delay", type=float, default=0.0)
    args = parser.parse_args()
    time.sleep(args.start_delay)  # a function that is slow to start
    Handler.journal = Journal(args.log)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"listening on {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
