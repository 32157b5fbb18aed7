"""Loops that run for weeks keep their memory: they do not open a channel at every pass.

aio-pika 10.2 with aiormq 7.2 leaves ~4.4 KB on the connection for every channel opened and
closed on it (the channel's close callback stays registered on an observer of the
connection's closing future that nothing removes, until the connection itself closes). The
service figures' loop opened and closed one every `STATS_INTERVAL` (15 s): ~25 MB a day, a
gateway over its 512 Mi limit within weeks.
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from conveyor import topology
from conveyor.events import MessageFormat
from gateway.broker import Broker
from gateway.pgpool import Pool
from gateway.service_stats import ServiceStats
from tests.support.amqp import remove_service
from tests.support.gateway import Platform

pytestmark = pytest.mark.timeout(120)

PASSES = 400


async def test_the_service_figures_leave_nothing_behind_pass_after_pass(
    platform: Platform, database_url: str, amqp_url: str
) -> None:
    service = platform.service()
    broker = Broker(amqp_url)
    pool = Pool(database_url, size=2)
    stats = ServiceStats(pool, broker, max_age=0)
    try:
        await broker.declare(  # its queues, whose depths the figures ask
            "queues",
            lambda channel: topology.declare_service(
                channel, service.queue_name, MessageFormat.CLOUDEVENTS, delivery_limit=5
            ),
        )
        for _ in range(20):  # the connection, the channels, the caches: made once
            await stats.snapshot()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(PASSES):
                figures = await stats.snapshot()
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        mine = next(f for f in figures if f["service"] == service.name)
        assert mine["queues"] == {"in": 0, "out": 0, "dlq": 0}, mine

        # 4.4 KB a pass before (1.7 MB here); what a pass may keep is bytes, not kilobytes.
        assert grown < 200 * 1024, f"{grown / PASSES:.0f} bytes kept per pass"
    finally:
        await pool.close()
        await broker.close()
        remove_service(platform, amqp_url, service)
