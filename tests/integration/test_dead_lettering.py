"""A submission past its delivery limit reaches `-dlq` even when `-dlq` could not take it at
that moment, so its task still ends (SPEC §6.1).

`make chaos` (2026-11-29) lost one this way: `-in` dead-lettered a submission 10 ms after a
RabbitMQ restart, before `-dlq` had a leader, and a quorum queue dead-letters at most once
by default: the message was dropped and its task stayed PENDING. Here `-dlq` is away (deleted)
when the submission passes its limit; the gateway declares it again, as its refresh does.

A private node: the broker tries a dead letter again every
`dead_letter_worker_publisher_confirm_timeout` (3 min by default), shortened here to 1 s.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import aio_pika
import pytest

from conveyor import topology
from conveyor.events import MessageFormat
from tests.support.servers import RabbitNode, rabbitmq_available

LIMIT = 2


@pytest.fixture(scope="module")
def node() -> Iterator[RabbitNode]:
    if not rabbitmq_available():
        pytest.skip("rabbitmq-server is not installed here: no private node to configure")
    started = RabbitNode(rabbit_env="{dead_letter_worker_publisher_confirm_timeout, 1000}")
    try:
        yield started.start()
    finally:
        started.stop()


async def _exhaust(queue: aio_pika.abc.AbstractQueue) -> int:
    """Takes the message and gives it back until the broker stops handing it out."""
    deliveries = 0
    for _ in range(50):
        message = await queue.get(no_ack=False, fail=False)
        if message is None:
            if deliveries > LIMIT:
                return deliveries
            await asyncio.sleep(0.1)
            continue
        deliveries += 1
        await message.nack(requeue=True)
    return deliveries


async def _dead_letter_while_dlq_is_away(url: str, queue_name: str) -> aio_pika.IncomingMessage:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await topology.declare_service(channel, queue_name, MessageFormat.CLOUDEVENTS, LIMIT)
        await channel.queue_delete(topology.dead_letter_queue(queue_name))
        await channel.default_exchange.publish(
            aio_pika.Message(b'{"n": 1}', message_id="submission-1", delivery_mode=2),
            routing_key=topology.in_queue(queue_name),
        )
        submissions = await channel.get_queue(topology.in_queue(queue_name))
        assert await _exhaust(submissions) == LIMIT + 1  # then the broker dead-letters it
        await asyncio.sleep(0.5)  # the broker's first try finds no -dlq

        await topology.declare_service(channel, queue_name, MessageFormat.CLOUDEVENTS, LIMIT)
        dead = await channel.get_queue(topology.dead_letter_queue(queue_name))
        for _ in range(300):
            message = await dead.get(no_ack=True, fail=False)
            if message is not None:
                return message
            await asyncio.sleep(0.1)
        raise AssertionError("the dead-lettered submission never reached -dlq: it was dropped")


@pytest.mark.timeout(180)
def test_a_submission_dead_lettered_while_the_dlq_is_away_reaches_it_once_back(
    node: RabbitNode,
) -> None:
    queue_name = f"dlx-{uuid.uuid4().hex[:8]}"
    message = asyncio.run(_dead_letter_while_dlq_is_away(node.url, queue_name))
    assert message.body == b'{"n": 1}' and message.message_id == "submission-1"
    assert (message.headers or {}).get("x-first-death-reason") == "delivery_limit"
