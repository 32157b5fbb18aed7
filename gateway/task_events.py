"""A task followed as it changes (SPEC §11.3): Server-Sent Events fed by PostgreSQL NOTIFY.

Migration 0004's trigger sends `conveyor_task` with the task's id whenever its status or
progress changes, on whichever replica made the change; this replica's one listening
connection (`gateway.listener`) wakes the streams following that id, and they send an event if
the status or the progress moved. A stream registers before its first read, so nothing between
the read and the first notification is missed; while the listening connection is down (a
database restart), streams re-read their task every second instead, and all of them re-read
once it is back. A quiet stream also re-reads its task at every heartbeat: a purged row sends no
notification. A task that can no longer be read (purged, its service deleted, the client's grant
revoked) ends the stream with an `event: error` whose data is the poll's error envelope, rather
than an end a client cannot tell from a cut. A client that goes away ends its generator, which
unregisters it: nothing is kept per closed stream. A gateway that stops (a deploy, a scale-in)
ends each stream properly after a `retry` line, rather than cutting it mid-answer: an
EventSource then reconnects, to another replica, and the SDK polls.

The streams of one task share its reads (`_Task`): a change read once serves all of them, not
once per stream (50 streams on a task made each change 50 reads, and a burst of streams took the
whole pool from the API and the loops). One read of a task is under way at a time, numbered; a
stream woken by a change takes the first read that started after the change was heard, one
woken by its heartbeat the first after the read it last used. The streams of this process read
through a share of the pool (`_share`), whatever their number: the API and the loops always
find connections, and streams wait their turn. A database that is away or too busy (a pool
timeout) never ends a stream, the first read included: it reads again a second later, pinged
meanwhile. Only one client can read a task, through one service and one grant, so a read led by
any of its streams (its `read`: that stream's credentials, the grant, then the task) serves
them all, as to what the database says; but each stream checks its own credentials (its
`check`, in memory while the credential cache holds them) before it takes a read another led,
so that a secret changed since it opened ends it alone, whichever stream leads (the change's
notification wakes every stream and empties that cache: gateway.credentials); it was checked
only when it led, once in as many reads as its task had streams. Leading rotates (the least recent leads the next read). A refusal (403001, 404001,
404002) is the verdict of the stream that led it: each other stream then leads a read of its
own before it takes one.

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
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import psycopg
from sse_starlette import ServerSentEvent

from conveyor import logs, strict_json
from gateway import access_cache, credentials, errors, metrics
from gateway.listener import Listener
from gateway.pgpool import CONNECTION_ERRORS, Pool

log = logging.getLogger("conveyor.gateway.task_events")

CHANNEL = "conveyor_task"
TERMINAL = ("SUCCESS", "FAILURE")
UNHEARD_POLL = 1.0  # seconds between re-reads while notifications cannot be heard (or reads fail)
RECONNECT_MS = 1000  # the `retry` a stopping gateway leaves its streams with
POOL_SHARE = 4  # the streams of a process read through at most a quarter of its pool (at least 1)
# The row's version, for the events' ids: every change of status or progress sets `updated_at`.
_VERSION = "SELECT updated_at FROM tasks WHERE task_id = CAST(%(task_id)s AS uuid)"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_MAX_ID_DIGITS = 19  # a Last-Event-ID longer than any id this module gives is not one of them
# An id this far above the task's current one was never given for it (ids are its versions,
# at most a few above when raised): an hour, far beyond any transaction's start skew.
_AHEAD = 2 * 3600 * 1_000_000

Read = Callable[[], Awaitable[dict[str, Any]]]
Check = Callable[[], Awaitable[None]]


@dataclass(eq=False)
class _Follower:
    """One open stream: its own read (its client's credentials and access checked, then the
    task read: for all its task's streams when it leads), its own check of its credentials
    alone (before each read another led), and what wakes it."""

    read: Read
    check: Check
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    led: float = 0.0  # when it last led a read of its task: the least recent leads the next
    own: bool = False  # a read led by another was refused: it needs a verdict of its own


@dataclass(frozen=True)
class _Reading:
    """One read of a task: its state (the event's id and the poll's data), or what failed."""

    number: int
    leader: _Follower
    state: tuple[int, dict[str, Any]] | None = None
    error: Exception | None = None


@dataclass(eq=False)
class _Task:
    """What the streams of one task share: its reads, one under way at a time, numbered."""

    task_id: str
    followers: set[_Follower] = field(default_factory=set)
    started: int = 0  # reads started
    wanted: int = 0  # the first read that started after the last change was heard
    flight: asyncio.Task[None] | None = None  # the read under way, number `started`
    last: _Reading | None = None  # the read finished last

    def wake(self) -> None:
        self.wanted = self.started + 1
        for follower in self.followers:
            follower.changed.set()


class TaskEvents:
    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self._tasks: dict[str, _Task] = {}
        self._reads: asyncio.Semaphore | None = None  # sized from the pool at the first read
        # Lost: a stream waiting out its heartbeat would keep waiting (15 s of changes unsent,
        # found by a sweep); woken, each reads again and then re-reads every UNHEARD_POLL.
        listener.subscribe(
            CHANNEL, self._changed, on_connected=self._reconnected, on_lost=self._wake_all
        )
        # A grant revoked, a client deleted or its secret changed: every stream reads again,
        # which checks its client's credentials and access first, and ends the ones that
        # lost them.
        for channel in (access_cache.CHANNEL, credentials.CHANNEL):
            listener.subscribe(channel, lambda _: self._wake_all())

    @property
    def open(self) -> int:
        return sum(len(task.followers) for task in self._tasks.values())

    def _changed(self, task_id: str) -> None:
        task = self._tasks.get(task_id)
        if task is not None:
            task.wake()

    async def _reconnected(self, _conn: psycopg.AsyncConnection[Any]) -> None:
        """Changes made while nobody listened were not heard: every stream reads again."""
        self._wake_all()

    def _wake_all(self) -> None:
        for task in self._tasks.values():
            task.wake()

    @contextmanager
    def following(
        self, task_id: str, read: Read, check: Check
    ) -> Iterator[tuple[_Task, _Follower]]:
        task = self._tasks.get(task_id)
        if task is None:
            task = self._tasks[task_id] = _Task(task_id)
        me = _Follower(read, check)
        task.followers.add(me)
        metrics.EVENT_STREAMS.inc()
        try:
            yield task, me
        finally:
            metrics.EVENT_STREAMS.dec()
            task.followers.discard(me)
            if not task.followers and self._tasks.get(task_id) is task:
                del self._tasks[task_id]

    async def stream(
        self,
        task_id: str,
        read: Read,
        check: Check,
        stopping: anyio.Event,
        pool: Pool,
        last_event_id: str | None = None,
        recheck: float | None = None,
    ) -> AsyncIterator[dict[str, str] | ServerSentEvent]:
        """The events of one task until it ends: the current state first (unless the client's
        `last_event_id` says it has it), then each change of status or progress, with ids
        that increase across connections; or until `stopping` (the server shuts down), with
        a last line that tells the client when to reconnect. `read` checks the client's
        access and reads the task (for all its streams, when this one leads); `check` checks
        this stream's credentials alone, before it takes a read another stream led."""
        with self.following(task_id, read, check) as (task, me):
            waking = asyncio.create_task(_set_when(stopping, me.changed))
            try:
                seen = _last_event_id(last_event_id)
                data: dict[str, Any] | None = None  # the state the client has
                number = 0  # the id it has
                last = task.started  # reads started before this stream registered are too old
                need = last + 1
                while True:
                    reading = await self._read(task, me, need, pool, waking)
                    if reading is not None:
                        reading = await self._checked(reading, me, waking)
                    if reading is None:
                        yield ServerSentEvent(retry=RECONNECT_MS, comment="the gateway stops")
                        return
                    last, error = reading.number, reading.error
                    pause: float | None = UNHEARD_POLL
                    if isinstance(error, errors.ApiError):  # purged, or access lost meanwhile
                        yield _error(error)
                        return
                    if error is not None and not isinstance(error, CONNECTION_ERRORS):
                        raise error
                    if reading.state is not None:
                        fresh_id, fresh = reading.state
                        if data is None:  # the first state
                            if seen is not None and seen > fresh_id + _AHEAD:
                                seen = None  # from this task's future: not an id it was ever given
                            if seen is None:
                                number = fresh_id
                                yield _event(number, fresh)
                            elif not _already_seen(fresh_id, seen):
                                number = _above(seen, fresh_id)  # increasing as the client sees
                                yield _event(number, fresh)
                            elif fresh["status"] in TERMINAL:
                                return  # the client has the end already
                            else:
                                number = max(fresh_id, seen)
                            data = fresh
                        elif (fresh["status"], fresh["progress"]) != (
                            data["status"],
                            data["progress"],
                        ):
                            data = fresh
                            number = _above(number, fresh_id)
                            yield _event(number, data)
                        if data["status"] in TERMINAL:
                            return
                        pause = recheck if self.listener.listening else UNHEARD_POLL
                    # A heartbeat, or a retry after an error: the first read after this one.
                    need = last + 1
                    while True:
                        woken = await _wait(me.changed, pause)
                        me.changed.clear()
                        if stopping.is_set():
                            yield ServerSentEvent(retry=RECONNECT_MS, comment="the gateway stops")
                            return
                        if not woken or error is not None:
                            need = max(need, task.wanted)
                            break
                        need = task.wanted  # a change: the first read that started after it
                        if need > last:
                            break  # else the read this stream used had started after it
            finally:
                waking.cancel()

    async def _read(
        self, task: _Task, me: _Follower, need: int, pool: Pool, stopped: asyncio.Future[None]
    ) -> _Reading | None:
        """The first read of `task` numbered `need` or above that `me` may take: any, unless a
        read led by another stream was refused since; then one `me` led itself. A read is
        started only when none is under way: the streams waiting meanwhile share the next.
        None once `stopped` is done (the gateway stops): reads may queue for their share of
        the pool, and a stopping gateway ends its streams without waiting for them."""
        while True:
            last = task.last
            if last is not None and last.number >= need:
                if last.leader is me:
                    me.own = me.own and last.error is not None
                    return last
                if not me.own and not isinstance(last.error, errors.ApiError):
                    return last
                me.own = True  # another's refusal is not this stream's verdict
                need = last.number + 1
            if task.flight is None:
                task.started += 1
                leader = min(task.followers, key=lambda f: (not f.own, f.led))
                leader.led = time.monotonic()
                task.flight = asyncio.create_task(
                    self._lead(task, task.started, leader, pool), name="task stream read"
                )
            # Waited for, never cancelled: a stream whose client goes meanwhile leaves the read
            # to the others (cancelled mid-query, psycopg would cancel it on the server and the
            # pooled connection be closed).
            await asyncio.wait((task.flight, stopped), return_when=asyncio.FIRST_COMPLETED)
            if stopped.done():
                return None

    async def _checked(
        self, reading: _Reading, me: _Follower, stopped: asyncio.Future[None]
    ) -> _Reading | None:
        """`reading` as `me` may take it: a state another stream led is taken only once `me`'s
        own credentials pass its check (a refusal, or a database that is away, replaces the
        state, for `me` alone); the reads `me` led checked them already. The check is waited
        for, never cancelled (a client that goes away leaves it to finish, as a read). None
        once `stopped` is done."""
        if reading.leader is me or reading.state is None:
            return reading
        checking = asyncio.ensure_future(me.check())
        checking.add_done_callback(_retrieved)
        await asyncio.wait((checking, stopped), return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            return None
        failed = checking.exception()
        if failed is None:
            return reading
        if not isinstance(failed, Exception):
            raise failed
        if isinstance(failed, CONNECTION_ERRORS):  # its credentials' look-up: check again
            log.info("task stream could not check", extra={"error": logs.describe(failed)})
        return replace(reading, state=None, error=failed)

    async def _lead(self, task: _Task, number: int, leader: _Follower, pool: Pool) -> None:
        """Reads the task once for all its streams, with `leader`'s read, through the share of
        the pool that streams may hold; what failed is kept for the streams to judge."""
        try:
            async with self._share(pool):
                before = await _version(pool, task.task_id)  # the data is this state or later
                data = await leader.read()
                terminal = data["status"] in TERMINAL
                if terminal:  # final: its version is exact once read after it
                    before = await _version(pool, task.task_id) or before
            task.last = _Reading(number, leader, state=(_id(before, terminal), data))
        except Exception as exc:
            if isinstance(exc, CONNECTION_ERRORS):  # the database is away or busy: read again
                log.info("task stream could not read", extra={"error": logs.describe(exc)})
            task.last = _Reading(number, leader, error=exc)
        finally:
            task.flight = None

    def _share(self, pool: Pool) -> asyncio.Semaphore:
        """How many reads all streams of this process make at once: a quarter of the pool, so
        that however many streams are open, the API and the loops find connections."""
        if self._reads is None:
            self._reads = asyncio.Semaphore(max(1, pool.size // POOL_SHARE))
        return self._reads


async def has_the_end(pool: Pool, task_id: str, last_event_id: str | None) -> bool:
    """Whether a client reconnecting to a finished task with `last_event_id` has its terminal
    state already (the test the stream makes first, read once). The route then answers 204,
    which tells a browser's EventSource to stop: an empty 200 ended the stream, and the
    EventSource reconnected every few seconds for as long as its page stayed open."""
    seen = _last_event_id(last_event_id)
    if seen is None:
        return False
    final = _id(await _version(pool, task_id), terminal=True)
    return seen <= final + _AHEAD and _already_seen(final, seen)


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


async def _wait(changed: asyncio.Event, seconds: float | None) -> bool:
    """Whether `changed` was set within `seconds` (None: no limit)."""
    try:
        await asyncio.wait_for(changed.wait(), seconds)
    except TimeoutError:
        return False
    return True


def _retrieved(done: asyncio.Future[None]) -> None:
    """A check left to finish after its stream ended: what it raised is nobody's concern."""
    if not done.cancelled():
        done.exception()


async def _set_when(stopping: anyio.Event, changed: asyncio.Event) -> None:
    await stopping.wait()
    changed.set()


def _error(exc: errors.ApiError) -> dict[str, str]:
    """The stream's last event when its task can no longer be read: the poll's envelope."""
    return {"event": "error", "data": strict_json.dumps(exc.envelope()).decode()}


def _event(number: int, data: dict[str, Any]) -> dict[str, str]:
    return {"event": "task", "id": str(number), "data": strict_json.dumps(data).decode()}
