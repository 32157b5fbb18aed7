"""What one round trip to an idle server costs, against the same round trip back to back.

An idle submission's sent → invoked time is a chain of hops between processes: the client, the
gateway, PostgreSQL (the commit), RabbitMQ (the quorum write it confirms), the dispatcher, the
function. On a VM whose idle cores sleep, each hop that finds its process asleep pays a wake-up.
This measures that price on the servers themselves, without Conveyor: `SELECT 1` and a
one-row INSERT's commit on PostgreSQL, and a confirmed publish to a quorum and to a classic
queue on RabbitMQ, each `--samples` times back to back (gap 0) and after each of the `--gaps`.

    python -m bench.wakeup [--samples 200] [--gaps 0,0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import psycopg

from bench.record import banner, metadata, write_result
from bench.stack import AMQP_URL, fresh_database
from bench.stats import summarize
from gateway.database_url import libpq

Probe = Callable[[], Awaitable[None]]


async def _timed(probe: Probe, samples: int, gap: float) -> dict[str, Any]:
    await probe()  # warm: the first call prepares or declares
    took = []
    for _ in range(samples):
        if gap:
            await asyncio.sleep(gap)
        started = time.perf_counter()
        await probe()
        took.append((time.perf_counter() - started) * 1000)
    return summarize(took)


async def _postgresql(database_url: str, samples: int, gaps: list[float]) -> dict[str, Any]:
    conn = await psycopg.AsyncConnection.connect(libpq(database_url), autocommit=True)
    async with conn:
        await conn.execute("CREATE TABLE wakeup_probe (id bigserial PRIMARY KEY, at timestamptz)")

        async def select() -> None:
            await conn.execute("SELECT 1")

        async def commit() -> None:
            await conn.execute("INSERT INTO wakeup_probe (at) VALUES (now())")

        return {
            name: {str(gap): await _timed(probe, samples, gap) for gap in gaps}
            for name, probe in (("select_1", select), ("insert_commit", commit))
        }


async def _rabbitmq(samples: int, gaps: list[float]) -> dict[str, Any]:
    connection = await aio_pika.connect(AMQP_URL, timeout=15)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        figures: dict[str, Any] = {}
        message = aio_pika.Message(b"{}", delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        for kind, arguments in (("quorum", {"x-queue-type": "quorum"}), ("classic", {})):
            name = f"bench-wakeup-{uuid.uuid4().hex[:10]}"
            await channel.declare_queue(name, durable=True, arguments=arguments)

            async def publish(queue: str = name) -> None:
                await channel.default_exchange.publish(message, routing_key=queue)

            try:
                figures[f"confirmed_publish_{kind}"] = {
                    str(gap): await _timed(publish, samples, gap) for gap in gaps
                }
            finally:
                await channel.queue_delete(name)
        return figures


def run(options: argparse.Namespace) -> dict[str, Any]:
    gaps = [float(g) for g in options.gaps.split(",")]
    banner(f"wake-up: {options.samples} round trips at gaps {gaps} s")
    with fresh_database() as database_url:
        servers = asyncio.run(_postgresql(database_url, options.samples, gaps))
    servers.update(asyncio.run(_rabbitmq(options.samples, gaps)))
    for name, by_gap in servers.items():
        line = ", ".join(f"gap {gap}: p50 {figures['p50']} ms" for gap, figures in by_gap.items())
        print(f"  {name:28} {line}")
    return {
        "benchmark": "wakeup",
        "meta": metadata("bench.wakeup", vars(options)),
        "round_trip_ms": servers,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--gaps", default="0,0.05", help="seconds idle before each round trip")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    write_result("wakeup", run(parse(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
