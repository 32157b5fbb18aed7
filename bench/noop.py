"""The no-op HTTP function every peer calls: answers `{}` and notes when each task arrived.

The same process serves Conveyor's dispatcher, Celery's workers and the bare
aio-pika consumer, so the function costs every peer the same. It is kept as
cheap as possible (an asyncio protocol with uvloop when installed, HTTP/1.1
keep-alive, no framework) so that the benchmarks measure the platforms and not
the function.

    POST <any path>      200 `{}`; the arrival time (time.time()) is recorded
                         under the task id: `ce-id`, else `x-task-id` header
    GET  /healthz        200
    GET  /stats          {"count", "first", "last"}: calls and their times
    GET  /arrivals       {taskId: time} of every recorded call
    DELETE /arrivals     forgets them

    python -m bench.noop --port 8080
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from typing import Any

_OK = b"{}"
_MAX_HEAD = 64 * 1024


class State:
    def __init__(self) -> None:
        self.arrivals: dict[str, float] = {}
        self.count = 0
        self.first: float | None = None
        self.last: float | None = None

    def record(self, task_id: str | None) -> None:
        now = time.time()
        self.count += 1
        if self.first is None:
            self.first = now
        self.last = now
        if task_id:
            self.arrivals.setdefault(task_id, now)

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


STATE = State()


def _response(status: int, body: bytes, close: bool = False) -> bytes:
    reason = {200: "OK", 204: "No Content", 404: "Not Found", 411: "Length Required"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"{'Connection: close' if close else 'Connection: keep-alive'}\r\n\r\n"
    )
    return head.encode() + body


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return method, path, headers


def _route(method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    if method == "POST":
        STATE.record(headers.get("ce-id") or headers.get("x-task-id"))
        return 200, _OK
    if path == "/healthz":
        return 200, _OK
    if path == "/stats":
        stats = {"count": STATE.count, "first": STATE.first, "last": STATE.last}
        return 200, json.dumps(stats).encode()
    if path == "/arrivals":
        if method == "DELETE":
            STATE.reset()
            return 200, _OK
        return 200, json.dumps(STATE.arrivals).encode()
    return 404, _OK


class HttpProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive; bodies are read (Content-Length) and ignored."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None and self._one_request():
            pass

    def _one_request(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > _MAX_HEAD:
                self._close()
            return False
        try:
            method, path, headers = _parse_head(bytes(self.buffer[:end]))
        except ValueError:
            self._close()
            return False
        if "chunked" in headers.get("transfer-encoding", ""):
            self._reply(411, _OK, close=True)
            return False
        length = int(headers.get("content-length") or 0)
        if len(self.buffer) < end + 4 + length:
            return False
        del self.buffer[: end + 4 + length]
        status, body = _route(method, path, headers)
        self._reply(status, body, close=headers.get("connection", "").lower() == "close")
        return True

    def _reply(self, status: int, body: bytes, close: bool) -> None:
        assert self.transport is not None
        self.transport.write(_response(status, body, close))
        if close:
            self._close()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(HttpProtocol, host, port, backlog=1024)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"no-op function on http://{host}:{port}/", flush=True)
    async with server:
        await stop.wait()


def run(coro: Any) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
