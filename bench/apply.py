"""How much the gateway spends applying task events: `-out` fed, the tasks' rows ended.

N tasks are stored PENDING, then N terminal events for them, as a dispatcher sends them
for a short call (`succeeded`, with its stand-in start: `conveyor.events.encode_event`),
are published to the service's `-out`, either as fast as the broker confirms them
(`--rate 0`: a backlog, large batches) or at a steady rate (`--rate 400`: the end-to-end
benchmark's pace, small batches). Measured until every task is SUCCESS: events per second,
and the CPU per event of the gateway, PostgreSQL and RabbitMQ (this process's publishing
included, the same for every variant). Repetitions alternate the rates; medians.

    python -m bench.apply [--events 3000] [--reps 3] [--rate 0,400]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from datetime import timedelta
from typing import Any

import aio_pika
import psycopg

from bench.meters import CpuMeter, ServerMeter
from bench.record import banner, metadata, write_result
from bench.stack import (
    AMQP_URL,
    BenchService,
    create_service,
    fresh_database,
    processes,
    start_gateway,
    wait_until,
)
from bench.stats import median
from conveyor.amqp import to_amqp
from conveyor.events import EventKind, TaskEvent, encode_event, now
from conveyor.topology import out_queue
from gateway.database_url import libpq

CHUNK = 100  # events published, then confirmed, together


def _store_pending(database_url: str, service: BenchService, count: int) -> list[uuid.UUID]:
    ids = [uuid.uuid4() for _ in range(count)]
    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO tasks (task_id, client_id, service, request)"
            " SELECT id, %s, %s, '{}' FROM unnest(CAST(%s AS uuid[])) AS id",
            (service.client_id, service.name, ids),
        )
    return ids


def _finished(database_url: str, service: str) -> int:
    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM tasks WHERE service = %s AND status = 'SUCCESS'", (service,)
        ).fetchone()
    return 0 if row is None else int(row[0])


async def _consumers(queue: str) -> int:
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return declared.declaration_result.consumer_count or 0
    finally:
        await connection.close()


async def _publish(service: str, ids: list[uuid.UUID], rate: float) -> float:
    """Publishes one `succeeded` per task; returns when the first was sent (time.time())."""
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = channel.default_exchange
        first = time.time()
        for start in range(0, len(ids), CHUNK):
            chunk = ids[start : start + CHUNK]
            ended = now()
            events = [
                TaskEvent(
                    kind=EventKind.SUCCEEDED,
                    task_id=str(task_id),
                    host="bench-apply",
                    attempt=uuid.uuid4().hex,
                    time=ended,
                    started=ended - timedelta(milliseconds=1),
                    response={"ok": True},
                )
                for task_id in chunk
            ]
            await asyncio.gather(
                *(
                    exchange.publish(to_amqp(encode_event(e, service)), out_queue(service))
                    for e in events
                )
            )
            if rate:  # the pace of `rate` events per second
                await asyncio.sleep(max(0.0, first + (start + len(chunk)) / rate - time.time()))
        return first
    finally:
        await connection.close()


def measure(database_url: str, gateway_pid: int, events: int, rate: float) -> dict[str, Any]:
    service = create_service(database_url, bcrypt_rounds=4)
    ids = _store_pending(database_url, service, events)
    if not wait_until(lambda: asyncio.run(_consumers(out_queue(service.name))) > 0, 30, 0.2):
        raise RuntimeError("the gateway did not start consuming the new service's -out")
    gateway, servers = CpuMeter([gateway_pid]), ServerMeter(database_url)
    gateway.start()
    servers.start()
    first = asyncio.run(_publish(service.name, ids, rate))
    wait_until(lambda: _finished(database_url, service.name) >= events, 300, 0.02)
    done = time.time()
    cpu = {"gateway": gateway.stop(), **servers.stop()}
    finished = _finished(database_url, service.name)
    if finished < events:
        raise RuntimeError(f"{finished} of {events} tasks finished")
    return {
        "rate": rate,
        "events": events,
        "elapsed_s": round(done - first, 3),
        "events_per_s": round(events / (done - first), 1),
        "cpu_ms_per_event": {k: round(v * 1000 / events, 3) for k, v in cpu.items()},
    }


def run(options: argparse.Namespace) -> dict[str, Any]:
    rates = [float(r) for r in options.rate.split(",")]
    result: dict[str, Any] = {"benchmark": "apply", "meta": metadata("bench.apply", vars(options))}
    runs = []
    with fresh_database() as database_url, processes() as procs:
        gateway = start_gateway(procs, database_url)
        for rep in range(options.reps):
            banner(f"applying task events, repetition {rep + 1}/{options.reps}")
            for rate in rates if rep % 2 == 0 else list(reversed(rates)):
                found = {**measure(database_url, gateway.proc.pid, options.events, rate)}
                print(
                    f"  rate {rate or 'flood'}: {found['events_per_s']} events/s,"
                    f" CPU ms/event {found['cpu_ms_per_event']}",
                    flush=True,
                )
                runs.append({**found, "rep": rep + 1})
    result["runs"] = runs
    result["rates"] = {
        str(rate): {
            "events_per_s": median(r["events_per_s"] for r in runs if r["rate"] == rate),
            **{
                f"{part}_cpu_ms_per_event": median(
                    r["cpu_ms_per_event"][part] for r in runs if r["rate"] == rate
                )
                for part in runs[0]["cpu_ms_per_event"]
            },
        }
        for rate in rates
    }
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rate", default="0,400", help="events/s, comma-separated; 0: flood")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse(sys.argv[1:] if argv is None else argv))
    write_result("apply", result)
    for rate, figures in result["rates"].items():
        print(f"  rate {rate}: {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
