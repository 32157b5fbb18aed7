"""The results consumer never drops nor strands a batch: a database that goes away while
a refused batch is applied one message at a time is waited for, then every message is
applied and acked (before, the apply loop died and the batch stayed unacked forever)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from conveyor.events import EventKind, TaskEvent, encode_event
from gateway import pgpool, results


class Channel:
    """The broker's view of one channel: unsettled deliveries by tag, and the frames sent."""

    def __init__(self) -> None:
        self.outstanding: dict[int, Message] = {}
        self.frames: list[tuple[str, int, bool]] = []
        self._tags = 0

    def deliver(self, task_id: str) -> Message:
        self._tags += 1
        message = Message(task_id, self, self._tags)
        self.outstanding[self._tags] = message
        return message


class Message:
    def __init__(self, task_id: str, channel: Channel | None = None, tag: int = 1) -> None:
        wire = encode_event(TaskEvent(kind=EventKind.SUCCEEDED, task_id=task_id), "svc")
        self.body, self.headers = wire.body, wire.headers
        self.content_type, self.message_id = wire.content_type, wire.message_id
        self.channel = channel or Channel()
        self.delivery_tag = tag
        self.channel.outstanding.setdefault(tag, self)
        self.settled: list[str] = []

    async def ack(self, multiple: bool = False) -> None:
        """As the broker reads it: `multiple` settles every outstanding tag up to this one."""
        self.channel.frames.append(("ack", self.delivery_tag, multiple))
        for tag in sorted(self.channel.outstanding):
            if tag == self.delivery_tag or (multiple and tag < self.delivery_tag):
                self.channel.outstanding.pop(tag).settled.append("ack")

    async def nack(self, requeue: bool = True) -> None:
        self.channel.frames.append(("nack", self.delivery_tag, False))
        self.channel.outstanding.pop(self.delivery_tag).settled.append("nack")


class Cursor:
    async def fetchone(self) -> tuple[int, int]:
        return (1, 0)


def _locks(sql: str) -> bool:
    """How long a transaction waits for a row lock, or its tasks' rows locked: not a write."""
    return "lock_timeout" in sql or "FOR UPDATE" in sql


class Database:
    """Refuses any batch of several statements (as for a value it cannot store), then is
    unreachable for the first `outage` single statements."""

    use_timeout = 10.0  # CONVEYOR_DB_TIMEOUT's default

    def __init__(self, outage: int) -> None:
        self.outage = outage
        self.applied: list[uuid.UUID] = []
        self._pipelined = False

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Database]:
        yield self

    @contextlib.asynccontextmanager
    async def pipeline(self) -> AsyncIterator[None]:
        self._pipelined = True
        try:
            yield
        finally:
            self._pipelined = False

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        yield

    async def execute(self, sql: str, params: dict[str, Any]) -> Cursor:
        if _locks(sql):
            return Cursor()
        if self._pipelined:
            raise psycopg.errors.DataError("refused as a batch")
        if self.outage:
            self.outage -= 1
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        self.applied.append(params["task_id"])
        return Cursor()


@pytest.mark.parametrize("outage", [0, 3])
async def test_a_database_outage_in_the_one_by_one_path_is_waited_for(outage: int) -> None:
    database = Database(outage)
    consumer = results.ResultConsumer(database, broker=None, delivery_limit=5)  # type: ignore[arg-type]
    ids = [str(uuid.uuid4()) for _ in range(3)]
    channel = Channel()
    batch = [results.Delivery("svc-out", False, channel.deliver(i)) for i in ids]  # type: ignore[arg-type]

    await consumer.process(batch)  # returns: it neither raises nor leaves the batch unsettled

    assert [str(t) for t in database.applied] == ids
    assert [d.message.settled for d in batch] == [["ack"]] * 3  # type: ignore[attr-defined]


async def test_an_unexpected_error_hands_the_batch_back() -> None:
    class Broken(Database):
        async def execute(self, sql: str, params: dict[str, Any]) -> Cursor:
            raise RuntimeError("a bug")

    consumer = results.ResultConsumer(Broken(0), broker=None, delivery_limit=5)  # type: ignore[arg-type]
    batch = [results.Delivery("svc-out", False, Message(str(uuid.uuid4())))]  # type: ignore[arg-type]

    await consumer.process(batch)

    assert batch[0].message.settled == ["nack"]  # type: ignore[attr-defined]


async def test_a_batch_is_acked_with_one_frame_per_channel_and_nothing_beyond_it() -> None:
    """One `multiple` ack at each channel's highest tag settles the batch; a delivery that
    arrived after the batch was taken stays unacked until its own batch is applied."""
    database = Database(0)
    consumer = results.ResultConsumer(database, broker=None, delivery_limit=5)  # type: ignore[arg-type]
    first, second = Channel(), Channel()  # e.g. a channel restored after a reconnection
    batch_messages = [
        first.deliver(str(uuid.uuid4())),
        second.deliver(str(uuid.uuid4())),
        first.deliver(str(uuid.uuid4())),
        second.deliver(str(uuid.uuid4())),
        first.deliver(str(uuid.uuid4())),
    ]
    later = first.deliver(str(uuid.uuid4()))  # still in the inbox
    batch = [results.Delivery("svc-out", False, m) for m in batch_messages]  # type: ignore[arg-type]

    await consumer.process(batch)

    assert [m.settled for m in batch_messages] == [["ack"]] * 5
    assert (first.frames, second.frames) == ([("ack", 3, True)], [("ack", 2, True)])
    assert later.settled == [] and list(first.outstanding) == [4]

    await consumer.process([results.Delivery("svc-out", False, later)])  # type: ignore[arg-type]

    assert later.settled == ["ack"] and first.outstanding == {}


async def test_the_watchdog_is_told_while_results_cannot_be_written() -> None:
    """While the database refuses the writes of results, the watchdog's silence proves
    nothing (gateway/hearing.py): hearing stops at the first failed attempt, and begins
    again, later than before, once the batch is written."""
    from gateway.hearing import Hearing

    hearing = Hearing(lambda: True)
    before = hearing.since()
    seen_while_retrying: list[object] = []

    class Outage(Database):
        async def execute(self, sql: str, params: dict[str, Any]) -> Cursor:
            if self.outage == 1 and not _locks(sql):  # the second failure
                seen_while_retrying.append(hearing.since())
            return await super().execute(sql, params)

    consumer = results.ResultConsumer(
        Outage(2),
        broker=None,  # type: ignore[arg-type]
        delivery_limit=5,
        hearing=hearing,
    )
    batch = [results.Delivery("svc-out", False, Message(str(uuid.uuid4())))]  # type: ignore[arg-type]

    await consumer.process(batch)

    assert seen_while_retrying == [None]
    after = hearing.since()
    assert before is not None and after is not None and after > before


@pytest.mark.parametrize("db_timeout", [0.5, 1, 3, 4, 10, 60])
def test_a_lock_wait_ends_before_the_statement_timeout(db_timeout: float) -> None:
    """The lock's error must come first: a statement timeout is taken for a slow database
    and retries the batch whole, every result waiting for the lock (CONVEYOR_DB_TIMEOUT 3)."""
    together, alone = results.lock_waits(db_timeout)
    statement_ms = pgpool.server_timeout(db_timeout) * 1000
    assert 1 <= alone <= together <= statement_ms / 2
    if db_timeout >= 10:  # the default and longer: the waits as they were
        assert (together, alone) == (2000, 200)
    else:
        assert together < 2000
