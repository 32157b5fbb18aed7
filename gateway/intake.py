"""Group commit for submissions: concurrent requests share one INSERT and one commit.

Under load, most of a submission's cost is per statement (a pool checkout, a
round trip, a commit and its WAL flush), not per row. Requests that can be
stored by the plain insert (no capacity, no Idempotency-Key: see
`store.create_task`) therefore queue here; while up to `concurrency` batches
are being written, newcomers wait, and the next batch takes all of them of the
oldest waiter's service (one statement inserts the tasks of one service). There
is no timer: an idle gateway writes a lone request at once, and batches grow
only as fast as requests pile up behind a busy database.

A service has one batch in writing at a time: the statement counts the task's
position among the PENDING rows it can see, and two batches of one service in
flight together cannot see each other's rows (both answered position 1, found
by tests/integration/test_intake.py in CI). Across gateway replicas the service's
lock does the same (`store.insert_in_turn`); within a process it never waits.

Each request still gets its own answer and its own outcome: a batch that the
database refuses for a reason of its own (not a lost connection) is retried one
row at a time, so one unstorable body fails alone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from gateway.errors import ApiError
from gateway.pgpool import CONNECTION_ERRORS, Pool, server_timeout
from gateway.store import Accepted, NewTask, insert_in_turn

log = logging.getLogger("conveyor.gateway.intake")

# What answering takes besides the statement (the pool, the event loop), within DB_TIMEOUT.
ANSWER_ALLOWANCE = 0.5

_Waiting = tuple[NewTask, "asyncio.Future[Accepted]", float]  # and when it came (monotonic)


class Intake:
    def __init__(
        self, pool: Pool, grace: float, max_batch: int = 200, concurrency: int = 2
    ) -> None:
        self.pool = pool
        self.grace = grace  # the relay's wait before it publishes what the fast path did not
        self.max_batch = max_batch
        self.concurrency = concurrency
        self._waiting: list[_Waiting] = []
        self._writing: set[str] = set()  # the services of the batches being written
        self._writers: set[asyncio.Task[None]] = set()

    async def insert(self, new: NewTask) -> Accepted:
        future: asyncio.Future[Accepted] = asyncio.get_running_loop().create_future()
        self._waiting.append((new, future, time.monotonic()))
        self._start_writers()
        return await future

    def _start_writers(self) -> None:
        while len(self._writing) < self.concurrency:
            waiting = (_service(w) for w in self._waiting)
            service = next((name for name in waiting if name not in self._writing), None)
            if service is None:
                return
            self._writing.add(service)
            writer = asyncio.create_task(self._write(self._next_batch(service)))
            self._writers.add(writer)
            writer.add_done_callback(functools.partial(self._writer_done, service))

    def _next_batch(self, service: str) -> list[_Waiting]:
        """Up to `max_batch` waiters of `service` (the oldest one not being written), in
        their order; the others keep theirs."""
        batch: list[_Waiting] = []
        rest: list[_Waiting] = []
        for waiting in self._waiting:
            if len(batch) < self.max_batch and _service(waiting) == service:
                batch.append(waiting)
            else:
                rest.append(waiting)
        self._waiting = rest
        return batch

    def _writer_done(self, service: str, writer: asyncio.Task[None]) -> None:
        self._writers.discard(writer)
        self._writing.discard(service)
        self._start_writers()

    async def _write(self, batch: list[_Waiting]) -> None:
        try:
            await self._write_batch(batch)
        finally:  # whatever went wrong here, no request waits for an answer for ever
            for _, future, _ in batch:
                _settle(future, exc=RuntimeError("the submission's batch was not written"))

    async def _write_batch(self, batch: list[_Waiting]) -> None:
        try:
            accepted = await self._insert([new for new, _, _ in batch])
        except Exception as exc:
            # one service's batch: its service gone, or the database away, is every row's
            if len(batch) == 1 or isinstance(exc, (*CONNECTION_ERRORS, ApiError)):
                for _, future, _ in batch:
                    _settle(future, exc=exc)
                if isinstance(exc, CONNECTION_ERRORS):
                    self._give_up_waiting(_service(batch[0]), exc)
                return
            log.info("batch insert refused; rows retried one by one", extra={"size": len(batch)})
            await asyncio.gather(*(self._write([waiting]) for waiting in batch))
            return
        for (_, future, _), result in zip(batch, accepted, strict=True):
            _settle(future, result=result)

    def _give_up_waiting(self, service: str, exc: BaseException) -> None:
        """The requests of `service` that waited behind a batch the database gave up on, too
        long for another batch to end within their DB_TIMEOUT, get its answer too (503):
        written next, they were answered after up to twice DB_TIMEOUT (found by a black-box
        test behind a `LOCK TABLE`). Newer ones are written next, as after a lost connection."""
        limit = self.pool.use_timeout
        oldest = time.monotonic() - max(0.0, limit - server_timeout(limit) - ANSWER_ALLOWANCE)
        doomed = [w for w in self._waiting if _service(w) == service and w[2] <= oldest]
        gone = {id(w) for w in doomed}
        self._waiting = [w for w in self._waiting if id(w) not in gone]
        for _, future, _ in doomed:
            _settle(future, exc=exc)

    async def _insert(self, tasks: list[NewTask]) -> list[Accepted]:
        return await insert_in_turn(self.pool, tasks, self.grace)

    async def close(self) -> None:
        """Lets the batches being written finish (their requests are waiting for them)."""
        if self._writers:
            await asyncio.gather(*self._writers, return_exceptions=True)


def _service(waiting: _Waiting) -> str:
    return waiting[0].access.service.name


def _settle(
    future: asyncio.Future[Accepted],
    result: Accepted | None = None,
    exc: BaseException | None = None,
) -> None:
    if future.done():  # the request was cancelled (client gone): nobody is listening
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        assert result is not None
        future.set_result(result)
