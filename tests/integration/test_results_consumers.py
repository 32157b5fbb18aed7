"""The consumers a gateway keeps on its results channel are the ones it tracks: in process,
on a database of the test's own, against the real broker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from conveyor import topology
from gateway.broker import Broker
from gateway.pgpool import Pool
from gateway.results import ResultConsumer
from tests.support.amqp import consumer_count, delete_queues, scratch_database
from tests.support.gateway import Platform

pytestmark = pytest.mark.timeout(60)


async def _consumers(amqp_url: str, queue: str) -> int | None:
    return await asyncio.to_thread(consumer_count, amqp_url, queue)


@contextlib.asynccontextmanager
async def _consuming(
    database_url: str, amqp_url: str
) -> AsyncIterator[tuple[Platform, ResultConsumer]]:
    """A result consumer on a scratch database (tests/conftest.py removes the test's services)."""
    with scratch_database(database_url) as url:
        platform = Platform(url)
        broker, pool = Broker(amqp_url), Pool(url, size=2)
        try:
            yield platform, ResultConsumer(pool, broker, delivery_limit=5)
        finally:
            await broker.close()
            await pool.close()


async def test_a_consumer_the_broker_cancelled_is_made_again_on_a_fresh_channel(
    database_url: str, amqp_url: str
) -> None:
    """None of the gateway's result consumers is aio-pika's to restore (a permission narrowed
    on one service's queue failed every restore, tests/chaos): one the broker cancelled, its
    queue deleted, is noticed by the next refresh, and the one after it declares the queue
    again on a fresh channel and consumes it."""
    async with _consuming(database_url, amqp_url) as (platform, consumer):
        out = topology.out_queue(platform.service().queue_name)
        await consumer.refresh()
        assert await _consumers(amqp_url, out) == 1
        await asyncio.to_thread(delete_queues, amqp_url, [out])
        await asyncio.sleep(0.2)  # the broker's cancel arrives
        await consumer.refresh()
        await consumer.refresh()
        assert await _consumers(amqp_url, out) == 1


async def test_a_pace_the_refresh_replaced_the_channel_under_ends_and_frees_the_next_refresh(
    database_url: str, amqp_url: str
) -> None:
    """Found in CI: a queueName changed while results flowed replaced the results channel while
    the loop applying results was raising a queue's prefetch on it. The new consumer was then
    asked of the closed channel, which waits for a restore that never comes: the pace held
    `_pacing` for good, no result was applied again, and every refresh after it stalled
    (`RefreshStalled` every 60 s for the rest of the run, no new service subscribed). Here the
    channel is replaced while a pace is cancelling the consumer it is about to make again."""
    async with _consuming(database_url, amqp_url) as (platform, consumer):
        out = topology.out_queue(platform.service().queue_name)
        await consumer.refresh()
        pace = consumer._pace[out]
        pace.seen, pace.largest = pace.prefetch, 10  # its results small: a larger prefetch
        pacing = asyncio.create_task(consumer._pace_queues())
        for _ in range(3):  # the pace is in its consumer's cancel: a round trip
            await asyncio.sleep(0)
        assert not pacing.done()
        async with consumer._applying:  # as a refresh replaces a stale subscription
            await consumer._replace_channel(None)
        await asyncio.wait_for(pacing, 10)
        assert out not in consumer._pace, "nothing of the replaced channel is paced"
        later = topology.out_queue(platform.service().queue_name)
        await asyncio.wait_for(consumer.refresh(), 10)
        assert await _consumers(amqp_url, later) == 1
        assert await _consumers(amqp_url, out) == 1
