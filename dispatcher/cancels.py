"""Cancelled tasks as this dispatcher heard of them (SPEC §11.1), for a bounded time.

The gateway broadcasts each cancel on the service's `<queue>-control` fanout exchange; every
dispatcher binds an exclusive, auto-delete queue of its own to it (`consumer.Broker`). A cancel
aborts the call of that task running here, if any (the function sees its connection closed),
and the worker then acks the message without retrying and without an event: the task is
already FAILURE in the database, and a later result would be ignored there (terminal wins).
A message of a cancelled task that arrives afterwards (it was queued, or requeued by another
dispatcher's shutdown) is acked without a call.

A dispatcher that was not there for a broadcast (started after it, or reconnecting after an
outage) reads the cancels the service's `<queue>-cancels` stream kept (`main.py`); while it
does, deliveries wait for it before they are called (`up_to_date`).

The memory is bounded in time (`CANCEL_MEMORY_SECONDS`, longer than a task may wait in the
queue and run) and in size: a dispatcher forgets, and may then call the function for a
cancelled task; its result is then ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from datetime import datetime, timedelta

from dispatcher.shutdown import AbortToken

MAX_REMEMBERED = 100_000
RECALL_OVERLAP = timedelta(minutes=1)


def recall_since(missed_from: datetime | None, memory_seconds: float, now: datetime) -> datetime:
    """Where to read the cancel log from: at a start (None), all the memory holds; after an
    outage, a minute before the first cancel that may have been missed (clocks differ), never
    older than the memory."""
    memory = now - timedelta(seconds=memory_seconds)
    if missed_from is None:
        return memory
    return max(memory, min(missed_from - RECALL_OVERLAP, now))


class Cancels:
    def __init__(self, memory_seconds: float, max_remembered: int = MAX_REMEMBERED) -> None:
        self.memory_seconds = memory_seconds
        self.max_remembered = max_remembered
        self._until: OrderedDict[str, float] = OrderedDict()  # task id -> forget after
        self._running: dict[str, set[AbortToken]] = {}
        self._current = asyncio.Event()  # cleared while cancels missed are being read
        self._current.set()

    def __len__(self) -> int:
        self._forget_old()
        return len(self._until)

    def heard(self, task_id: str) -> int:
        """A cancel arrived: remember it, abort its calls running here; how many."""
        self._until[task_id] = time.monotonic() + self.memory_seconds
        self._until.move_to_end(task_id)
        self._forget_old()
        tokens = self._running.get(task_id, set())
        for token in tokens:
            token.abort()
        return len(tokens)

    def recalling(self) -> None:
        """Cancels may have been missed (an outage): deliveries wait until `recalled`."""
        self._current.clear()

    def recalled(self) -> None:
        self._current.set()

    async def up_to_date(self, patience: float = 10.0) -> None:
        """Bounded: a connection that does not come back leaves its deliveries invalid anyway,
        and a shutdown must not wait on them."""
        if not self._current.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(patience):
                    await self._current.wait()

    def cancelled(self, task_id: str) -> bool:
        self._forget_old()
        return task_id in self._until

    def running(self, task_id: str, token: AbortToken) -> None:
        self._running.setdefault(task_id, set()).add(token)

    def finished(self, task_id: str, token: AbortToken) -> None:
        tokens = self._running.get(task_id)
        if tokens is not None:
            tokens.discard(token)
            if not tokens:
                del self._running[task_id]

    def _forget_old(self) -> None:
        now = time.monotonic()
        while self._until and (
            len(self._until) > self.max_remembered or next(iter(self._until.values())) < now
        ):
            self._until.popitem(last=False)
