"""What is in flight: handler tasks, their abort tokens, and orphaned deliveries.

`InFlight` is what a shutdown settles (shutdown.py): it counts the handler
tasks, aborts their calls on request and says when they are all done.

`Orphans` is what a reconnection leaves behind: deliveries whose channel died
while this process was still working on them.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any, Protocol

from dispatcher.consumer import Delivery
from dispatcher.metrics import Metrics
from dispatcher.shutdown import AbortToken


class Attempt(Protocol):
    """What `Orphans` reads of a run (the worker's `Attempt`)."""

    delivery: Delivery
    done: asyncio.Event
    confirmed: bool

    @property
    def task_id(self) -> str: ...


class InFlight:
    """The handler tasks running now, and the abort tokens of their calls."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()
        self._tokens: set[AbortToken] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.aborting = False

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        self._idle.clear()
        self._metrics.in_flight.inc()
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._metrics.in_flight.dec()
        if not self._tasks:
            self._idle.set()

    def token(self) -> AbortToken:
        token = AbortToken()
        if self.aborting:
            token.abort()
        self._tokens.add(token)
        return token

    def forget(self, token: AbortToken) -> None:
        self._tokens.discard(token)

    def abort_all(self) -> None:
        self.aborting = True
        for token in self._tokens:
            token.abort()

    async def wait_idle(self, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


class Orphans:
    """Deliveries cut off by a connection loss, so that a redelivery does not run twice.

    After a reconnection the broker redelivers every message the old channel
    held unacked, while this process may still be running those very tasks, or
    may just have confirmed their terminal event without being able to ack.
    A redelivery of such a task waits for the run in progress; when this
    process confirmed the task's terminal event, it is acked without calling
    the function again.
    """

    LIMIT = 10_000

    def __init__(self) -> None:
        self._running: dict[str, Attempt] = {}
        self._confirmed: OrderedDict[str, None] = OrderedDict()

    def started(self, attempt: Attempt) -> None:
        self._running[attempt.task_id] = attempt

    def ended(self, attempt: Attempt) -> None:
        attempt.done.set()
        if self._running.get(attempt.task_id) is attempt:
            del self._running[attempt.task_id]
        if attempt.confirmed and not attempt.delivery.valid:
            self._confirmed[attempt.task_id] = None
            while len(self._confirmed) > self.LIMIT:
                self._confirmed.popitem(last=False)

    async def finished_here(self, task_id: str) -> bool:
        earlier = self._running.get(task_id)
        if earlier is not None and not earlier.delivery.valid:
            await earlier.done.wait()
        if task_id in self._confirmed:
            del self._confirmed[task_id]
            return True
        return False
