"""The SDK and `conveyor task` against a hostile gateway (a real local HTTP server): one that
trickles its answers a byte at a time, sends huge or undecodable bodies, declares codecs that are
not text encodings, answers for another task, or is down while `interval` is 0.

Each call must end by its bound (elapsed times are checked against generous upper bounds, the
bound plus 2 s), read a bounded amount, and fail as ConveyorError or an httpx.TransportError
(the CLI: one line, exit 1), never hang, grow without end, or raise something else."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
import tracemalloc
import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from conveyor.cli import task as task_cli
from conveyor.client import AsyncConveyorClient, ConveyorClient, ConveyorError, TaskWaitTimeout
from tests.support.processes import free_port
from tests.unit import test_client_following as following
from tests.unit.test_client_following import (
    PENDING,
    SUCCESS,
    TASK_ID,
    Handler,
    event,
    follow_with,
    wait_with,
)

serve = following.serve  # the fixture: serve(script) starts a Gateway

FLAVOURS = pytest.mark.parametrize("flavour", ["sync", "async"])
OTHER_ID = "0f1b3c52-7d0e-4a57-9d54-1b2f7a3c9e10"


Script = Callable[[Handler], None]


def routed(events: Script, polls: Script) -> Script:
    """A gateway's script: `events` answers the event stream, `polls` every other request."""
    return lambda h: events(h) if h.path.endswith("/events") else polls(h)


def success(data: dict[str, Any]) -> bytes:
    return json.dumps({"status": "success", "data": data}).encode()


def trickle(h: Handler, data: bytes, pause: float = 0.5) -> None:
    """Writes `data` one byte every `pause` seconds (until the test ends)."""
    h.close_connection = True
    try:
        for byte in data:
            h.wfile.write(bytes([byte]))
            h.wfile.flush()
            if h.server.released.wait(pause):
                return
    except OSError:
        pass


def trickled_body(h: Handler, body: bytes, pause: float = 0.5) -> None:
    """Status line and headers at once, then the body a byte every `pause` seconds."""
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    trickle(h, body, pause)


def pending_stream(h: Handler) -> None:
    """The task PENDING, then the stream's end."""
    h.stream([event(PENDING)])


def trickled_poll(h: Handler) -> None:
    trickled_body(h, success(PENDING))


def trickled_head(h: Handler) -> None:
    """The status line and headers themselves a byte at a time."""
    trickle(h, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")


def call_with(flavour: str, url: str, method: str, client_timeout: float = 5.0) -> Any:
    """`get`, `submit` or `cancel` in either flavour."""
    args: tuple[Any, ...] = ("sleeper", {}) if method == "submit" else ("sleeper", TASK_ID)
    if flavour == "sync":
        with ConveyorClient(url, "u", "p", timeout=client_timeout) as client:
            return getattr(client, method)(*args)

    async def run() -> Any:
        async with AsyncConveyorClient(url, "u", "p", timeout=client_timeout) as client:
            return await getattr(client, method)(*args)

    return asyncio.run(run())


def cli(url: str, *args: str, client_timeout: float = 5.0) -> Any:
    """`conveyor task ...` against `url`; the client's timeout set to `client_timeout`."""
    fake = partial(ConveyorClient, timeout=client_timeout)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(task_cli, "ConveyorClient", fake)
        full = [*args, "--gateway", url, "--client-id", "u", "--client-secret", "p"]
        return CliRunner().invoke(task_cli.app, full)


def error_lines(result: Any, code: int = 1) -> list[str]:
    """The CLI's lines on stderr; fails on a traceback, another exception or another exit."""
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return [line for line in result.stderr.splitlines() if line.strip()]


def one_error_line(result: Any) -> str:
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr
    return lines[0]


# --- 1. a trickled answer does not outlive the deadline, nor a call its bound ----------------


@FLAVOURS
def test_wait_ends_at_its_deadline_when_the_polls_trickle(serve: Any, flavour: str) -> None:
    gateway = serve(routed(pending_stream, trickled_poll))
    began = time.monotonic()
    with pytest.raises(TaskWaitTimeout):
        wait_with(flavour, gateway.url, client_timeout=5, timeout=1.5)
    assert time.monotonic() - began < 1.5 + 2


@FLAVOURS
def test_wait_ends_at_its_deadline_when_every_head_trickles(serve: Any, flavour: str) -> None:
    """No state is ever seen: the error of the request the deadline cut, at the deadline."""
    gateway = serve(trickled_head)
    began = time.monotonic()
    with pytest.raises((TaskWaitTimeout, httpx.TransportError)):
        wait_with(flavour, gateway.url, client_timeout=5, timeout=1.5)
    assert time.monotonic() - began < 1.5 + 2


def test_cli_watch_ends_at_its_timeout_when_the_gateway_trickles(serve: Any) -> None:
    gateway = serve(routed(pending_stream, trickled_poll))
    began = time.monotonic()
    result = cli(gateway.url, "watch", "sleeper", TASK_ID, "--timeout", "1.5")

    assert time.monotonic() - began < 1.5 + 2
    assert "gave up waiting" in error_lines(result, task_cli.GAVE_UP)[-1]


@FLAVOURS
@pytest.mark.parametrize("method", ["get", "submit", "cancel"])
def test_a_call_ends_within_its_bound_when_the_answer_trickles(
    serve: Any, flavour: str, method: str
) -> None:
    """A byte every 0.25 s, the client's timeout 1 s: the whole call is bounded by three."""
    gateway = serve(lambda h: trickled_body(h, success(PENDING), pause=0.25))
    began = time.monotonic()
    with pytest.raises(httpx.TimeoutException):
        call_with(flavour, gateway.url, method, client_timeout=1.0)
    assert time.monotonic() - began < 3 * 1.0 + 2


# --- 2. a consumer slower than the deadline ------------------------------------------------


def test_async_follow_consumed_slowly_raises_task_wait_timeout(serve: Any) -> None:
    gateway = serve(lambda h: h.stream([event(PENDING), *[0.2, ": ping\n\n"] * 50]))

    async def run() -> None:
        async with AsyncConveyorClient(gateway.url, "u", "p") as client:
            async for _ in client.follow("sleeper", TASK_ID, timeout=1):
                await asyncio.sleep(2)

    began = time.monotonic()
    with pytest.raises(TaskWaitTimeout):
        asyncio.run(run())
    assert time.monotonic() - began < 2 + 2


# --- 3. what the SDK reads is bounded ------------------------------------------------------


def peak_memory(run: Callable[[], Any]) -> float:
    """`run()`'s peak of Python allocations, in MiB (whatever it raises is raised)."""
    tracemalloc.start()
    try:
        run()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak / 2**20


@FLAVOURS
def test_a_huge_answer_is_refused_as_too_large(serve: Any, flavour: str) -> None:
    huge = b"x" * (48 * 2**20)
    gateway = serve(lambda h: h.raw(200, "application/json", huge))
    raised: list[ConveyorError] = []

    def get() -> None:
        with pytest.raises(ConveyorError) as error:
            call_with(flavour, gateway.url, "get")
        raised.append(error.value)

    assert peak_memory(get) < 40
    assert raised[0].number == 0
    assert "too large" in raised[0].description


def endless_line(h: Handler) -> None:
    """An event stream whose first line never ends (64 MiB of it, then a stall)."""
    h.send_response(200)
    h.send_header("Content-Type", "text/event-stream")
    h.end_headers()
    h.close_connection = True
    chunk = b"data: " + b"x" * 65536
    try:
        for _ in range(1024):
            h.wfile.write(chunk)
        h.server.released.wait(30)
    except OSError:
        pass


@FLAVOURS
def test_an_endless_stream_line_breaks_the_stream_and_follow_polls(
    serve: Any, flavour: str
) -> None:
    gateway = serve(
        routed(endless_line, lambda h: h.raw(200, "application/json", success(SUCCESS)))
    )
    seen: list[list[str]] = []
    began = time.monotonic()
    peak = peak_memory(lambda: seen.append(follow_with(flavour, gateway.url, 5, timeout=10)))

    assert seen == [["SUCCESS"]]
    assert time.monotonic() - began < 10
    assert peak < 16


# --- 4. a declared charset that is not a text encoding -------------------------------------

CODECS = ["zlib", "base64", "hex", "rot13"]


@FLAVOURS
@pytest.mark.parametrize("codec", CODECS)
def test_an_answer_in_a_codec_that_is_not_text_is_conveyor_error(
    serve: Any, flavour: str, codec: str
) -> None:
    gateway = serve(lambda h: h.raw(200, f"application/json; charset={codec}", b"not json!"))
    with pytest.raises(ConveyorError) as raised:
        call_with(flavour, gateway.url, "get")
    assert raised.value.number == 0


@pytest.mark.parametrize("codec", CODECS)
def test_cli_prints_one_line_for_an_answer_in_a_codec_that_is_not_text(
    serve: Any, codec: str
) -> None:
    gateway = serve(lambda h: h.raw(200, f"application/json; charset={codec}", b"not json!"))
    for command in (["get", "sleeper", TASK_ID], ["watch", "sleeper", TASK_ID, "--timeout", "2"]):
        assert "unexpected answer" in one_error_line(cli(gateway.url, *command))


# --- 5. a body that is not in its declared Content-Encoding --------------------------------


@FLAVOURS
def test_a_body_not_in_its_content_encoding_is_conveyor_error(serve: Any, flavour: str) -> None:
    gateway = serve(
        lambda h: h.raw(200, "application/json", b"not gzip", {"Content-Encoding": "gzip"})
    )
    with pytest.raises(ConveyorError) as raised:
        call_with(flavour, gateway.url, "get")
    assert raised.value.number == 0


@FLAVOURS
def test_a_stream_not_in_its_content_encoding_is_broken_and_follow_polls(
    serve: Any, flavour: str
) -> None:
    gzipped = {"Content-Encoding": "gzip"}
    gateway = serve(
        routed(
            lambda h: h.raw(200, "text/event-stream", b"not gzip", gzipped),
            lambda h: h.raw(200, "application/json", success(SUCCESS)),
        )
    )
    assert follow_with(flavour, gateway.url, 5, timeout=5) == ["SUCCESS"]


def _gzip_in_gzip(inflated_mib: int) -> bytes:
    """A few hundred bytes that inflate to `inflated_mib` MiB of zeros, once both layers are
    undone."""
    inner = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = b"\0" * 2**20
    layer = b"".join(inner.compress(zeros) for _ in range(inflated_mib)) + inner.flush()
    return gzip.compress(layer, 9)


@FLAVOURS
def test_a_compressed_answer_is_refused_before_it_is_inflated(serve: Any, flavour: str) -> None:
    """Found by a black-box sweep: 658 bytes of gzip in gzip took the SDK to 634 MB before
    MAX_ANSWER_BYTES refused them (each chunk is inflated whole before its size is counted).
    The SDK asks for answers as they are, and refuses any other: a poll, and a stream, which
    `follow` then polls for."""
    bomb = _gzip_in_gzip(300)
    assert len(bomb) < 2048
    twice = {"Content-Encoding": "gzip, gzip"}
    asked: list[str] = []

    def answer(h: Handler) -> None:
        asked.append(h.headers.get("Accept-Encoding", ""))
        h.raw(200, "application/json", bomb, twice)

    gateway = serve(answer)
    raised: list[ConveyorError] = []

    def get() -> None:
        with pytest.raises(ConveyorError) as error:
            call_with(flavour, gateway.url, "get")
        raised.append(error.value)

    assert peak_memory(get) < 16
    assert raised[0].number == 0
    assert "compressed" in raised[0].description
    assert asked == ["identity"]
    streamed = serve(
        routed(
            lambda h: h.raw(200, "text/event-stream", bomb, twice),
            lambda h: h.raw(200, "application/json", success(SUCCESS)),
        )
    )
    seen: list[list[str]] = []
    assert peak_memory(lambda: seen.append(follow_with(flavour, streamed.url, 5, timeout=5))) < 16
    assert seen == [["SUCCESS"]]


# --- 6. an outage with interval 0 ----------------------------------------------------------


@FLAVOURS
def test_an_outage_is_not_retried_in_a_tight_loop_with_interval_0(serve: Any, flavour: str) -> None:
    gateway = serve(lambda h: h.raw(503, "text/plain", b"down"))
    with pytest.raises(ConveyorError):
        wait_with(flavour, gateway.url, client_timeout=5, timeout=1, interval=0)
    assert len(gateway.requests) <= 1 / 0.1 + 5


# --- 7. userinfo, long descriptions, another task's answer, Retry-After --------------------


def test_cli_does_not_print_the_gateways_userinfo() -> None:
    url = f"http://u:SECRET@127.0.0.1:{free_port()}"
    line = one_error_line(cli(url, "get", "sleeper", TASK_ID))
    assert "cannot reach the gateway at http://127.0.0.1:" in line
    assert "SECRET" not in line


def test_cli_cuts_a_long_description(serve: Any) -> None:
    description = "d" * 100_000
    body = {"status": "error", "error": {"number": 400002, "description": description}}
    gateway = serve(lambda h: h.envelope(400, body))
    result = cli(gateway.url, "get", "sleeper", TASK_ID)

    assert result.exit_code == 1
    assert len(result.stderr) < 3000
    assert "cut" in result.stderr


@FLAVOURS
def test_an_answer_for_another_task_is_conveyor_error(serve: Any, flavour: str) -> None:
    gateway = serve(
        lambda h: h.raw(200, "application/json", success({**SUCCESS, "taskId": OTHER_ID}))
    )
    with pytest.raises(ConveyorError) as raised:
        call_with(flavour, gateway.url, "get")
    assert raised.value.number == 0


@FLAVOURS
def test_a_task_id_asked_in_another_spelling_is_the_same_task(serve: Any, flavour: str) -> None:
    """The gateway reads a task id as a UUID (upper case, no hyphens, braces) and answers
    with its canonical form: that answer is the task asked for (found by a review)."""
    gateway = serve(lambda h: h.raw(200, "application/json", success(SUCCESS)))
    spelled = TASK_ID.upper()
    if flavour == "sync":
        with ConveyorClient(gateway.url, "u", "p", timeout=5) as client:
            task = client.get("sleeper", spelled)
    else:

        async def run() -> Any:
            async with AsyncConveyorClient(gateway.url, "u", "p", timeout=5) as client:
                return await client.get("sleeper", spelled)

        task = asyncio.run(run())
    assert task.task_id == TASK_ID


@FLAVOURS
def test_follow_does_not_end_on_another_tasks_event(serve: Any, flavour: str) -> None:
    other = [event({**SUCCESS, "taskId": OTHER_ID})]
    gateway = serve(
        routed(
            lambda h: h.stream(other), lambda h: h.raw(200, "application/json", success(PENDING))
        )
    )
    with pytest.raises(TaskWaitTimeout) as raised:
        wait_with(flavour, gateway.url, client_timeout=5, timeout=1, interval=0.1)
    assert raised.value.task.task_id == TASK_ID


def test_cli_submit_wait_with_a_task_id_that_is_not_a_segment_exits_1(serve: Any) -> None:
    data = {"taskId": "../admin", "taskPosition": 1}
    gateway = serve(lambda h: h.raw(201, "application/json", success(data)))
    result = cli(gateway.url, "submit", "sleeper", "-b", "{}", "--wait", "--timeout", "2")
    assert "unexpected answer" in one_error_line(result)


@pytest.mark.parametrize("value", ["1_000", "1e3", "+5"])
def test_a_retry_after_that_is_not_delay_seconds_is_ignored(serve: Any, value: str) -> None:
    gateway = serve(lambda h: h.raw(503, "text/plain", b"down", {"Retry-After": value}))
    with pytest.raises(ConveyorError) as raised:
        call_with("sync", gateway.url, "get")
    assert raised.value.retry_after is None
