"""A task followed as it changes (SPEC §11.3): Server-Sent Events fed by PostgreSQL NOTIFY.

Migration 0004's trigger sends `conveyor_task` with the task's id whenever its status or
progress changes, on whichever replica made the change; this replica's one listening
connection (`gateway.listener`) wakes the streams following that id, and each re-reads its
task and sends an event if the status or the progress moved. A stream registers before its
first read, so nothing between the read and the first notification is missed; while the
listening connection is down (a database restart), streams re-read their task every second
instead, and all of them re-read once it is back. A quiet stream also re-reads its task at
every heartbeat: a purged row sends no notification. A task that can no longer be read (purged,
its service deleted, the client's grant revoked) ends the stream with an `event: error` whose
data is the poll's error envelope, rather than an end a client cannot tell from a cut. A client
that goes away ends its generator,
which unregisters it: nothing is kept per closed stream. A gateway that stops (a deploy, a
scale-in) ends each stream properly after a `retry` line, rather than cutting it mid-answer:
an EventSource then reconnects, to another replica, and the SDK polls.

Event ids come from the task row, not from the connection, so that they go on increasing when a
client reconnects (SPEC §11.3): twice the row's `updated_at` in microseconds since the epoch
(every change of status or progress sets it), plus 1 for a terminal state. A reconnecting
client's `Last-Event-ID` then says which state it saw last: the current state is not sent again
when its id is not above that one, and a terminal state already seen (an odd id) ends the stream
at once. The last bit keeps a terminal state from being taken for seen when its `updated_at`
is not above an earlier change's (it is the start of the transaction that wrote it, which may
have waited for the row behind a later one). The ids a client receives always increase, within
a stream and from one connection to the next (an id not above the previous one is raised past
it). The row's version is read before the poll's read, so an event's id never belongs to a later
state than its data (at worst a state is sent twice across a reconnection, never skipped), and
once more after a terminal one, which is final: its id is exact. A Last-Event-ID that is not a
decimal integer, or that is above any id the task was given (from its future), is ignored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import psycopg
from sse_starlette import ServerSentEvent

from conveyor import logs, strict_json
from gateway import access_cache, errors, metrics
from gateway.listener import Listener
from gateway.pgpool import CONNECTION_ERRORS, Pool

log = logging.getLogger("conveyor.gateway.task_events")

CHANNEL = "conveyor_task"
TERMINAL = ("SUCCESS", "FAILURE")
UNHEARD_POLL = 1.0  # seconds between re-reads while notifications cannot be heard
RECONNECT_MS = 1000  # the `retry` a stopping gateway leaves its streams with
# The row's version, for the events' ids: every change of status or progress sets `updated_at`.
_VERSION = "SELECT updated_at FROM tasks WHERE task_id = CAST(%(task_id)s AS uuid)"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_MAX_ID_DIGITS = 19  # a Last-Event-ID longer than any id this module gives is not one of them
# An id this far above the task's current one was never given for it (ids are its versions,
# at most a few above when raised): an hour, far beyond any transaction's start skew.
_AHEAD = 2 * 3600 * 1_000_000

Read = Callable[[], Awaitable[dict[str, Any]]]


class TaskEvents:
    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self._following: dict[str, set[asyncio.Event]] = {}
        listener.subscribe(CHANNEL, self._changed, on_connected=self._reconnected)
        # A grant revoked or a client deleted: every stream reads again, which checks its
        # client's access first, and ends the ones that lost it.
        listener.subscribe(access_cache.CHANNEL, lambda _: self._wake_all())

    @property
    def open(self) -> int:
        return sum(len(events) for events in self._following.values())

    def _changed(self, task_id: str) -> None:
        for event in self._following.get(task_id, ()):
            event.set()

    async def _reconnected(self, _conn: psycopg.AsyncConnection[Any]) -> None:
        """Changes made while nobody listened were not heard: every stream reads again."""
        self._wake_all()

    def _wake_all(self) -> None:
        for events in self._following.values():
            for event in events:
                event.set()

    @contextmanager
    def following(self, task_id: str) -> Iterator[asyncio.Event]:
        event = asyncio.Event()
        self._following.setdefault(task_id, set()).add(event)
        metrics.EVENT_STREAMS.inc()
        try:
            yield event
        finally:
            metrics.EVENT_STREAMS.dec()
            events = self._following.get(task_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._following[task_id]

    async def stream(
        self,
        task_id: str,
        read: Read,
        stopping: anyio.Event,
        pool: Pool,
        last_event_id: str | None = None,
        recheck: float | None = None,
    ) -> AsyncIterator[dict[str, str] | ServerSentEvent]:
        """The events of one task until it ends: the current state first (unless the client's
        `last_event_id` says it has it), then each change of status or progress, with ids
        that increase across connections; or until `stopping` (the server shuts down), with
        a last line that tells the client when to reconnect."""

        async def current() -> tuple[int, dict[str, Any]]:
            # Read whole even when the client goes meanwhile (the stream's task group then
            # cancels at every await): cancelled again while psycopg cancelled the query on
            # the server, the pooled connection was closed and a new backend opened. The
            # pool's DB_TIMEOUT bounds the read; the stream ends at its next await.
            with anyio.CancelScope(shield=True):
                before = await _version(pool, task_id)  # the data is this state or a later one
                data = await read()
                terminal = data["status"] in TERMINAL
                if terminal:  # final: its version is exact once read after it
                    before = await _version(pool, task_id) or before
            return _id(before, terminal), data

        with self.following(task_id) as changed:
            waking = asyncio.create_task(_set_when(stopping, changed))
            try:
                try:
                    number, data = await current()
                except errors.ApiError as exc:  # gone since the endpoint's own check
                    yield _error(exc)
                    return
                seen = _last_event_id(last_event_id)
                if seen is not None and seen > number + _AHEAD:
                    seen = None  # from this task's future: not an id it was ever given
                if seen is None:
                    yield _event(number, data)
                elif not _already_seen(number, seen):
                    number = _above(seen, number)  # increasing as the client sees them too
                    yield _event(number, data)
                elif data["status"] in TERMINAL:
                    return  # the client has the end already
                else:
                    number = max(number, seen)
                while data["status"] not in TERMINAL:
                    wait = recheck if self.listener.listening else UNHEARD_POLL
                    await _wait(changed, wait)
                    changed.clear()
                    if stopping.is_set():
                        yield ServerSentEvent(retry=RECONNECT_MS, comment="the gateway stops")
                        return
                    try:
                        fresh_id, fresh = await current()
                    except errors.ApiError as exc:  # purged, or access lost meanwhile
                        yield _error(exc)
                        return
                    except CONNECTION_ERRORS as exc:  # the database is away: retry, slowly
                        log.info("task stream could not read", extra={"error": logs.describe(exc)})
                        await _wait(changed, UNHEARD_POLL)
                        continue
                    if (fresh["status"], fresh["progress"]) != (data["status"], data["progress"]):
                        data = fresh
                        number = _above(number, fresh_id)
                        yield _event(number, data)
            finally:
                waking.cancel()


async def _version(pool: Pool, task_id: str) -> datetime | None:
    async with pool.connection() as conn:
        row = await (await conn.execute(_VERSION, {"task_id": task_id})).fetchone()
    return None if row is None else row.updated_at


def _id(version: datetime | None, terminal: bool) -> int:
    """Twice the version in microseconds since the epoch (about 3.5e15 today: an integer
    that JavaScript holds exactly until 2112), plus 1 for a terminal state."""
    micros = 0 if version is None else (version - _EPOCH) // _MICROSECOND
    return 2 * micros + int(terminal)


def _above(previous: int, wanted: int) -> int:
    """`wanted`, or if it is not above `previous`, the next id above it that says the same
    (terminal or not, by its last bit)."""
    if wanted > previous:
        return wanted
    following = previous + 1
    return following if following % 2 == wanted % 2 else following + 1


def _already_seen(number: int, seen: int) -> bool:
    """Whether a client whose last event had id `seen` has the state of id `number`: a
    terminal state only if what it saw was terminal too (one per task, the last)."""
    return number <= seen and (number % 2 == 0 or seen % 2 == 1)


def _last_event_id(raw: str | None) -> int | None:
    """The client's `Last-Event-ID` as one of our ids; None when absent or unparsable."""
    if raw is None:
        return None
    text = raw.strip()
    if not text.isascii() or not text.isdigit() or len(text) > _MAX_ID_DIGITS:
        return None
    return int(text)


async def _wait(changed: asyncio.Event, seconds: float | None) -> None:
    try:
        await asyncio.wait_for(changed.wait(), seconds)
    except TimeoutError:
        pass


async def _set_when(stopping: anyio.Event, changed: asyncio.Event) -> None:
    await stopping.wait()
    changed.set()


def _error(exc: errors.ApiError) -> dict[str, str]:
    """The stream's last event when its task can no longer be read: the poll's envelope."""
    return {"event": "error", "data": strict_json.dumps(exc.envelope()).decode()}


def _event(number: int, data: dict[str, Any]) -> dict[str, str]:
    return {"event": "task", "id": str(number), "data": strict_json.dumps(data).decode()}
