"""Python client SDK for the Conveyor gateway (SPEC §3).

Consumers can speak plain HTTP to the gateway; this module saves them the
envelope handling, Basic auth and polling loop, in a sync and an async flavour:

    with ConveyorClient.from_env() as client:
        submitted = client.submit("sleeper", {"sleep": 5})
        task = client.wait("sleeper", submitted.task_id, timeout=60)

Both flavours share the request building and response parsing below; only the
I/O differs. API errors raise `ConveyorError`, and so does an answer the SDK cannot read
(number 0, "unexpected answer from the gateway: ..."); network failures raise httpx's own
`httpx.TransportError` subclasses unchanged (an `httpx.TimeoutException` once a call's whole
bound, REQUEST_TIMEOUTS times the client's timeout, is spent: httpx's own bounds each read, so a
gateway trickling its answer would hold a call for ever), except while `follow` or `wait` waits: they
ride out a gateway unreachable, or answering 502/503/504, for up to `OUTAGE_WINDOW_S` (a
restart, a rolling deploy, a database failover), polling meanwhile (pausing as its
`Retry-After` says), and raise only after that. What the SDK cannot send (a task id or
service that is not one path segment, an Idempotency-Key a header cannot carry, NaN in a body,
a negative interval, a timeout not above 0) raises ValueError at the call, before any request.
What the SDK reads is bounded: an answer over MAX_ANSWER_BYTES is ConveyorError 0, an event of
the stream over MAX_EVENT_BYTES breaks the stream (`follow` then polls).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any, NamedTuple, Self, TypeVar
from urllib.parse import quote

import httpcore
import httpx

from conveyor import __version__
from conveyor import headers as h

DEFAULT_GATEWAY_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_POLL_INTERVAL_S = 0.5
TERMINAL_STATUSES = frozenset({"SUCCESS", "FAILURE"})
OUTAGE_WINDOW_S = 30.0
# The event stream's read timeout: four of the gateway's default 15 s heartbeats, so a quiet
# stream is kept (the client's own timeout, 10 s by default, would drop it).
STREAM_READ_TIMEOUT_S = 60.0
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})  # ridden out while following, like no answer
# A call (connect, send, answer) ends within this many of the client's timeouts.
REQUEST_TIMEOUTS = 3
MAX_ANSWER_BYTES = 16 * 2**20  # an answer over this is ConveyorError 0, "answer too large"
MAX_EVENT_BYTES = 2**20  # one event of the stream (its lines); over it, the stream is broken
_OUTAGE_PAUSE_S = 0.1  # the shortest pause between attempts while the gateway is down
_EVENT_HEADERS = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
# Retry-After as delay-seconds (RFC 9110: digits; a fraction is taken too), not "1_000" or "1e3".
_DELAY_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_SHORTEST_TIMEOUT_S = 0.01  # a request made at the deadline still gets a (tiny) timeout
# ... and a longer one while no state was seen: a short timeout against a healthy gateway
# then still sees the task, and ends in TaskWaitTimeout rather than in a transport error.
_FIRST_ANSWER_S = 0.5
# A header value the gateway reads back unchanged: visible ASCII, spaces only inside (HTTP
# strips them at either end); httpx cannot send other characters, nor h11 a line break.
_HEADER_VALUE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")
# What cannot be in one path segment: the gateway decodes %2F before routing, and control
# characters have no place in a URL.
_NOT_IN_A_SEGMENT = re.compile(r"[/\x00-\x1f\x7f-\x9f]")


class ConveyorError(Exception):
    """The gateway answered with an error envelope, or something the SDK cannot read
    (`number` 0). `retry_after`: the answer's `Retry-After`, in seconds (None without one)."""

    def __init__(
        self,
        http_status: int,
        number: int,
        description: str,
        errors: list[dict[str, Any]] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{number} {description}")
        self.http_status = http_status
        self.number = number
        self.description = description
        self.errors = errors or []
        self.retry_after = retry_after

    @property
    def unavailable(self) -> bool:
        """502/503/504: the gateway (or a proxy before it) is down for now."""
        return self.http_status in UNAVAILABLE_STATUSES


class TaskWaitTimeout(TimeoutError):
    """`wait` gave up before the task finished; `task` is the last state seen."""

    def __init__(self, task: Task) -> None:
        super().__init__(f"task {task.task_id} still {task.status}")
        self.task = task


@dataclass(frozen=True)
class Submitted:
    """A created task. `created` is False when an Idempotency-Key matched an earlier task."""

    task_id: str
    position: int | None
    created: bool = True


@dataclass(frozen=True)
class Task:
    """A task as polled from the gateway; dates are timezone-aware UTC datetimes."""

    task_id: str
    status: str
    task_position: int | None
    submition_date: datetime | None
    start_date: datetime | None
    end_date: datetime | None
    progress: float
    response: Any
    error_message: str | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    not_before: datetime | None = None  # run later (SPEC §11.4)

    @property
    def done(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def succeeded(self) -> bool:
        return self.status == "SUCCESS"


@dataclass(frozen=True)
class _Call:
    """One HTTP call, built once and sent by either flavour."""

    method: str
    path: str
    json: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


def _segment(value: str, what: str) -> str:
    """`value` as one path segment, or ValueError: '/' would still split it (the gateway
    decodes %2F before routing), and httpx resolves '.' and '..' away, so such an id would
    reach another route, or none, instead of being answered 404 for what it is."""
    if value in ("", ".", "..") or _NOT_IN_A_SEGMENT.search(value):
        raise ValueError(
            f"{what} {value!r} cannot be one segment of the URL path"
            " (it is empty, '.' or '..', or has a '/' or a control character)"
        )
    return quote(value, safe="")


def _tasks_path(service: str) -> str:
    return f"/v1/services/{_segment(service, 'service')}/tasks"


def _task_path(service: str, task_id: str) -> str:
    return f"{_tasks_path(service)}/{_segment(task_id, 'task id')}"


def _key_headers(idempotency_key: str | None) -> dict[str, str]:
    """The Idempotency-Key header (none for None), or ValueError for a key the gateway would
    refuse (1 to 200 characters) or could not read back as sent (see _HEADER_VALUE)."""
    if idempotency_key is None:
        return {}
    if len(idempotency_key) > h.MAX_IDEMPOTENCY_KEY or not _HEADER_VALUE.fullmatch(idempotency_key):
        raise ValueError(
            f"Idempotency-Key {idempotency_key[:50]!r} cannot be sent: it must be 1 to"
            f" {h.MAX_IDEMPOTENCY_KEY} visible ASCII characters (spaces only inside)"
        )
    return {"Idempotency-Key": idempotency_key}


def _json_ready(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload`, or ValueError naming where a NaN or Infinity is: JSON has no such numbers
    (httpx would refuse them with a bare "Out of range float values"), or where a lone
    surrogate is (half a UTF-16 pair, no Unicode text: UTF-8 cannot encode it); or ValueError
    for a payload nested too deep for json.dumps (a RecursionError otherwise), or that holds
    itself (the search for a NaN went round it for ever)."""
    try:
        json.dumps(payload, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise ValueError(
            "the request cannot be sent as JSON: it is nested too deep for json.dumps"
        ) from None
    except UnicodeEncodeError:
        path, text = _first(payload, _lone_surrogate)
        raise ValueError(
            f"the request cannot be sent as JSON: {path} is {text!r}, which holds a lone"
            " surrogate (half a UTF-16 pair, U+D800 to U+DFFF): no Unicode text"
        ) from None
    except ValueError as exc:
        if "Out of range float" not in str(exc):  # a payload that holds itself, say
            raise ValueError(f"the request cannot be sent as JSON: {exc}") from None
        path, number = _first(payload, _non_finite)
        raise ValueError(
            f"the request cannot be sent as JSON: {path} is {number!r}, and NaN and Infinity"
            " are not JSON numbers"
        ) from None
    return payload


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _lone_surrogate(value: Any) -> bool:
    return isinstance(value, str) and _SURROGATE.search(value) is not None


_SURROGATE = re.compile("[\ud800-\udfff]")  # what is left in a str of a pair is lone


def _first(payload: dict[str, Any], wrong: Callable[[Any], bool]) -> tuple[str, Any]:
    """Where json.dumps met a value (or a key) it could not write, found again (iterative: a
    body may be deeply nested)."""
    stack: list[tuple[Any, str]] = [(payload, "")]
    while stack:
        value, path = stack.pop()
        if wrong(value):
            return path, value
        if isinstance(value, dict | list | tuple):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in reversed(list(items)):
                if wrong(key):
                    return f"a key in {path or 'the request'}", key
                stack.append((item, f"{path}/{key}" if path else str(key)))
    return "a value", None  # unreachable: json.dumps found one


def task_item(
    body: dict[str, Any],
    callback_url: str | None = None,
    delay_seconds: int | None = None,
    not_before: datetime | None = None,
) -> dict[str, Any]:
    """One task as the API takes it, alone or as a batch item: `delay_seconds` or
    `not_before` (timezone-aware) make it wait (SPEC §11.4)."""
    item: dict[str, Any] = {"body": body}
    if callback_url:
        item["callback"] = {"type": "https", "url": callback_url}
    if delay_seconds is not None:
        item["delaySeconds"] = delay_seconds
    if not_before is not None:
        item["notBefore"] = not_before.isoformat()
    return item


def _submit_call(service: str, item: dict[str, Any], idempotency_key: str | None) -> _Call:
    headers = _key_headers(idempotency_key)
    return _Call("POST", _tasks_path(service), _json_ready(item), headers)


def _batch_call(service: str, tasks: list[dict[str, Any]], idempotency_key: str | None) -> _Call:
    """`tasks`: items as the API takes them (`task_item`), `{"body": {...}, ...}`."""
    headers = _key_headers(idempotency_key)
    return _Call("POST", f"{_tasks_path(service)}/batch", _json_ready({"tasks": tasks}), headers)


def _events_call(service: str, task_id: str) -> _Call:
    return _Call("GET", f"{_task_path(service, task_id)}/events", headers=_EVENT_HEADERS)


def _is_stream(response: httpx.Response) -> bool:
    content_type = response.headers.get("content-type", "")
    return response.status_code == 200 and content_type.startswith("text/event-stream")


def _compressed(response: httpx.Response) -> bool:
    return response.headers.get("content-encoding", "identity").strip().lower() != "identity"


def _uncompressed(response: httpx.Response) -> None:
    """The SDK asks for answers as they are (`Accept-Encoding: identity`) and reads no other:
    a decoder inflates a chunk whole before its size can be counted (a sweep: 658 bytes of
    gzip in gzip took the SDK to 634 MB before MAX_ANSWER_BYTES refused them)."""
    if _compressed(response):
        encoding = response.headers.get("content-encoding", "")[:40]
        raise _unexpected(response, f"a compressed answer ({encoding}), not asked for")


def _no_stream(answer: _Answer) -> None:
    """Returns when a gateway has no event stream: an older one answers 404000 or
    405000, and something in between (a proxy, a test double) may answer 200 with JSON. The
    caller polls instead. Any other error is the poll's (403001, 404001, 404002...): raised."""
    if answer.status_code == 200:
        return
    try:
        _unwrap(answer)
    except ConveyorError as exc:
        if exc.number not in (404000, 405000):
            raise


@dataclass(frozen=True)
class _Answer:
    """An answer read whole (at most MAX_ANSWER_BYTES): what the parsers below read."""

    status_code: int
    headers: httpx.Headers
    reason_phrase: str
    body: bytes

    @property
    def text(self) -> str:
        """The body as UTF-8 (JSON's encoding) whatever charset is declared: a "charset" may
        name a codec that is no text encoding (zlib, base64), which would crash a decoder."""
        return self.body.decode("utf-8", "replace")


class _Body:
    """An answer's body as it arrives, refused past MAX_ANSWER_BYTES (ConveyorError 0): the SDK
    holds no more than that of whatever a gateway sends."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self._chunks: list[bytes] = []
        self._size = 0

    def add(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size > MAX_ANSWER_BYTES:
            raise _unexpected(self._response, f"answer too large (over {MAX_ANSWER_BYTES} bytes)")
        self._chunks.append(chunk)

    def answer(self) -> _Answer:
        response = self._response
        body = b"".join(self._chunks)
        return _Answer(response.status_code, response.headers, response.reason_phrase, body)


@contextmanager
def _decoding(response: httpx.Response) -> Iterator[None]:
    """A body not in its Content-Encoding is an answer the SDK cannot read, ConveyorError 0
    (httpx.DecodingError is no TransportError: `follow` would not ride it out)."""
    try:
        yield
    except httpx.DecodingError as exc:
        raise _unexpected(response, f"a body not in its Content-Encoding ({exc})") from None


class _Event(NamedTuple):
    name: str
    data: str


BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark


class _EventReader:
    """The event stream's bytes as events (only the `event` and `data` fields matter here), as
    UTF-8 whatever charset is declared. An event (its lines, comments included) over
    MAX_EVENT_BYTES breaks the stream: the SDK would otherwise buffer a line without end (why
    not httpx-sse, which reads httpx's lines, each whole however long). A line ends at CRLF,
    LF or a lone CR, the moment its end arrives, and a leading BOM is dropped, as the event
    stream format says."""

    def __init__(self) -> None:
        self._pending = bytearray()  # the line not ended yet
        self._size = 0  # the bytes of the event's ended lines
        self._name = ""
        self._data: list[str] = []
        self._at_start = True  # a BOM may still come
        self._after_cr = False  # a line just ended at a CR: an LF next is the same end

    def feed(self, chunk: bytes) -> list[_Event]:
        """The events `chunk` ends. Lines are split only when a line may have ended (a trickle
        of one endless line costs no rescan of it)."""
        if self._after_cr and chunk:
            chunk = chunk[1:] if chunk.startswith(b"\n") else chunk
            self._after_cr = False
        if self._at_start:
            chunk = bytes(self._pending) + chunk
            self._pending.clear()
            if len(chunk) < len(BOM) and BOM.startswith(chunk):
                self._pending += chunk  # maybe the start of a BOM: wait for more
                return []
            self._at_start = False
            chunk = chunk.removeprefix(BOM)
        split = b"\n" in chunk or b"\r" in chunk
        self._pending += chunk
        events: list[_Event] = []
        if split:
            lines = bytes(self._pending).splitlines(keepends=True)  # on \r\n, \r and \n only
            tail = b""
            if lines and not lines[-1].endswith((b"\n", b"\r")):
                tail = lines.pop()  # not ended
            self._after_cr = bool(lines) and not tail and lines[-1].endswith(b"\r")
            self._pending = bytearray(tail)
            events = [e for e in map(self._line, lines) if e is not None]
        if self._size + len(self._pending) > MAX_EVENT_BYTES:
            raise httpx.RemoteProtocolError(
                f"an event of the stream is over {MAX_EVENT_BYTES} bytes"
            )
        return events

    def _line(self, ended: bytes) -> _Event | None:
        line = ended.rstrip(b"\r\n")
        if not line:
            event = _Event(self._name, "\n".join(self._data)) if self._data else None
            self._size, self._name, self._data = 0, "", []
            return event
        self._size += len(ended)
        name, _, value = line.decode("utf-8", "replace").partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._name = value
        elif name == "data":
            self._data.append(value)
        return None


def _stream_task(event: _Event, task_id: str) -> Task | None:
    """The event's task; None for another event or one the SDK cannot read (skipped)."""
    if event.name != "task":
        return None
    try:
        data = json.loads(event.data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        return _task_for(data, task_id)
    except _Unreadable:
        return None


# The monotonic time by which the current sync request must end (None: httpx's timeouts only),
# read by _BoundedStream at each socket operation; set around one request, or one read of a
# stream, never while yielding to a caller.
_REQUEST_END: ContextVar[float | None] = ContextVar("conveyor_request_end", default=None)


@contextmanager
def _ending_by(end: float | None) -> Iterator[None]:
    token = _REQUEST_END.set(end)
    try:
        yield
    finally:
        _REQUEST_END.reset(token)


def _time_left(timeout: float | None, late: type[Exception]) -> float | None:
    """`timeout` cut to the time left before _REQUEST_END; `late` once there is none."""
    end = _REQUEST_END.get()
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise late("no whole answer in the time given to the request")
    return left if timeout is None else min(timeout, left)


def _late() -> httpx.ReadTimeout:
    return httpx.ReadTimeout("no whole answer in the time given to the request")


def _check_time(end: float | None) -> None:
    if end is not None and time.monotonic() >= end:
        raise _late()


class _BoundedStream(httpcore.NetworkStream):
    """A sync socket whose every read and write ends by _REQUEST_END: httpx's timeouts bound
    each read, so a gateway trickling its answer a byte at a time would hold a call for ever,
    and a sync read cannot be cut from outside before the answer's headers give its socket."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _time_left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _time_left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = _time_left(timeout, httpcore.ConnectTimeout)
        return _BoundedStream(self._stream.start_tls(ssl_context, server_hostname, left))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _BoundedBackend(httpcore.NetworkBackend):
    """Opens _BoundedStreams, its connects bounded by _REQUEST_END as well."""

    def __init__(self, backend: httpcore.NetworkBackend) -> None:
        self._backend = backend

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = _time_left(timeout, httpcore.ConnectTimeout)
        stream = self._backend.connect_tcp(host, port, left, local_address, socket_options)
        return _BoundedStream(stream)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        left = _time_left(timeout, httpcore.ConnectTimeout)
        return _BoundedStream(self._backend.connect_unix_socket(path, left, socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def _bound_sockets(http: httpx.Client) -> None:
    """Puts a _BoundedBackend under each HTTP transport of `http` (its own and those of the
    environment's proxies): httpx has no public hook to the socket of a request before its
    answer's headers, and a sync request cannot be cancelled otherwise. These are httpx's and
    httpcore's private attributes: should a release rename them, calls are bounded per read
    only, as before (tests/unit/test_client_hostile_gateway.py notices)."""
    transports = [getattr(http, "_transport", None), *getattr(http, "_mounts", {}).values()]
    for transport in transports:
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if isinstance(transport, httpx.HTTPTransport) and backend is not None:
            pool._network_backend = _BoundedBackend(backend)  # type: ignore[union-attr]


def _events_by(response: httpx.Response, pacer: _Pacer) -> Iterator[_Event]:
    """The stream's events until it ends or breaks (then see _Pacer.after_broken_stream). A
    quiet stream still sends comments, so no read timeout ends it: the deadline ends each of
    its reads (and, for a consumer slower than the deadline, the next one)."""
    reader = _EventReader()
    chunks = response.iter_bytes()
    end = pacer.deadline()
    try:
        while True:
            _check_time(end)
            with _ending_by(end):
                chunk = next(chunks, None)
            if chunk is None:
                return
            yield from reader.feed(chunk)
    except _BROKEN_STREAM as exc:
        pacer.after_broken_stream(exc)


_T = TypeVar("_T")


async def _by(end: float | None, start: Callable[[], Awaitable[_T]]) -> _T:
    """`start()` awaited whole by `end` (monotonic; None: no bound), else httpx.ReadTimeout:
    httpx's timeouts bound each read only. The caller yields nothing inside it, so that a slow
    consumer's time is never the request's (nor its cancellation the consumer's)."""
    if end is None:
        return await start()
    _check_time(end)
    try:
        async with asyncio.timeout(end - time.monotonic()):
            return await start()
    except TimeoutError:
        raise _late() from None


async def _aevents_by(response: httpx.Response, pacer: _Pacer) -> AsyncIterator[_Event]:
    """As _events_by, each read in an asyncio timeout (and no yield inside it)."""
    reader = _EventReader()
    chunks = response.aiter_bytes()
    end = pacer.deadline()
    try:
        while True:
            chunk = await _by(end, partial(anext, chunks, None))
            if chunk is None:
                return
            for event in reader.feed(chunk):
                yield event
    except _BROKEN_STREAM as exc:
        pacer.after_broken_stream(exc)


# What breaks a stream: `follow` polls instead (ConveyorError 0 is only for an answer).
_BROKEN_STREAM = (httpx.StreamError, httpx.TransportError, httpx.DecodingError)


def _built(
    http: httpx.Client | httpx.AsyncClient, call: _Call, timeouts: httpx.Timeout
) -> httpx.Request:
    try:
        return http.build_request(
            call.method, call.path, json=call.json, headers=call.headers, timeout=timeouts
        )
    except httpx.InvalidURL as exc:  # a segment of 70,000 characters: what the SDK cannot send
        raise ValueError(f"the request's URL cannot be sent: {exc}") from None


def _cancel_call(service: str, task_id: str) -> _Call:
    return _Call("POST", f"{_task_path(service, task_id)}/cancel")


def _get_call(service: str, task_id: str) -> _Call:
    return _Call("GET", _task_path(service, task_id))


class _Unreadable(ValueError):
    """A `data` whose shape the SDK cannot read; the message says what is wrong."""


def _retry_after(response: httpx.Response | _Answer) -> float | None:
    """`Retry-After` in seconds; None when absent or not delay-seconds (a date, "1_000")."""
    value = response.headers.get("retry-after", "").strip()
    return float(value) if _DELAY_SECONDS.fullmatch(value) else None


def _unexpected(response: httpx.Response | _Answer, what: str) -> ConveyorError:
    return ConveyorError(
        response.status_code,
        0,
        f"unexpected answer from the gateway: {what}",
        retry_after=_retry_after(response),
    )


def _not_an_envelope(response: _Answer) -> ConveyorError:
    return _unexpected(response, response.text.strip()[:200] or response.reason_phrase)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _unwrap(response: _Answer) -> dict[str, Any]:
    """Returns the envelope's `data`, or raises the envelope's error."""
    try:
        envelope = json.loads(response.body)
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep
        raise _not_an_envelope(response) from None
    if not isinstance(envelope, dict):
        raise _not_an_envelope(response)
    if envelope.get("status") == "success" and isinstance(envelope.get("data"), dict):
        return envelope["data"]
    error = envelope.get("error")
    if envelope.get("status") != "error" or not isinstance(error, dict):
        raise _not_an_envelope(response)
    number = error.get("number") or 0
    if not _is_int(number):
        raise _not_an_envelope(response)
    errors = error.get("errors")
    raise ConveyorError(
        response.status_code,
        number,
        str(error.get("description") or ""),
        [e for e in errors if isinstance(e, dict)] if isinstance(errors, list) else [],
        _retry_after(response),
    )


def _parse_date(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _submitted(data: Any, created: bool) -> Submitted:
    """A created task, whose id must be one path segment: it is what the next calls send."""
    if not isinstance(data, dict):
        raise _Unreadable(f"a task that is not an object: {str(data)[:100]}")
    task_id = _task_id(data)
    try:
        _segment(task_id, "taskId")
    except ValueError as exc:
        raise _Unreadable(str(exc)) from None
    return Submitted(task_id, _position(data), created)


def _parse_submitted(response: _Answer) -> Submitted:
    try:
        return _submitted(_unwrap(response), response.status_code == 201)
    except _Unreadable as exc:
        raise _unexpected(response, str(exc)) from None


def _parse_batch(response: _Answer) -> list[Submitted]:
    created = response.status_code == 201
    tasks = _unwrap(response).get("tasks")
    try:
        if not isinstance(tasks, list):
            raise _Unreadable("tasks is not a list")
        return [_submitted(t, created) for t in tasks]
    except _Unreadable as exc:
        raise _unexpected(response, str(exc)) from None


def _parse_task(response: _Answer, task_id: str) -> Task:
    data = _unwrap(response)
    try:
        return _task_for(data, task_id)
    except _Unreadable as exc:
        raise _unexpected(response, str(exc)) from None


def _task_for(data: dict[str, Any], task_id: str) -> Task:
    """The task `task_id`; another task's answer is unreadable (a follow would end on it)."""
    task = _task(data)
    if not _same_task(task.task_id, task_id):
        raise _Unreadable(f"taskId {task.task_id[:100]!r} is not the task asked for")
    return task


def _same_task(answered: str, asked: str) -> bool:
    """The gateway reads an id as a UUID (any case, braces, no hyphens) and answers with its
    canonical form: the same task in another spelling."""
    if answered == asked:
        return True
    try:
        return uuid.UUID(answered) == uuid.UUID(asked)
    except ValueError:
        return False


def _task_id(data: dict[str, Any]) -> str:
    task_id = data.get("taskId")
    if not isinstance(task_id, str) or not task_id:
        raise _Unreadable("taskId is missing or not a string")
    return task_id


def _position(data: dict[str, Any]) -> int | None:
    position = data.get("taskPosition")
    if position is not None and not _is_int(position):
        raise _Unreadable("taskPosition is not an integer")
    return position


def _progress(data: dict[str, Any]) -> float:
    """A number; a non-finite one (NaN, Infinity) reads as 0.0."""
    progress = data.get("progress")
    if progress is None:
        return 0.0
    if not isinstance(progress, int | float) or isinstance(progress, bool):
        raise _Unreadable("progress is not a number")
    try:
        value = float(progress)
    except OverflowError:  # an integer too large for a float
        return 0.0
    return value if math.isfinite(value) else 0.0


def _task(data: dict[str, Any]) -> Task:
    """Raises _Unreadable when a field has a shape the SDK cannot read."""
    status = data.get("status")
    if not isinstance(status, str):
        raise _Unreadable("status is missing or not a string")
    error_message = data.get("errorMessage")
    if error_message is not None and not isinstance(error_message, str):
        raise _Unreadable("errorMessage is not a string")
    return Task(
        task_id=_task_id(data),
        status=status,
        task_position=_position(data),
        submition_date=_parse_date(data.get("submitionDate")),
        start_date=_parse_date(data.get("startDate")),
        end_date=_parse_date(data.get("endDate")),
        progress=_progress(data),
        response=data.get("response"),
        error_message=error_message,
        raw=data,
        not_before=_parse_date(data.get("notBefore")),
    )


def _following(service: str, task_id: str, timeout: float | None, interval: float) -> _Pacer:
    """The pacer of a `follow`, once its arguments are checked (ValueError), so that a caller
    learns of a mistake at the call, not at the first outage."""
    _task_path(service, task_id)
    return _Pacer(timeout, interval)


class _Pacer:
    """The schedule shared by both flavours while following a task: how long each request may
    take (never past the deadline), how long to pause, when to give up, and how long the
    gateway may stay unreachable or unavailable (502/503/504) before its error is raised."""

    def __init__(self, timeout: float | None, interval: float) -> None:
        """ValueError, at the call, for a timeout or interval that is not a number of seconds
        (a negative pause would crash the first wait on an outage; a NaN, every comparison)."""
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a finite number of seconds above 0, not {timeout}")
        if not (math.isfinite(interval) and interval >= 0):
            raise ValueError(f"interval must be a finite number of seconds >= 0, not {interval}")
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._interval = interval
        self._unreachable_since: float | None = None
        self.last: Task | None = None  # the last state seen, stream or poll

    def left(self) -> float | None:
        """Seconds before the deadline (negative once passed); None without one."""
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _within(self, seconds: float) -> float:
        left = self.left()
        shortest = _SHORTEST_TIMEOUT_S if self.last is not None else _FIRST_ANSWER_S
        return seconds if left is None else max(min(seconds, left), min(seconds, shortest))

    def request_seconds(self, timeout: float) -> float:
        """A request's whole bound (REQUEST_TIMEOUTS of the client's `timeout`), cut to the
        time left; TaskWaitTimeout once there is none."""
        left = self.left()
        if left is not None and left <= 0 and self.last is not None:
            raise TaskWaitTimeout(self.last)
        return self._within(REQUEST_TIMEOUTS * timeout)

    def news(self, event: _Event, task_id: str) -> Task | None:
        """The event's task when it is news (recorded as seen); else None."""
        task = _stream_task(event, task_id)
        return task if task is not None and self.seen(task) else None

    def deadline(self) -> float | None:
        """The deadline (time.monotonic()), which ends each read of the stream; None without."""
        return self._deadline

    def after_broken_stream(self, exc: Exception) -> None:
        """Once the deadline passed: TaskWaitTimeout when a state was seen; else (a stream cut
        before its first event, or broken) the caller polls, which gets a first state."""
        if self.last is not None:
            self.give_up_at_deadline(exc)

    def give_up_at_deadline(self, exc: Exception) -> None:
        """Once the deadline passed: TaskWaitTimeout when a state was seen, else `exc`."""
        left = self.left()
        if left is not None and left <= 0:
            if self.last is None:
                raise exc
            raise TaskWaitTimeout(self.last) from exc

    def seen(self, task: Task) -> bool:
        """Records `task`; whether it is news (a poll after the stream may repeat its last)."""
        new = self.last is None or task.raw != self.last.raw
        self.last = task
        self._unreachable_since = None
        return new

    def pause_after_outage(self, exc: httpx.TransportError | ConveyorError) -> float:
        """After no answer or a 502/503/504: the pause (its Retry-After, else `interval`, but
        _OUTAGE_PAUSE_S at least, so that an `interval` of 0 spins no core; within the deadline
        and the outage window), or `exc` once the window is over."""
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
        window_left = self._unreachable_since + OUTAGE_WINDOW_S - now
        if window_left <= 0:
            raise exc
        self.give_up_at_deadline(exc)
        pause = self._interval
        if isinstance(exc, ConveyorError) and exc.retry_after is not None:
            pause = exc.retry_after
        pause = min(max(pause, _OUTAGE_PAUSE_S), window_left)
        left = self.left()
        return pause if left is None else min(pause, left)

    def pause_after(self, task: Task) -> float:
        if self._deadline is None:
            return self._interval
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TaskWaitTimeout(task)
        return min(self._interval, left)


def _gateway_url(url: str) -> str:
    """The gateway's URL as requests use it. http(s) only, checked here: `localhost:8000` is
    a URL of scheme `localhost` to httpx, and each call would then fail as an unreachable
    gateway (ridden out 30 s by `wait`). Its userinfo is dropped: the client's own
    credentials authenticate, and httpx logs every request's URL."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"the gateway's URL is not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError("the gateway's URL must start with http:// or https:// and name a host")
    return str(parsed.copy_with(username=None, password=None)).rstrip("/")


@dataclass(frozen=True)
class _Config:
    base_url: str
    client_id: str
    client_secret: str = field(repr=False)
    timeout: float

    @classmethod
    def from_env(cls, timeout: float) -> _Config:
        client_id = os.environ.get("CONVEYOR_CLIENT_ID", "")
        client_secret = os.environ.get("CONVEYOR_CLIENT_SECRET", "")
        if not client_id or not client_secret:
            raise ValueError("set CONVEYOR_CLIENT_ID and CONVEYOR_CLIENT_SECRET")
        base_url = os.environ.get("CONVEYOR_GATEWAY_URL") or DEFAULT_GATEWAY_URL
        return cls(base_url, client_id, client_secret, timeout)

    def timeouts(self, seconds: float, read: float | None = None) -> httpx.Timeout:
        """httpx's timeouts (each a phase, each read) for a request bounded to `seconds` whole;
        `read` for the stream's reads (bounded by the follow's deadline instead)."""
        phase = min(self.timeout, seconds)
        return httpx.Timeout(phase, read=phase if read is None else read)

    def request_seconds(self) -> float:
        """A call's whole bound: connect, send and answer, each up to the client's timeout."""
        return REQUEST_TIMEOUTS * self.timeout

    def httpx_options(self) -> dict[str, Any]:
        """No cap on connections: each followed task holds one for its life, and httpx's
        default pool of 100 made the 101st `wait` fail as an outage (httpx.PoolTimeout)."""
        return {
            "base_url": _gateway_url(self.base_url),
            "auth": httpx.BasicAuth(self.client_id, self.client_secret),
            "timeout": self.timeout,
            "limits": httpx.Limits(max_connections=None, max_keepalive_connections=20),
            "headers": {
                "User-Agent": f"conveyor-client/{__version__}",
                "Accept-Encoding": "identity",  # see _uncompressed
            },
        }


class _FromEnv:
    """The constructor both clients share, reading the consumer CLI's environment."""

    @classmethod
    def from_env(cls, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> Self:
        """CONVEYOR_GATEWAY_URL (default http://127.0.0.1:8000), CONVEYOR_CLIENT_ID/_SECRET."""
        config = _Config.from_env(timeout)
        return cls(config.base_url, config.client_id, config.client_secret, timeout, **kwargs)  # type: ignore[call-arg]


class ConveyorClient(_FromEnv):
    """Synchronous gateway client; use it as a context manager or call `close()`."""

    def __init__(
        self,
        base_url: str,
        client_id: str,
        client_secret: str,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.config = _Config(_gateway_url(base_url), client_id, client_secret, timeout)
        self._transport = transport
        self._pid = os.getpid()
        self._client = self._new_client()

    def _new_client(self) -> httpx.Client:
        http = httpx.Client(transport=self._transport, **self.config.httpx_options())
        _bound_sockets(http)
        return http

    @property
    def _http(self) -> httpx.Client:
        """The connections of this process: a fork's child (a preload-style parent's client)
        would send on the parent's pooled sockets, which every child shares, and read other
        processes' answers. The parent's are left to it, not closed."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._client = self._new_client()
        return self._client

    def _send(self, call: _Call, seconds: float | None = None) -> _Answer:
        """The whole answer, within `seconds` (REQUEST_TIMEOUTS of the client's timeout by
        default), else an httpx.TimeoutException."""
        seconds = self.config.request_seconds() if seconds is None else seconds
        request = _built(self._http, call, self.config.timeouts(seconds))
        with _ending_by(time.monotonic() + seconds):
            return self._answer(self._http.send(request, stream=True))

    def _answer(self, response: httpx.Response) -> _Answer:
        """`response` read whole (see _Body), then closed."""
        body = _Body(response)
        try:
            _uncompressed(response)
            with _decoding(response):
                for chunk in response.iter_bytes():
                    body.add(chunk)
        finally:
            response.close()
        return body.answer()

    def _open(self, request: httpx.Request) -> httpx.Response | None:
        """The event stream; None when there is none (see _no_stream), and the caller polls."""
        response = self._http.send(request, stream=True)
        if _is_stream(response) and _compressed(response):
            response.close()  # a stream in a codec not asked for is broken: the caller polls
            return None
        if _is_stream(response):
            return response
        _no_stream(self._answer(response))
        return None

    def submit(
        self,
        service: str,
        body: dict[str, Any],
        callback_url: str | None = None,
        idempotency_key: str | None = None,
        *,
        delay_seconds: int | None = None,
        not_before: datetime | None = None,
    ) -> Submitted:
        item = task_item(body, callback_url, delay_seconds, not_before)
        return _parse_submitted(self._send(_submit_call(service, item, idempotency_key)))

    def submit_batch(
        self, service: str, tasks: list[dict[str, Any]], idempotency_key: str | None = None
    ) -> list[Submitted]:
        """All or nothing; the answers are in the order of `tasks`."""
        return _parse_batch(self._send(_batch_call(service, tasks, idempotency_key)))

    def get(self, service: str, task_id: str) -> Task:
        return _parse_task(self._send(_get_call(service, task_id)), task_id)

    def cancel(self, service: str, task_id: str) -> Task:
        """FAILURE `Task cancelled.` (SPEC §11.1); idempotent; ConveyorError 409001 if it
        had already finished otherwise."""
        return _parse_task(self._send(_cancel_call(service, task_id)), task_id)

    def follow(
        self,
        service: str,
        task_id: str,
        timeout: float | None = None,
        interval: float = DEFAULT_POLL_INTERVAL_S,
    ) -> Iterator[Task]:
        """Yields the task as it changes, the last one being SUCCESS or FAILURE: from the
        gateway's event stream (SPEC §11.3), or by polling every `interval` seconds from a
        gateway without one, or once the stream broke (the gateway restarted).

        A gateway unreachable or answering 502/503/504 is waited for up to OUTAGE_WINDOW_S
        (pausing as its Retry-After says), then its error is raised. Raises TaskWaitTimeout
        after `timeout` seconds: no request outlives the deadline (but for a first state,
        given half a second: a short timeout against a healthy gateway ends in TaskWaitTimeout
        too). When no state was ever seen by then, the error of the request the deadline cut
        (an httpx.TransportError, or a ConveyorError of an unavailable gateway) is raised
        instead, at the deadline.

        ValueError at the call, before any request, for a timeout, interval, service or task
        id the SDK cannot use."""
        pacer = _following(service, task_id, timeout, interval)
        return self._follow(service, task_id, pacer)

    def _follow(self, service: str, task_id: str, pacer: _Pacer) -> Iterator[Task]:
        for task in self._stream(service, task_id, pacer):
            yield task
            if task.done:
                return
        yield from self._poll(service, task_id, pacer)

    def _stream(self, service: str, task_id: str, pacer: _Pacer) -> Iterator[Task]:
        """Yields the stream's states, until a terminal one; ends early when polling is to go
        on (no stream, or it broke: the gateway went away)."""
        seconds = pacer.request_seconds(self.config.timeout)
        timeouts = self.config.timeouts(seconds, read=STREAM_READ_TIMEOUT_S)
        request = _built(self._http, _events_call(service, task_id), timeouts)
        try:
            with _ending_by(time.monotonic() + seconds):
                opened = self._open(request)
        except _BROKEN_STREAM as exc:
            pacer.give_up_at_deadline(exc)  # else the gateway went away: polling rides it out
            return
        except ConveyorError as exc:
            if not exc.unavailable:
                raise
            time.sleep(pacer.pause_after_outage(exc))
            return
        if opened is None:
            return
        try:
            for event in _events_by(opened, pacer):
                if (task := pacer.news(event, task_id)) is not None:
                    yield task
        finally:
            opened.close()

    def _poll(self, service: str, task_id: str, pacer: _Pacer) -> Iterator[Task]:
        while True:
            call = _get_call(service, task_id)
            try:
                seconds = pacer.request_seconds(self.config.timeout)
                task = _parse_task(self._send(call, seconds), task_id)
            except httpx.TransportError as exc:
                time.sleep(pacer.pause_after_outage(exc))
                continue
            except ConveyorError as exc:
                if not exc.unavailable:
                    raise
                time.sleep(pacer.pause_after_outage(exc))
                continue
            if pacer.seen(task):
                yield task
            if task.done:
                return
            time.sleep(pacer.pause_after(task))

    def wait(
        self,
        service: str,
        task_id: str,
        timeout: float | None = None,
        interval: float = DEFAULT_POLL_INTERVAL_S,
    ) -> Task:
        """The task once it ended, as `follow` follows it (the same outages ridden out and
        the same timeout: TaskWaitTimeout, or the last request's error when no state was
        ever seen)."""
        for task in self.follow(service, task_id, timeout, interval):
            last = task
        return last

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncConveyorClient(_FromEnv):
    """Asynchronous gateway client; use it with `async with` or call `aclose()`."""

    def __init__(
        self,
        base_url: str,
        client_id: str,
        client_secret: str,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = _Config(_gateway_url(base_url), client_id, client_secret, timeout)
        self._transport = transport
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = os.getpid()
        self._client = httpx.AsyncClient(transport=transport, **self.config.httpx_options())

    @property
    def _http(self) -> httpx.AsyncClient:
        """The connections of the running event loop (and process): a connection opened by
        another loop is bound to it, and once that loop closed (one `asyncio.run` after
        another) a request sent on it raised RuntimeError for a task then stored. Another
        loop's connections are left to it: they cannot be closed from this one."""
        loop = asyncio.get_running_loop()
        if self._loop is None and self._pid == os.getpid():
            self._loop = loop
        elif self._loop is not loop or self._pid != os.getpid():
            self._loop, self._pid = loop, os.getpid()
            options = self.config.httpx_options()
            self._client = httpx.AsyncClient(transport=self._transport, **options)
        return self._client

    async def _send(self, call: _Call, seconds: float | None = None) -> _Answer:
        """The whole answer, within `seconds` (REQUEST_TIMEOUTS of the client's timeout by
        default), else an httpx.TimeoutException."""
        seconds = self.config.request_seconds() if seconds is None else seconds
        request = _built(self._http, call, self.config.timeouts(seconds))
        return await _by(time.monotonic() + seconds, partial(self._exchange, request))

    async def _exchange(self, request: httpx.Request) -> _Answer:
        return await self._answer(await self._http.send(request, stream=True))

    async def _answer(self, response: httpx.Response) -> _Answer:
        """`response` read whole (see _Body), then closed."""
        body = _Body(response)
        try:
            _uncompressed(response)
            with _decoding(response):
                async for chunk in response.aiter_bytes():
                    body.add(chunk)
        finally:
            await response.aclose()
        return body.answer()

    async def _open(self, request: httpx.Request) -> httpx.Response | None:
        """The event stream; None when there is none (see _no_stream), and the caller polls."""
        response = await self._http.send(request, stream=True)
        if _is_stream(response) and _compressed(response):
            await response.aclose()  # a stream in a codec not asked for is broken: the caller polls
            return None
        if _is_stream(response):
            return response
        _no_stream(await self._answer(response))
        return None

    async def submit(
        self,
        service: str,
        body: dict[str, Any],
        callback_url: str | None = None,
        idempotency_key: str | None = None,
        *,
        delay_seconds: int | None = None,
        not_before: datetime | None = None,
    ) -> Submitted:
        item = task_item(body, callback_url, delay_seconds, not_before)
        return _parse_submitted(await self._send(_submit_call(service, item, idempotency_key)))

    async def submit_batch(
        self, service: str, tasks: list[dict[str, Any]], idempotency_key: str | None = None
    ) -> list[Submitted]:
        """All or nothing; the answers are in the order of `tasks`."""
        return _parse_batch(await self._send(_batch_call(service, tasks, idempotency_key)))

    async def get(self, service: str, task_id: str) -> Task:
        return _parse_task(await self._send(_get_call(service, task_id)), task_id)

    async def cancel(self, service: str, task_id: str) -> Task:
        """FAILURE `Task cancelled.` (SPEC §11.1); idempotent; ConveyorError 409001 if it
        had already finished otherwise."""
        return _parse_task(await self._send(_cancel_call(service, task_id)), task_id)

    def follow(
        self,
        service: str,
        task_id: str,
        timeout: float | None = None,
        interval: float = DEFAULT_POLL_INTERVAL_S,
    ) -> AsyncIterator[Task]:
        """Yields the task as it changes, the last one being SUCCESS or FAILURE: from the
        gateway's event stream (SPEC §11.3), or by polling every `interval` seconds from a
        gateway without one, or once the stream broke (the gateway restarted).

        A gateway unreachable or answering 502/503/504 is waited for up to OUTAGE_WINDOW_S
        (pausing as its Retry-After says), then its error is raised. Raises TaskWaitTimeout
        after `timeout` seconds: no request outlives the deadline (but for a first state,
        given half a second: a short timeout against a healthy gateway ends in TaskWaitTimeout
        too). When no state was ever seen by then, the error of the request the deadline cut
        (an httpx.TransportError, or a ConveyorError of an unavailable gateway) is raised
        instead, at the deadline.

        ValueError at the call, before any request, for a timeout, interval, service or task
        id the SDK cannot use."""
        pacer = _following(service, task_id, timeout, interval)
        return self._follow(service, task_id, pacer)

    async def _follow(self, service: str, task_id: str, pacer: _Pacer) -> AsyncIterator[Task]:
        async for task in self._stream(service, task_id, pacer):
            yield task
            if task.done:
                return
        async for task in self._poll(service, task_id, pacer):
            yield task

    async def _stream(self, service: str, task_id: str, pacer: _Pacer) -> AsyncIterator[Task]:
        """As ConveyorClient._stream: each await bounded, never a yield."""
        seconds = pacer.request_seconds(self.config.timeout)
        timeouts = self.config.timeouts(seconds, read=STREAM_READ_TIMEOUT_S)
        request = _built(self._http, _events_call(service, task_id), timeouts)
        try:
            opened = await _by(time.monotonic() + seconds, partial(self._open, request))
        except _BROKEN_STREAM as exc:
            pacer.give_up_at_deadline(exc)  # else the gateway went away: polling rides it out
            return
        except ConveyorError as exc:
            if not exc.unavailable:
                raise
            await asyncio.sleep(pacer.pause_after_outage(exc))
            return
        if opened is None:
            return
        try:
            async for event in _aevents_by(opened, pacer):
                if (task := pacer.news(event, task_id)) is not None:
                    yield task
        finally:
            await opened.aclose()

    async def _poll(self, service: str, task_id: str, pacer: _Pacer) -> AsyncIterator[Task]:
        while True:
            call = _get_call(service, task_id)
            try:
                seconds = pacer.request_seconds(self.config.timeout)
                task = _parse_task(await self._send(call, seconds), task_id)
            except httpx.TransportError as exc:
                await asyncio.sleep(pacer.pause_after_outage(exc))
                continue
            except ConveyorError as exc:
                if not exc.unavailable:
                    raise
                await asyncio.sleep(pacer.pause_after_outage(exc))
                continue
            if pacer.seen(task):
                yield task
            if task.done:
                return
            await asyncio.sleep(pacer.pause_after(task))

    async def wait(
        self,
        service: str,
        task_id: str,
        timeout: float | None = None,
        interval: float = DEFAULT_POLL_INTERVAL_S,
    ) -> Task:
        """The task once it ended, as `follow` follows it (the same outages ridden out and
        the same timeout: TaskWaitTimeout, or the last request's error when no state was
        ever seen)."""
        async for task in self.follow(service, task_id, timeout, interval):
            last = task
        return last

    async def aclose(self) -> None:
        """Closes this loop's connections (another, closed loop's are only dropped)."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
