"""Python client SDK for the Conveyor gateway (SPEC §3).

Consumers can speak plain HTTP to the gateway; this module saves them the
envelope handling, Basic auth and polling loop, in a sync and an async flavour:

    with ConveyorClient.from_env() as client:
        submitted = client.submit("sleeper", {"sleep": 5})
        task = client.wait("sleeper", submitted.task_id, timeout=60)

Both flavours share the request building and response parsing below; only the
I/O differs. API errors raise `ConveyorError`, and so does an answer the SDK cannot read
(number 0, "unexpected answer from the gateway: ..."); network failures raise httpx's own
`httpx.TransportError` subclasses unchanged, except while `follow` or `wait` waits: they
ride out a gateway unreachable, or answering 502/503/504, for up to `OUTAGE_WINDOW_S` (a
restart, a rolling deploy, a database failover), polling meanwhile (pausing as its
`Retry-After` says), and raise only after that. What the SDK cannot send (a task id or
service that is not one path segment, an Idempotency-Key a header cannot carry, NaN in a body,
a negative interval, a timeout not above 0) raises ValueError at the call, before any request.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Generator, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Self
from urllib.parse import quote

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse, connect_sse

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
_SHORTEST_TIMEOUT_S = 0.01  # a request made at the deadline still gets a (tiny) timeout
# ... and a longer one while no state was seen: a short timeout against a healthy gateway
# then still sees the task, and ends in TaskWaitTimeout rather than in a transport error.
_FIRST_ANSWER_S = 0.5
_DEFAULT = httpx.USE_CLIENT_DEFAULT  # (None would mean no timeout at all to httpx)
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
    (httpx would refuse them with a bare "Out of range float values")."""
    try:
        json.dumps(payload, allow_nan=False)
    except ValueError:
        path, number = _first_non_finite(payload)
        raise ValueError(
            f"the request cannot be sent as JSON: {path} is {number!r}, and NaN and Infinity"
            " are not JSON numbers"
        ) from None
    return payload


def _first_non_finite(payload: dict[str, Any]) -> tuple[str, float]:
    """Where json.dumps found a NaN or Infinity (iterative: a body may be deeply nested)."""
    stack: list[tuple[Any, str]] = [(payload, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path, value
        if isinstance(value, dict | list | tuple):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((v, f"{path}/{k}" if path else str(k)) for k, v in reversed(list(items)))
    return "a value", math.nan  # unreachable: json.dumps found one


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


def _events_path(service: str, task_id: str) -> str:
    return f"{_task_path(service, task_id)}/events"


def _is_stream(response: httpx.Response) -> bool:
    content_type = response.headers.get("content-type", "")
    return response.status_code == 200 and content_type.startswith("text/event-stream")


def _stream_refused(response: httpx.Response) -> bool:
    """True when a gateway has no event stream: an older one answers 404000 or 405000, and
    something in between (a proxy, a test double) may answer 200 with JSON. The caller polls
    instead. Any other error is the poll's (403001, 404001, 404002...): raised. The body of a
    refusal must have been read."""
    if _is_stream(response):
        return False
    if response.status_code == 200:
        return True
    try:
        _unwrap(response)
    except ConveyorError as exc:
        if exc.number not in (404000, 405000):
            raise
    return True


class _StreamDeadline:
    """Shuts a stream's socket at the deadline, from a timer thread. `passed` is set before
    the socket is shut, so the reader it wakes always knows why its read ended."""

    def __init__(self, response: httpx.Response, timeout: float) -> None:
        self.passed = threading.Event()
        self._response = response
        self._timer = threading.Timer(timeout, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        self.passed.set()
        _shut_down(self._response)

    def cancel(self) -> None:
        self._timer.cancel()


def _shut_down(response: httpx.Response) -> None:
    """Ends a stream from another thread (httpcore's `network_stream` extension)."""
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _stream_task(sse: ServerSentEvent) -> Task | None:
    """The event's task; None for another event or one the SDK cannot read (skipped)."""
    if sse.event != "task":
        return None
    try:
        data = json.loads(sse.data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    try:
        return _task(data)
    except _Unreadable:
        return None


def _cancel_call(service: str, task_id: str) -> _Call:
    return _Call("POST", f"{_task_path(service, task_id)}/cancel")


def _get_call(service: str, task_id: str) -> _Call:
    return _Call("GET", _task_path(service, task_id))


class _Unreadable(ValueError):
    """A `data` whose shape the SDK cannot read; the message says what is wrong."""


def _retry_after(response: httpx.Response) -> float | None:
    """`Retry-After` in seconds; None when absent or not a number of seconds (a date)."""
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _unexpected(response: httpx.Response, what: str) -> ConveyorError:
    return ConveyorError(
        response.status_code,
        0,
        f"unexpected answer from the gateway: {what}",
        retry_after=_retry_after(response),
    )


def _not_an_envelope(response: httpx.Response) -> ConveyorError:
    return _unexpected(response, response.text.strip()[:200] or response.reason_phrase)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _unwrap(response: httpx.Response) -> dict[str, Any]:
    """Returns the envelope's `data`, or raises the envelope's error."""
    try:
        envelope = response.json()
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
    if not isinstance(data, dict):
        raise _Unreadable(f"a task that is not an object: {str(data)[:100]}")
    return Submitted(_task_id(data), _position(data), created)


def _parse_submitted(response: httpx.Response) -> Submitted:
    try:
        return _submitted(_unwrap(response), response.status_code == 201)
    except _Unreadable as exc:
        raise _unexpected(response, str(exc)) from None


def _parse_batch(response: httpx.Response) -> list[Submitted]:
    created = response.status_code == 201
    tasks = _unwrap(response).get("tasks")
    try:
        if not isinstance(tasks, list):
            raise _Unreadable("tasks is not a list")
        return [_submitted(t, created) for t in tasks]
    except _Unreadable as exc:
        raise _unexpected(response, str(exc)) from None


def _parse_task(response: httpx.Response) -> Task:
    data = _unwrap(response)
    try:
        return _task(data)
    except _Unreadable as exc:
        raise _unexpected(response, str(exc)) from None


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

    def poll_timeout(self, timeout: float) -> httpx.Timeout:
        """The client's `timeout`, cut to the time left; TaskWaitTimeout once it is none."""
        left = self.left()
        if left is not None and left <= 0 and self.last is not None:
            raise TaskWaitTimeout(self.last)
        return httpx.Timeout(self._within(timeout))

    def stream_timeout(self, timeout: float) -> httpx.Timeout:
        """The client's `timeout` to connect; `STREAM_READ_TIMEOUT_S` to read (a quiet stream
        sends only a comment every heartbeat); both cut to the time left."""
        return httpx.Timeout(self._within(timeout), read=self._within(STREAM_READ_TIMEOUT_S))

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
        """After no answer or a 502/503/504: the pause (its Retry-After, else `interval`,
        within the deadline and the outage window), or `exc` once the window is over."""
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
        pause = min(pause, window_left)
        left = self.left()
        return pause if left is None else min(pause, left)

    def pause_after(self, task: Task) -> float:
        if self._deadline is None:
            return self._interval
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TaskWaitTimeout(task)
        return min(self._interval, left)


@dataclass(frozen=True)
class _Config:
    base_url: str
    client_id: str
    client_secret: str
    timeout: float

    @classmethod
    def from_env(cls, timeout: float) -> _Config:
        client_id = os.environ.get("CONVEYOR_CLIENT_ID", "")
        client_secret = os.environ.get("CONVEYOR_CLIENT_SECRET", "")
        if not client_id or not client_secret:
            raise ValueError("set CONVEYOR_CLIENT_ID and CONVEYOR_CLIENT_SECRET")
        base_url = os.environ.get("CONVEYOR_GATEWAY_URL") or DEFAULT_GATEWAY_URL
        return cls(base_url, client_id, client_secret, timeout)

    def httpx_options(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url.rstrip("/"),
            "auth": httpx.BasicAuth(self.client_id, self.client_secret),
            "timeout": self.timeout,
            "headers": {"User-Agent": f"conveyor-client/{__version__}"},
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
        self.config = _Config(base_url, client_id, client_secret, timeout)
        self._http = httpx.Client(transport=transport, **self.config.httpx_options())

    def _send(self, call: _Call, timeout: httpx.Timeout | None = None) -> httpx.Response:
        return self._http.request(
            call.method,
            call.path,
            json=call.json,
            headers=call.headers,
            timeout=_DEFAULT if timeout is None else timeout,  # None: the client's own
        )

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
        return _parse_task(self._send(_get_call(service, task_id)))

    def cancel(self, service: str, task_id: str) -> Task:
        """FAILURE `Task cancelled.` (SPEC §11.1); idempotent; ConveyorError 409001 if it
        had already finished otherwise."""
        return _parse_task(self._send(_cancel_call(service, task_id)))

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
        if not (yield from self._stream(service, task_id, pacer)):
            yield from self._poll(service, task_id, pacer)

    def _stream(self, service: str, task_id: str, pacer: _Pacer) -> Generator[Task, None, bool]:
        """Yields the stream's states; returns True once the last was terminal, False when
        polling is to go on (no stream, or it broke: the gateway went away)."""
        opening = pacer.stream_timeout(self.config.timeout)
        try:
            with connect_sse(
                self._http, "GET", _events_path(service, task_id), timeout=opening
            ) as source:
                if not _is_stream(source.response):
                    source.response.read()
                if _stream_refused(source.response):
                    return False
                # A quiet stream still sends comments, so no read timeout ends it: at the
                # deadline its socket is shut down, which ends the blocked read at once.
                left = pacer.left()
                deadline = None if left is None else _StreamDeadline(source.response, left)
                try:
                    for sse in source.iter_sse():
                        task = _stream_task(sse)
                        if task is not None and pacer.seen(task):
                            yield task
                            if task.done:
                                return True
                except (httpx.StreamError, httpx.TransportError) as exc:
                    if deadline is None or not deadline.passed.is_set():
                        raise
                    if pacer.last is None:
                        return False  # cut before its first event: one last poll gets it
                    raise TaskWaitTimeout(pacer.last) from exc
                finally:
                    if deadline is not None:
                        deadline.cancel()
                if pacer.last is not None and deadline is not None:
                    if deadline.passed.is_set():
                        raise TaskWaitTimeout(pacer.last)
        except (httpx.StreamError, httpx.TransportError) as exc:
            pacer.give_up_at_deadline(exc)  # else the gateway went away: polling rides it out
        except ConveyorError as exc:
            if not exc.unavailable:
                raise
            time.sleep(pacer.pause_after_outage(exc))
        return False

    def _poll(self, service: str, task_id: str, pacer: _Pacer) -> Iterator[Task]:
        while True:
            call = _get_call(service, task_id)
            try:
                task = _parse_task(self._send(call, pacer.poll_timeout(self.config.timeout)))
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
        self.config = _Config(base_url, client_id, client_secret, timeout)
        self._http = httpx.AsyncClient(transport=transport, **self.config.httpx_options())

    async def _send(self, call: _Call, timeout: httpx.Timeout | None = None) -> httpx.Response:
        return await self._http.request(
            call.method,
            call.path,
            json=call.json,
            headers=call.headers,
            timeout=_DEFAULT if timeout is None else timeout,  # None: the client's own
        )

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
        return _parse_task(await self._send(_get_call(service, task_id)))

    async def cancel(self, service: str, task_id: str) -> Task:
        """FAILURE `Task cancelled.` (SPEC §11.1); idempotent; ConveyorError 409001 if it
        had already finished otherwise."""
        return _parse_task(await self._send(_cancel_call(service, task_id)))

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
        left = pacer.left()
        deadline = None if left is None else asyncio.get_running_loop().time() + left
        opening = pacer.stream_timeout(self.config.timeout)
        try:
            async with aconnect_sse(
                self._http, "GET", _events_path(service, task_id), timeout=opening
            ) as source:
                if not _is_stream(source.response):
                    await source.response.aread()
                if not _stream_refused(source.response):
                    try:
                        async with asyncio.timeout_at(deadline):
                            async for sse in source.aiter_sse():
                                task = _stream_task(sse)
                                if task is not None and pacer.seen(task):
                                    yield task
                                    if task.done:
                                        return
                    except TimeoutError:
                        if pacer.last is not None:
                            raise TaskWaitTimeout(pacer.last) from None
                        # cut before its first event: one last poll below gets it
        except (httpx.StreamError, httpx.TransportError) as exc:
            pacer.give_up_at_deadline(exc)  # else the gateway went away: polling rides it out
        except ConveyorError as exc:
            if not exc.unavailable:
                raise
            await asyncio.sleep(pacer.pause_after_outage(exc))
        while True:
            call = _get_call(service, task_id)
            try:
                answer = await self._send(call, pacer.poll_timeout(self.config.timeout))
                task = _parse_task(answer)
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
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
