"""A task followed as it changes (SPEC §11.3): Server-Sent Events fed by PostgreSQL NOTIFY.

Migration 0004's trigger sends `conveyor_task` with the task's id whenever its status or
progress changes, on whichever replica made the change; this replica's one listening
connection (`gateway.listener`) wakes the streams following that id, and each re-reads its
task and sends an event if the status or the progress moved. A stream registers before its
first read, so nothing between the read and the first notification is missed; while the
listening connection is down (a database restart), streams re-read their task every second
instead, and all of them re-read once it is back. A client that goes away ends its generator,
which unregisters it: nothing is kept per closed stream. A gateway that stops (a deploy, a
scale-in) ends each stream properly after a `retry` line, rather than cutting it mid-answer:
an EventSource then reconnects, to another replica, and the SDK polls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import psycopg
from sse_starlette import ServerSentEvent

from conveyor import strict_json
from gateway import errors, metrics
from gateway.listener import Listener
from gateway.pgpool import CONNECTION_ERRORS

log = logging.getLogger("conveyor.gateway.task_events")

CHANNEL = "conveyor_task"
TERMINAL = ("SUCCESS", "FAILURE")
UNHEARD_POLL = 1.0  # seconds between re-reads while notifications cannot be heard
RECONNECT_MS = 1000  # the `retry` a stopping gateway leaves its streams with

Read = Callable[[], Awaitable[dict[str, Any]]]


class TaskEvents:
    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self._following: dict[str, set[asyncio.Event]] = {}
        listener.subscribe(CHANNEL, self._changed, on_connected=self._reconnected)

    @property
    def open(self) -> int:
        return sum(len(events) for events in self._following.values())

    def _changed(self, task_id: str) -> None:
        for event in self._following.get(task_id, ()):
            event.set()

    async def _reconnected(self, _conn: psycopg.AsyncConnection[Any]) -> None:
        """Changes made while nobody listened were not heard: every stream reads again."""
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
        self, task_id: str, read: Read, stopping: anyio.Event
    ) -> AsyncIterator[dict[str, str] | ServerSentEvent]:
        """The events of one task until it ends: the current state first, then each change
        of status or progress, with increasing ids; or until `stopping` (the server shuts
        down), with a last line that tells the client when to reconnect."""
        with self.following(task_id) as changed:
            waking = asyncio.create_task(_set_when(stopping, changed))
            try:
                data = await read()
                number = 1
                yield _event(number, data)
                while data["status"] not in TERMINAL:
                    wait = None if self.listener.listening else UNHEARD_POLL
                    await _wait(changed, wait)
                    changed.clear()
                    if stopping.is_set():
                        yield ServerSentEvent(retry=RECONNECT_MS, comment="the gateway stops")
                        return
                    try:
                        fresh = await read()
                    except errors.ApiError:
                        return  # purged, or access revoked meanwhile: the stream just ends
                    except CONNECTION_ERRORS as exc:  # the database is away: retry, slowly
                        log.info("task stream could not read", extra={"error": repr(exc)})
                        await _wait(changed, UNHEARD_POLL)
                        continue
                    if (fresh["status"], fresh["progress"]) != (data["status"], data["progress"]):
                        data = fresh
                        number += 1
                        yield _event(number, data)
            finally:
                waking.cancel()


async def _wait(changed: asyncio.Event, seconds: float | None) -> None:
    try:
        await asyncio.wait_for(changed.wait(), seconds)
    except TimeoutError:
        pass


async def _set_when(stopping: anyio.Event, changed: asyncio.Event) -> None:
    await stopping.wait()
    changed.set()


def _event(number: int, data: dict[str, Any]) -> dict[str, str]:
    return {"event": "task", "id": str(number), "data": strict_json.dumps(data).decode()}
