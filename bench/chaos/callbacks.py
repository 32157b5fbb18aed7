"""The consumer's callback endpoint: counts the callbacks received per taskId.

An in-process `ThreadingHTTPServer` on 127.0.0.1; the gateway reaches it as
`http://localhost:<port>/hook` (allowed by CONVEYOR_CALLBACK_ALLOWED_HOSTS).
Two hostile endpoints beside it: `/slow` trickles its status line a byte a
second, `/endless` answers 200 and then a body that never ends. Their
callbacks must end (recorded) without delaying anybody else's.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class CallbackReceiver:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.malformed = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://localhost:{self._server.server_port}/hook"

    def url_for(self, hook: str) -> str:
        """`ok`: the well-behaved endpoint; `slow` or `endless`: a hostile one."""
        path = {"ok": "hook", "slow": "slow", "endless": "endless"}[hook]
        return f"http://localhost:{self._server.server_port}/{path}"

    def start(self) -> CallbackReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def record(self, raw: bytes) -> None:
        try:
            data = json.loads(raw)
            task_id, status = str(data["taskId"]), str(data["status"])
        except (ValueError, KeyError, TypeError):
            with self._lock:
                self.malformed += 1
            return
        with self._lock:
            self.counts[task_id] += 1
            self.statuses[status] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if self.path.startswith("/slow"):
                    self._slow()
                    return
                receiver.record(raw)
                if self.path.startswith("/endless"):
                    self._endless()
                    return
                self.send_response(204)
                self.end_headers()

            def _slow(self) -> None:
                try:
                    for byte in b"HTTP/1.1 204 No Content\r\n\r\n":
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(1.0)
                except OSError:
                    pass

            def _endless(self) -> None:
                try:
                    self.send_response(200)
                    self.end_headers()
                    for _ in range(100_000):
                        self.wfile.write(b"x" * 65536)
                except OSError:
                    pass

            def log_message(self, format: str, *args: Any) -> None:
                """Silent: thousands of callbacks."""

        return Handler
