"""The consumers a gateway keeps on its results channel are the ones it tracks: in process,
on a database of the test's own, against the real broker."""

from __future__ import annotations

import asyncio

import pytest

from conveyor import topology
from gateway.broker import Broker
from gateway.pgpool import Pool
from gateway.results import ResultConsumer
from tests.support.amqp import consumer_count, remove_service, scratch_database
from tests.support.gateway import Platform

pytestmark = pytest.mark.timeout(60)


async def _consumers(amqp_url: str, queue: str) -> int | None:
    return await asyncio.to_thread(consumer_count, amqp_url, queue)


async def test_a_stray_consumer_of_results_is_cancelled_by_the_next_refresh(
    database_url: str, amqp_url: str
) -> None:
    """Found by a black-box sweep: aio-pika's restore after a reconnection copies a queue's
    consumers, then consumes each again, so a consumer cancelled meanwhile (its queue paused
    for memory) came back, untracked: two consumers of one `-out` on one channel, through
    five reconnections, the queue never paused for the second one. Here the stray is made as
    that restore makes it; the next refresh cancels it."""
    with scratch_database(database_url) as url:
        platform = Platform(url)
        svc = platform.service()
        broker, pool = Broker(amqp_url), Pool(url, size=2)
        consumer = ResultConsumer(pool, broker, delivery_limit=5)
        out = topology.out_queue(svc.queue_name)
        try:
            await consumer.refresh()
            assert await _consumers(amqp_url, out) == 1
            pace = consumer._pace[out]
            await consumer._consumed(pace.queue, consumer._receiver(out, dead=False), 1)
            assert await _consumers(amqp_url, out) == 2
            await consumer.refresh()
            assert await _consumers(amqp_url, out) == 1
            assert consumer._pace[out].tag == pace.tag  # the one it tracks kept
        finally:
            await broker.close()
            await pool.close()
            remove_service(platform, amqp_url, svc)
