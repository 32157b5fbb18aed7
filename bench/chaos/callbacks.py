"""The consumer's callback endpoint: counts the callbacks received per taskId.

An in-process `ThreadingHTTPServer` on 127.0.0.1; the gateway reaches it as
`http://localhost:<port>/hook` (allowed by CONVEYOR_CALLBACK_ALLOWED_HOSTS).
"""

from __future__ import annotations

import json
import threading
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
                receiver.record(self.rfile.read(length))
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                """Silent: thousands of callbacks."""

        return Handler
