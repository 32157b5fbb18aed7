"""Fixtures for the example functions: run one as a real process on a free port,
and stand in for the dispatcher's progress endpoint."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.support.processes import Proc, Processes, free_port, wait_http


@dataclass
class RunningFunction:
    proc: Proc
    url: str


@dataclass
class ProgressSink:
    """Records every progress POST, answering 204 like the dispatcher does."""

    url: str = ""
    values: list[float] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    def wait_for(self, count: int, timeout: float = 5.0) -> list[float]:
        deadline = time.monotonic() + timeout
        while len(self.values) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return list(self.values)


StartFunction = Callable[..., RunningFunction]


@pytest.fixture
def start_function(procs: Processes) -> StartFunction:
    """Starts `argv` with PORT set to a free port and waits for its /healthz."""

    def start(name: str, argv: list[str], env: Mapping[str, str] | None = None) -> RunningFunction:
        port = free_port()
        proc = procs.start(name, argv, {"HOST": "127.0.0.1", "PORT": str(port), **(env or {})})
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/healthz", timeout=15, proc=proc)
        return RunningFunction(proc, url)

    return start


@pytest.fixture
def progress_sink() -> Iterator[ProgressSink]:
    sink = ProgressSink()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            payload: dict[str, Any] = json.loads(self.rfile.read(length))
            sink.headers.append(dict(self.headers))
            sink.values.append(payload["progress"])
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    sink.url = f"http://127.0.0.1:{server.server_port}/progress"
    yield sink
    server.shutdown()
    server.server_close()
