"""Cancels broadcast to a `-control` exchange that no longer exists.

Found by CI (a suite's gateways share one database and one broker): a gateway's watchdog
told the dispatchers of another test's service, whose exchange that test had deleted, that
its tasks ended. The broker closed the channel the cancel was published on (NOT_FOUND),
which was the channel every task was published on: the publishes in flight on it failed and
`/readyz` answered 503 until aio-pika had restored it. And the exchange, declared once per
process, was never declared again: every later cancel of that service failed the same way,
and stopped the broadcast to the other queue names of the same batch.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable

import aio_pika
import pytest

from conveyor import topology
from conveyor.events import Submission, encode_cancel, encode_submission
from gateway.broker import Broker
from gateway.cancel import tell_dispatchers

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def broker(amqp_url: str) -> AsyncIterator[Broker]:
    broker = Broker(amqp_url)
    await broker.connect()
    yield broker
    await broker.close()


@pytest.fixture
async def channel(amqp_url: str) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        yield await connection.channel()


async def _cleanup(channel: aio_pika.abc.AbstractChannel, queue_names: list[str]) -> None:
    for queue_name in queue_names:
        await channel.queue_delete(topology.cancel_log(queue_name))
        await channel.exchange_delete(topology.control_exchange(queue_name))


def _submission(n: int) -> Submission:
    return Submission(task_id=str(uuid.uuid4()), service="s", body={"n": n})


async def test_a_cancel_to_a_missing_exchange_fails_no_task_publish_nor_readiness(
    broker: Broker, channel: aio_pika.abc.AbstractChannel, queue_name: str
) -> None:
    tasks_queue = await channel.declare_queue(f"{queue_name}-tasks")
    try:
        outcomes, readiness = await _publishing_beside_a_cancel_to(
            broker, tasks_queue.name, topology.control_exchange(f"{queue_name}-gone")
        )
        assert [o for o in outcomes if o is not None] == []
        assert all(readiness), f"not ready {readiness.count(False)} times of {len(readiness)}"
        declared = await channel.declare_queue(tasks_queue.name, passive=True)
        assert declared.declaration_result.message_count == 40
    finally:
        await channel.queue_delete(tasks_queue.name)


async def _publishing_beside_a_cancel_to(
    broker: Broker, queue: str, exchange: str
) -> tuple[list[BaseException | None], list[bool]]:
    """40 task publishes to `queue` with a cancel to `exchange` among them: each task
    publish's outcome, and `broker.connected` as seen at every turn of the loop meanwhile."""
    readiness: list[bool] = []

    async def watch() -> None:
        while True:
            readiness.append(broker.connected)
            await asyncio.sleep(0)

    def tasks(count: int) -> list[Awaitable[None]]:
        return [broker.publish(encode_submission(_submission(n)), queue) for n in range(count)]

    watcher = asyncio.create_task(watch())
    try:
        outcomes = await asyncio.gather(
            *tasks(20),
            broker.publish(encode_cancel(str(uuid.uuid4()), queue), "", exchange),
            *tasks(20),
            return_exceptions=True,
        )
        await asyncio.sleep(0.2)
    finally:
        watcher.cancel()
    return outcomes[:20] + outcomes[21:], readiness


async def test_cancels_reach_an_exchange_deleted_since_it_was_declared_and_the_next_one(
    broker: Broker, channel: aio_pika.abc.AbstractChannel, queue_name: str
) -> None:
    deleted, other = f"{queue_name}-a", f"{queue_name}-b"
    try:
        assert await tell_dispatchers(broker, "s", [deleted, other], [uuid.uuid4()])
        await channel.exchange_delete(topology.control_exchange(deleted))

        task_ids = [uuid.uuid4() for _ in range(3)]
        assert await tell_dispatchers(broker, "s", [deleted, other], task_ids)

        heard: dict[str, int] = {}
        for name in (deleted, other):
            await channel.get_exchange(topology.control_exchange(name))  # there again
            heard[name] = len(await _stream_messages(channel, topology.cancel_log(name)))
        assert heard == {deleted: 1 + 3, other: 1 + 3}
    finally:
        await _cleanup(channel, [deleted, other])


async def _stream_messages(
    channel: aio_pika.abc.AbstractChannel, stream: str
) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """The messages a `-cancels` stream holds, read from its start."""
    await channel.set_qos(prefetch_count=100)
    queue = await channel.declare_queue(stream, passive=True)
    messages: list[aio_pika.abc.AbstractIncomingMessage] = []

    async def receive(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        messages.append(message)
        await message.ack()

    tag = await queue.consume(receive, arguments={"x-stream-offset": "first"})
    await asyncio.sleep(1.0)  # a stream has no end to wait for: what came within a second
    await queue.cancel(tag)
    return messages


async def test_a_cancel_names_its_service_as_its_source_not_the_queue(
    broker: Broker, channel: aio_pika.abc.AbstractChannel, queue_name: str
) -> None:
    """SPEC §6.2: a task event's source is `/v1/services/<service>`; a cancel of a service
    whose queue has another name said the queue's (a consumer routing on `source` saw two
    values for one service)."""
    task_id = uuid.uuid4()
    try:
        assert await tell_dispatchers(broker, "billing", [queue_name], [task_id])
        (message,) = await _stream_messages(channel, topology.cancel_log(queue_name))
        assert message.headers["ce-source"] == "/v1/services/billing"
        assert message.headers["ce-subject"] == str(task_id)
    finally:
        await _cleanup(channel, [queue_name])


async def test_a_cancel_is_told_only_once_its_log_is_declared(
    broker: Broker, channel: aio_pika.abc.AbstractChannel, queue_name: str
) -> None:
    """Found by a flaky end-to-end test: right after a broker outage, while the gateway's
    publishing channel was still being restored, the cancel log's declaration was skipped
    (`connected` said no), and the broadcast went to the `-control` exchange the service's
    queues come with, which nothing was bound to yet: confirmed, counted as told, heard by
    no dispatcher started later. A cancel is told only once its log is declared."""
    await topology.declare_control(channel, queue_name)  # as a service's queues leave it
    publishing = broker._publishing  # the channel a reconnection has not restored yet
    assert publishing is not None and publishing.channel is not None
    await publishing.channel.close()
    assert not broker.connected
    try:
        told = await tell_dispatchers(broker, "s", [queue_name], [uuid.uuid4()])
        if told:  # then it must be in the log a later dispatcher reads
            assert len(await _stream_messages(channel, topology.cancel_log(queue_name))) == 1
    finally:
        await _cleanup(channel, [queue_name])
