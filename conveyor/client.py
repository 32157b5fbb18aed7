"""Python client SDK for the Conveyor gateway (SPEC §3).

Consumers can speak plain HTTP to the gateway; this module saves them the
envelope handling, Basic auth and polling loop, in a sync and an async flavour:

    with ConveyorClient.from_env() as client:
        submitted = client.submit("sleeper", {"sleep": 5})
        task = client.wait("sleeper", submitted.task_id, timeout=60)

Both flavours share the request building and response parsing below; only the
I/O differs. API errors raise `ConveyorError`; network failures raise httpx's own
`httpx.TransportError` subclasses unchanged, except while `follow` or `wait` waits: they
ride out a gateway unreachable for up to `OUTAGE_WINDOW_S` (a restart, a rolling deploy),
polling meanwhile, and raise only after that.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Self
from urllib.parse import quote

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse, connect_sse

from conveyor import __version__

DEFAULT_GATEWAY_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_POLL_INTERVAL_S = 0.5
TERMINAL_STATUSES = frozenset({"SUCCESS", "FAILURE"})
OUTAGE_WINDOW_S = 30.0


class ConveyorError(Exception):
    """The gateway answered with an error envelope (or something that is not an envelope)."""

    def __init__(
        self,
        http_status: int,
        number: int,
        description: str,
        errors: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(f"{number} {description}")
        self.http_status = http_status
        self.number = number
        self.description = description
        self.errors = errors or []


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


def _tasks_path(service: str) -> str:
    return f"/v1/services/{quote(service, safe='')}/tasks"


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
    payload = item
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    return _Call("POST", _tasks_path(service), payload, headers)


def _batch_call(service: str, tasks: list[dict[str, Any]], idempotency_key: str | None) -> _Call:
    """`tasks`: items as the API takes them (`task_item`), `{"body": {...}, ...}`."""
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    return _Call("POST", f"{_tasks_path(service)}/batch", {"tasks": tasks}, headers)


def _events_path(service: str, task_id: str) -> str:
    return f"{_tasks_path(service)}/{quote(task_id, safe='')}/events"


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
    if sse.event != "task":
        return None
    try:
        data = json.loads(sse.data)
    except ValueError:
        return None
    return _task(data) if isinstance(data, dict) else None


def _cancel_call(service: str, task_id: str) -> _Call:
    return _Call("POST", f"{_tasks_path(service)}/{quote(task_id, safe='')}/cancel")


def _get_call(service: str, task_id: str) -> _Call:
    return _Call("GET", f"{_tasks_path(service)}/{quote(task_id, safe='')}")


def _not_an_envelope(response: httpx.Response) -> ConveyorError:
    text = response.text.strip()[:200] or response.reason_phrase
    return ConveyorError(response.status_code, 0, f"unexpected answer from the gateway: {text}")


def _unwrap(response: httpx.Response) -> dict[str, Any]:
    """Returns the envelope's `data`, or raises the envelope's error."""
    try:
        envelope = response.json()
    except ValueError:
        raise _not_an_envelope(response) from None
    if not isinstance(envelope, dict):
        raise _not_an_envelope(response)
    if envelope.get("status") == "success" and isinstance(envelope.get("data"), dict):
        return envelope["data"]
    error = envelope.get("error")
    if envelope.get("status") != "error" or not isinstance(error, dict):
        raise _not_an_envelope(response)
    raise ConveyorError(
        response.status_code,
        int(error.get("number") or 0),
        str(error.get("description") or ""),
        error.get("errors") or [],
    )


def _parse_date(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _parse_submitted(response: httpx.Response) -> Submitted:
    data = _unwrap(response)
    return Submitted(
        task_id=str(data["taskId"]),
        position=data.get("taskPosition"),
        created=response.status_code == 201,
    )


def _parse_batch(response: httpx.Response) -> list[Submitted]:
    created = response.status_code == 201
    return [
        Submitted(str(t["taskId"]), t.get("taskPosition"), created)
        for t in _unwrap(response)["tasks"]
    ]


def _parse_task(response: httpx.Response) -> Task:
    return _task(_unwrap(response))


def _task(data: dict[str, Any]) -> Task:
    return Task(
        task_id=str(data["taskId"]),
        status=str(data["status"]),
        task_position=data.get("taskPosition"),
        submition_date=_parse_date(data.get("submitionDate")),
        start_date=_parse_date(data.get("startDate")),
        end_date=_parse_date(data.get("endDate")),
        progress=float(data.get("progress") or 0.0),
        response=data.get("response"),
        error_message=data.get("errorMessage"),
        raw=data,
        not_before=_parse_date(data.get("notBefore")),
    )


class _Pacer:
    """The polling schedule shared by both flavours: how long to pause, when to give up, and
    how long the gateway may stay unreachable before its transport error is raised."""

    def __init__(self, timeout: float | None, interval: float) -> None:
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._interval = interval
        self._unreachable_since: float | None = None
        self.last: Task | None = None  # the last state seen, stream or poll

    def seen(self, task: Task) -> bool:
        """Records `task`; whether it is news (a poll after the stream may repeat its last)."""
        new = self.last is None or task.raw != self.last.raw
        self.last = task
        self._unreachable_since = None
        return new

    def pause_after_outage(self, exc: httpx.TransportError) -> float:
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
        if now - self._unreachable_since >= OUTAGE_WINDOW_S:
            raise exc
        if self._deadline is None:
            return self._interval
        left = self._deadline - now
        if left <= 0:
            if self.last is None:
                raise exc
            raise TaskWaitTimeout(self.last) from exc
        return min(self._interval, left)

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

    def _send(self, call: _Call) -> httpx.Response:
        return self._http.request(call.method, call.path, json=call.json, headers=call.headers)

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
        gateway without one, or once the stream broke (the gateway restarted). Raises
        TaskWaitTimeout after `timeout` seconds."""
        pacer = _Pacer(timeout, interval)
        try:
            with connect_sse(self._http, "GET", _events_path(service, task_id)) as source:
                if not _is_stream(source.response):
                    source.response.read()
                if not _stream_refused(source.response):
                    # A quiet stream still sends comments, so no read timeout ends it: at the
                    # deadline its socket is shut down, which ends the blocked read at once.
                    deadline = (
                        None if timeout is None else _StreamDeadline(source.response, timeout)
                    )
                    try:
                        for sse in source.iter_sse():
                            task = _stream_task(sse)
                            if task is not None and pacer.seen(task):
                                yield task
                                if task.done:
                                    return
                    except (httpx.StreamError, httpx.TransportError) as exc:
                        if deadline is not None and deadline.passed.is_set() and pacer.last:
                            raise TaskWaitTimeout(pacer.last) from exc
                        raise
                    finally:
                        if deadline is not None:
                            deadline.cancel()
                    if pacer.last is not None and deadline is not None:
                        if deadline.passed.is_set():
                            raise TaskWaitTimeout(pacer.last)
        except (httpx.StreamError, httpx.TransportError):
            pass  # the gateway went away: polling rides the outage out
        yield from self._poll(service, task_id, pacer)

    def _poll(self, service: str, task_id: str, pacer: _Pacer) -> Iterator[Task]:
        while True:
            try:
                task = self.get(service, task_id)
            except httpx.TransportError as exc:
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
        """Polls until the task ends; raises TaskWaitTimeout after `timeout` seconds."""
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

    async def _send(self, call: _Call) -> httpx.Response:
        return await self._http.request(
            call.method, call.path, json=call.json, headers=call.headers
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

    async def follow(
        self,
        service: str,
        task_id: str,
        timeout: float | None = None,
        interval: float = DEFAULT_POLL_INTERVAL_S,
    ) -> AsyncIterator[Task]:
        """Yields the task as it changes, the last one being SUCCESS or FAILURE: from the
        gateway's event stream (SPEC §11.3), or by polling every `interval` seconds from a
        gateway without one, or once the stream broke (the gateway restarted). Raises
        TaskWaitTimeout after `timeout` seconds."""
        pacer = _Pacer(timeout, interval)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            async with aconnect_sse(self._http, "GET", _events_path(service, task_id)) as source:
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
                        if pacer.last is None:
                            raise
                        raise TaskWaitTimeout(pacer.last) from None
        except (httpx.StreamError, httpx.TransportError):
            pass  # the gateway went away: polling rides the outage out
        while True:
            try:
                task = await self.get(service, task_id)
            except httpx.TransportError as exc:
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
        """Polls until the task ends; raises TaskWaitTimeout after `timeout` seconds."""
        async for task in self.follow(service, task_id, timeout, interval):
            last = task
        return last

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
