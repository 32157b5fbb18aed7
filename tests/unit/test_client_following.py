"""`follow`/`wait`/`watch` against a real local HTTP server that stalls, stays quiet, or is
unavailable (503 + Retry-After, a proxy's 502): timeouts are real socket timeouts here.

Elapsed times are only checked against generous upper bounds (the deadline plus 2 s)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

import conveyor.client as sdk
from conveyor.cli import task as task_cli
from conveyor.client import AsyncConveyorClient, ConveyorClient, ConveyorError, TaskWaitTimeout

TASK_ID = "089373b8-1691-4462-8f78-25e3af1a1c6b"
PENDING = {"taskId": TASK_ID, "status": "PENDING", "progress": 0.0}
SUCCESS = {"taskId": TASK_ID, "status": "SUCCESS", "progress": 100.0, "response": {}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Gateway

    def do_GET(self) -> None:
        self.server.requests.append(self.path.rsplit("/", 1)[-1])
        self.server.script(self)

    do_POST = do_GET

    def log_message(self, *args: Any) -> None:
        pass

    # What a script can answer with:

    def stall(self) -> None:
        """Reads the request, never answers (until the test ends)."""
        self.server.released.wait(60)
        self.close_connection = True

    def envelope(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        self.raw(status, "application/json", json.dumps(body).encode(), headers)

    def raw(
        self,
        status: int,
        content_type: str,
        body: bytes,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def stream(self, parts: list[str | float]) -> None:
        """An event stream: each str is written as is, each float is a pause; then the end."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for part in parts:
                if isinstance(part, float):
                    if self.server.released.wait(part):
                        return
                else:
                    self.wfile.write(part.encode())
                    self.wfile.flush()
        except OSError:
            pass


def event(data: dict[str, Any]) -> str:
    return f"event: task\ndata: {json.dumps(data)}\n\n"


class Gateway(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, script: Callable[[Handler], None]) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.script = script
        self.requests: list[str] = []  # the last segment of each request's path
        self.released = threading.Event()
        self.started = time.monotonic()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def since(self) -> float:
        return time.monotonic() - self.started


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[Handler], None]], Gateway]]:
    servers: list[Gateway] = []

    def start(script: Callable[[Handler], None]) -> Gateway:
        servers.append(Gateway(script))
        return servers[-1]

    yield start
    for server in servers:
        server.released.set()
        server.shutdown()
        server.server_close()


def wait_with(flavour: str, url: str, client_timeout: float, **kwargs: Any) -> Any:
    """`wait` in either flavour, the client's own timeout being `client_timeout`."""
    if flavour == "sync":
        with ConveyorClient(url, "u", "p", timeout=client_timeout) as client:
            return client.wait("sleeper", TASK_ID, **kwargs)

    async def run() -> Any:
        async with AsyncConveyorClient(url, "u", "p", timeout=client_timeout) as client:
            return await client.wait("sleeper", TASK_ID, **kwargs)

    return asyncio.run(run())


def follow_with(flavour: str, url: str, client_timeout: float, **kwargs: Any) -> list[str]:
    if flavour == "sync":
        with ConveyorClient(url, "u", "p", timeout=client_timeout) as client:
            return [t.status for t in client.follow("sleeper", TASK_ID, **kwargs)]

    async def run() -> list[str]:
        async with AsyncConveyorClient(url, "u", "p", timeout=client_timeout) as client:
            return [t.status async for t in client.follow("sleeper", TASK_ID, **kwargs)]

    return asyncio.run(run())


FLAVOURS = pytest.mark.parametrize("flavour", ["sync", "async"])


# --- 1. the deadline holds while the gateway stalls --------------------------------------


@FLAVOURS
def test_wait_ends_at_its_deadline_when_the_gateway_never_answers(serve: Any, flavour: str) -> None:
    """No state was ever seen: the transport error may stay, but it comes at the deadline
    (it came after two of the client's request timeouts: the stream's, then a poll's)."""
    gateway = serve(Handler.stall)
    began = time.monotonic()
    with pytest.raises((TaskWaitTimeout, httpx.TransportError)):
        wait_with(flavour, gateway.url, client_timeout=4, timeout=1.0)
    assert time.monotonic() - began < 1.0 + 2


@FLAVOURS
def test_wait_raises_task_wait_timeout_at_its_deadline_when_a_poll_stalls(
    serve: Any, flavour: str
) -> None:
    """The stream gives a state and ends; the polls that follow stall."""

    def script(h: Handler) -> None:
        if h.path.endswith("/events"):
            h.stream([event(PENDING)])
        else:
            h.stall()

    gateway = serve(script)
    began = time.monotonic()
    with pytest.raises(TaskWaitTimeout) as raised:
        wait_with(flavour, gateway.url, client_timeout=6, timeout=1.5)
    assert time.monotonic() - began < 1.5 + 2
    assert raised.value.task.status == "PENDING"


def test_cli_watch_ends_at_its_timeout_when_the_gateway_never_answers(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway = serve(Handler.stall)
    monkeypatch.setattr(task_cli, "ConveyorClient", partial(ConveyorClient, timeout=4))
    args = ["watch", "sleeper", TASK_ID, "--timeout", "1", "--gateway", gateway.url]
    began = time.monotonic()
    result = CliRunner().invoke(task_cli.app, [*args, "--client-id", "u", "--client-secret", "p"])

    assert time.monotonic() - began < 1 + 2
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)


# --- 2. a quiet stream is kept ------------------------------------------------------------


@FLAVOURS
def test_a_stream_quieter_than_the_clients_timeout_is_kept(serve: Any, flavour: str) -> None:
    """The stream's comments come every 1.5 s, above the client's 1 s timeout (as the
    gateway's 15 s heartbeat is above the SDK's 10 s default): the SDK keeps reading it,
    and never polls."""

    def script(h: Handler) -> None:
        if h.path.endswith("/events"):
            h.stream([event(PENDING), 1.5, ": ping\n\n", 1.5, ": ping\n\n", 1.0, event(SUCCESS)])
        else:
            h.envelope(200, {"status": "success", "data": PENDING})

    gateway = serve(script)
    seen = follow_with(flavour, gateway.url, client_timeout=1.0, timeout=15, interval=0.2)

    assert seen == ["PENDING", "SUCCESS"]
    assert gateway.requests == ["events"]


def timed_follow(flavour: str, url: str) -> list[tuple[str, float]]:
    """Each state `follow` yields, with the seconds since the call when it came."""
    began = time.monotonic()
    if flavour == "sync":
        with ConveyorClient(url, "u", "p", timeout=5) as client:
            return [
                (t.status, time.monotonic() - began)
                for t in client.follow("sleeper", TASK_ID, timeout=15)
            ]

    async def run() -> list[tuple[str, float]]:
        async with AsyncConveyorClient(url, "u", "p", timeout=5) as client:
            return [
                (t.status, time.monotonic() - began)
                async for t in client.follow("sleeper", TASK_ID, timeout=15)
            ]

    return asyncio.run(run())


@FLAVOURS
@pytest.mark.parametrize("end", ["\r", "\n", "\r\n"], ids=["CR", "LF", "CRLF"])
def test_an_event_is_read_the_moment_its_blank_line_arrives_whatever_its_line_ends(
    serve: Any, flavour: str, end: str
) -> None:
    """Found by a review: an event whose lines end in a lone CR (the event stream format
    allows CR, LF and CRLF) waited for the stream's next bytes, here 2 s; and a stream that
    began with a byte order mark lost its first event (its first field read "\ufeffevent").
    The CRLF case also cuts between the CR and its LF."""

    def script(h: Handler) -> None:
        if h.path.endswith("/events"):
            first = event(PENDING).replace("\n", end)
            second = event(SUCCESS).replace("\n", end)
            if end == "\r\n":
                h.stream(["\ufeff" + first[:-1], 0.2, first[-1:], 2.0, second])
            else:
                h.stream(["\ufeff" + first, 2.0, second])
        else:
            h.envelope(200, {"status": "success", "data": PENDING})

    gateway = serve(script)
    seen = timed_follow(flavour, gateway.url)

    assert [status for status, _ in seen] == ["PENDING", "SUCCESS"]
    assert seen[0][1] < 1.5, seen  # before the next bytes, 2 s later (2.2 s with CRLF)
    assert gateway.requests == ["events"]  # never fell back to polling


# --- 3. 502/503/504 are ridden out like an unreachable gateway -----------------------------

UNAVAILABLE = {
    "503 envelope": (
        503,
        "application/json",
        b'{"status":"error","error":{"number":503001,"description":"Service temporarily'
        b' unavailable."}}',
        {"Retry-After": "1"},
    ),
    "502 from a proxy": (502, "text/html", b"<html>502 Bad Gateway</html>", {}),
    "504 from a proxy": (504, "text/plain", b"Gateway Timeout", {}),
}


@FLAVOURS
@pytest.mark.parametrize("answer", UNAVAILABLE.values(), ids=UNAVAILABLE.keys())
def test_follow_rides_out_an_unavailable_gateway(
    serve: Any, flavour: str, answer: tuple[int, str, bytes, dict[str, str]]
) -> None:
    """Unavailable for 2 s from the start, then the task has ended."""

    def script(h: Handler) -> None:
        if h.server.since() < 2.0:
            h.raw(*answer)
        elif h.path.endswith("/events"):
            h.stream([event(SUCCESS)])
        else:
            h.envelope(200, {"status": "success", "data": SUCCESS})

    gateway = serve(script)
    seen = follow_with(flavour, gateway.url, client_timeout=5, timeout=15, interval=0.2)

    assert seen == ["SUCCESS"]
    if answer[3].get("Retry-After") == "1":  # one pause of 1 s, not ten of `interval`
        assert gateway.requests.count("events") + gateway.requests.count(TASK_ID) <= 5


@FLAVOURS
def test_an_outage_after_a_state_was_seen_ends_in_task_wait_timeout(
    serve: Any, flavour: str
) -> None:
    """A Retry-After longer than the time left is cut to the deadline."""

    def script(h: Handler) -> None:
        if h.path.endswith("/events"):
            h.stream([event(PENDING)])
        else:
            h.raw(503, "application/json", UNAVAILABLE["503 envelope"][2], {"Retry-After": "30"})

    gateway = serve(script)
    began = time.monotonic()
    with pytest.raises(TaskWaitTimeout) as raised:
        wait_with(flavour, gateway.url, client_timeout=5, timeout=1.5, interval=0.05)
    assert time.monotonic() - began < 1.5 + 2
    assert raised.value.task.status == "PENDING"


@FLAVOURS
def test_an_outage_longer_than_the_window_raises_its_error(
    serve: Any, flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sdk, "OUTAGE_WINDOW_S", 1.0)
    gateway = serve(lambda h: h.raw(*UNAVAILABLE["503 envelope"]))
    began = time.monotonic()
    with pytest.raises(ConveyorError) as raised:
        wait_with(flavour, gateway.url, client_timeout=5, interval=0.05)
    assert time.monotonic() - began < 1.0 + 1 + 2  # the window, then one Retry-After at most
    assert (raised.value.http_status, raised.value.number) == (503, 503001)
    assert len(gateway.requests) >= 2
