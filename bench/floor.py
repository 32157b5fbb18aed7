"""Benchmark 3: Conveyor's dispatcher against the raw-broker floor (SPEC §10, third row).

The same queue, the same pre-loaded messages (`conveyor.events.encode_submission`,
so both consumers read exactly what the gateway publishes) and the same no-op
function, consumed by:

* `dispatcher`: `conveyor dispatcher` with CONCURRENCY=C: a `started` event,
  the CloudEvents HTTP call, the terminal event confirmed, then the ack;
* `bare`: the least a correct consumer does (`python -m bench.floor bare`):
  aio-pika with prefetch C, an httpx POST, one result published with
  confirms, then the ack;
* `bare+pg` (optional, `--with-pg`): the bare consumer plus one PostgreSQL
  insert per result, the SPEC's reference pipeline;
* `dispatcher+buffer` (optional, `--buffer N`): the dispatcher with
  PREFETCH_BUFFER=N, so that a slot takes its next message as soon as its function
  has answered instead of after the confirm, the ack and a delivery.

For each dispatcher, how busy its slots were: the seconds its calls took (its
`conveyor_dispatcher_function_call_seconds`) over CONCURRENCY x the run's length,
and the idle time per task and slot that is left (everything a slot does or waits for
besides the call: decode, events, confirm, ack, the next delivery).

Throughput = N / (time the N-th result reached `-out` - first call of the
function). Both consumers run with uvloop, in their own process. Ratio
dispatcher / bare (target >= 0.8). Several repetitions, alternating; medians.

    python -m bench.floor [--tasks 5000] [--reps 3] [--concurrency 4] [--with-pg] [--buffer 4]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from typing import Any

import aio_pika

from bench.meters import CpuMeter, metric_samples
from bench.record import PYTHON, banner, metadata, no_paths, write_result
from bench.stack import (
    AMQP_URL,
    NoopFunction,
    Processes,
    declare_queues,
    delete_queues,
    fresh_database,
    processes,
    start_dispatcher,
    start_noop_function,
    unique,
    wait_for_broker,
)
from bench.stats import median, ratio
from conveyor.events import Submission, encode_submission
from conveyor.topology import in_queue, out_queue
from gateway.database_url import libpq

RESULT_HEADER = "x-bench-result"


# ---------------------------------------------------------------------------
# the bare consumer (runs in its own process)


class BareConsumer:
    """prefetch C; POST with httpx; publish the result with confirms; ack."""

    def __init__(self, function_url: str, queue: str, database_url: str | None) -> None:
        self.function_url = function_url
        self.queue = queue
        self.database_url = database_url
        self.tasks: set[asyncio.Task[None]] = set()

    async def run(self, concurrency: int) -> None:
        import httpx

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.http = httpx.AsyncClient(limits=limits, trust_env=False, timeout=30)
        self.db = await _Connections.open(self.database_url, concurrency)
        connection = await aio_pika.connect_robust(AMQP_URL)
        self.publish_channel = await connection.channel(publisher_confirms=True)
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=concurrency)
        queue = await channel.get_queue(in_queue(self.queue), ensure=False)
        await queue.consume(self._on_message)
        print("bare consumer ready", flush=True)
        await asyncio.Event().wait()

    def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        task = asyncio.ensure_future(self._handle(message))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _handle(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        task_id = str((message.headers or {}).get("ce-id", ""))
        answer = await self.http.post(
            self.function_url,
            content=message.body,
            headers={"content-type": "application/json", "ce-id": task_id},
        )
        result = aio_pika.Message(
            answer.content,
            headers={RESULT_HEADER: 1, "ce-subject": task_id},
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await self.publish_channel.default_exchange.publish(
            result, routing_key=out_queue(self.queue), mandatory=True
        )
        await self.db.insert(task_id, answer.content)
        await message.ack()


class _Connections:
    """One PostgreSQL connection per concurrent task, or nothing without a URL."""

    def __init__(self, pool: asyncio.Queue[Any] | None) -> None:
        self.pool = pool

    @classmethod
    async def open(cls, database_url: str | None, size: int) -> _Connections:
        if not database_url:
            return cls(None)
        import psycopg

        pool: asyncio.Queue[Any] = asyncio.Queue()
        for _ in range(size):
            pool.put_nowait(await psycopg.AsyncConnection.connect(database_url, autocommit=True))
        conn = await pool.get()
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_results"
            " (task_id text PRIMARY KEY, response jsonb, stored_at timestamptz DEFAULT now())"
        )
        pool.put_nowait(conn)
        return cls(pool)

    async def insert(self, task_id: str, response: bytes) -> None:
        if self.pool is None:
            return
        conn = await self.pool.get()
        try:
            await conn.execute(
                "INSERT INTO bench_results (task_id, response) VALUES (%s, %s)"
                " ON CONFLICT DO NOTHING",
                (task_id, response.decode() or "null"),
            )
        finally:
            self.pool.put_nowait(conn)


def run_bare(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="The bare aio-pika consumer")
    parser.add_argument("--queue", required=True)
    parser.add_argument("--function-url", required=True)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--database-url", default="")
    options = parser.parse_args(argv)
    consumer = BareConsumer(options.function_url, options.queue, options.database_url or None)
    try:
        import uvloop

        uvloop.run(consumer.run(options.concurrency))
    except ImportError:
        asyncio.run(consumer.run(options.concurrency))
    except KeyboardInterrupt:
        pass
    return 0


# ---------------------------------------------------------------------------
# the harness


async def preload(queue: str, count: int) -> None:
    """`count` submissions on `<queue>-in`, published with confirms, 500 at a time."""
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel(publisher_confirms=True)
        for start in range(0, count, 500):
            batch = [_submission(queue) for _ in range(min(500, count - start))]
            await asyncio.gather(
                *(channel.default_exchange.publish(m, routing_key=in_queue(queue)) for m in batch)
            )
    finally:
        await connection.close()


def _submission(queue: str) -> aio_pika.Message:
    wire = encode_submission(
        Submission(str(uuid.uuid4()), queue, {}, max_attempts=3, timeout=300.0)
    )
    return aio_pika.Message(
        wire.body,
        headers=wire.headers,
        content_type=wire.content_type,
        message_id=wire.message_id,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


class ResultCounter:
    """Counts results on `-out` (auto-ack); remembers when the target was reached."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.count = 0
        self.done_at: float | None = None
        self.done = asyncio.Event()

    def on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        headers = message.headers or {}
        kind = headers.get("ce-type")
        if isinstance(kind, bytes):
            kind = kind.decode()
        if RESULT_HEADER in headers or kind == "io.conveyor.task.succeeded":
            self.count += 1
            if self.count >= self.target and self.done_at is None:
                self.done_at = time.time()
                self.done.set()


async def count_results(queue: str, target: int, timeout: float, started: asyncio.Event) -> Any:
    """Counts until `target` results or `timeout`; a broker restart meanwhile spoils the run."""
    connection = await aio_pika.connect(AMQP_URL)
    lost = asyncio.Event()
    connection.close_callbacks.add(lambda *_: lost.set())
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=1000)
        counter = ResultCounter(target)
        out = await channel.get_queue(out_queue(queue), ensure=False)
        await out.consume(counter.on_message, no_ack=True)
        started.set()
        waiters = [asyncio.ensure_future(counter.done.wait()), asyncio.ensure_future(lost.wait())]
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()
        if lost.is_set() and not counter.done.is_set():
            raise RuntimeError("the broker connection was lost during the run")
        return counter
    finally:
        if not connection.is_closed:
            await connection.close()


def start_consumer(
    procs: Processes, kind: str, queue: str, function: NoopFunction, options: argparse.Namespace
) -> tuple[Any, str | None]:
    """The consumer's process, and its metrics address if it is a dispatcher."""
    if kind.startswith("dispatcher"):
        buffer = options.buffer if kind == "dispatcher+buffer" else 0
        dispatcher = start_dispatcher(
            procs,
            unique("floor-dispatcher"),
            queue,
            function.url,
            wait=False,
            CONCURRENCY=str(options.concurrency),
            PREFETCH_BUFFER=str(buffer),
        )
        return dispatcher.proc, f"http://127.0.0.1:{dispatcher.port}/metrics"
    args = [PYTHON, "-m", "bench.floor", "bare", "--queue", queue, "--function-url", function.url]
    args += ["--concurrency", str(options.concurrency)]
    if kind == "bare+pg":
        args += ["--database-url", libpq(options.database_url)]
    return procs.start(unique("floor-bare"), args), None


def call_seconds(metrics_url: str) -> float:
    """The seconds a dispatcher's function calls took, all of them."""
    return sum(
        sample.value
        for sample in metric_samples(metrics_url)
        if sample.name == "conveyor_dispatcher_function_call_seconds_sum"
    )


def slot_figures(calls_s: float, elapsed: float, tasks: int, concurrency: int) -> dict[str, float]:
    capacity = concurrency * elapsed  # slot-seconds the run offered
    return {
        "slot_busy_fraction": round(calls_s / capacity, 3),
        "slot_idle_ms_per_task": round((capacity - calls_s) * 1000 / tasks, 3),
        "call_ms_per_task": round(calls_s * 1000 / tasks, 3),
    }


async def measure(
    procs: Processes, kind: str, function: NoopFunction, options: argparse.Namespace
) -> dict[str, Any]:
    queue = unique("floor")
    await declare_queues(queue)
    try:
        await preload(queue, options.tasks)
        function.reset()
        listening = asyncio.Event()
        counting = asyncio.ensure_future(
            count_results(queue, options.tasks, options.timeout, listening)
        )
        await listening.wait()
        proc, metrics_url = start_consumer(procs, kind, queue, function, options)
        meter = CpuMeter([proc.pid])
        meter.start()
        counter = await counting
        cpu = meter.stop()
        calls_s = call_seconds(metrics_url) if metrics_url else None
        procs.stop(proc)
        first = function.stats()["first"]
        elapsed = None if counter.done_at is None or first is None else counter.done_at - first
        slots = (
            slot_figures(calls_s, elapsed, options.tasks, options.concurrency)
            if calls_s is not None and elapsed
            else {}
        )
        return {
            **slots,
            "consumer": kind,
            "tasks": options.tasks,
            "results": counter.count,
            "elapsed_s": None if elapsed is None else round(elapsed, 3),
            "throughput_tps": None if not elapsed else round(options.tasks / elapsed, 1),
            "cpu_s": cpu,
            "cpu_ms_per_task": round(cpu * 1000 / options.tasks, 3),
        }
    finally:
        await delete_queues(queue)


def run(options: argparse.Namespace) -> dict[str, Any]:
    kinds = ["dispatcher", "bare"] + (["bare+pg"] if options.with_pg else [])
    kinds += ["dispatcher+buffer"] if options.buffer else []
    result: dict[str, Any] = {"benchmark": "floor", "meta": metadata("bench.floor", vars(options))}
    runs = []
    with fresh_database() as database_url, processes() as procs:
        options.database_url = database_url
        function = start_noop_function(procs)
        for rep in range(options.reps):
            banner(f"dispatcher vs bare consumer, repetition {rep + 1}/{options.reps}")
            order = kinds if rep % 2 == 0 else list(reversed(kinds))
            for kind in order:
                runs.append({**_measure_safely(procs, kind, function, options), "rep": rep + 1})
    del options.database_url
    result["meta"]["params"].pop("database_url", None)
    result["runs"] = runs
    result["consumers"] = {
        kind: {
            "throughput_tps": median(
                r.get("throughput_tps") for r in runs if r["consumer"] == kind
            ),
            "cpu_ms_per_task": median(
                r.get("cpu_ms_per_task") for r in runs if r["consumer"] == kind
            ),
            **{
                figure: median(r.get(figure) for r in runs if r["consumer"] == kind)
                for figure in ("slot_busy_fraction", "slot_idle_ms_per_task")
                if kind.startswith("dispatcher")
            },
        }
        for kind in kinds
    }
    consumers = result["consumers"]
    result["ratio_dispatcher_to_bare"] = ratio(
        consumers["dispatcher"]["throughput_tps"], consumers["bare"]["throughput_tps"]
    )
    if options.buffer:
        result["ratio_buffered_dispatcher_to_bare"] = ratio(
            consumers["dispatcher+buffer"]["throughput_tps"], consumers["bare"]["throughput_tps"]
        )
    return result


def _measure_safely(
    procs: Processes, kind: str, function: NoopFunction, options: argparse.Namespace
) -> dict[str, Any]:
    try:
        wait_for_broker()
        found = asyncio.run(measure(procs, kind, function, options))
    except Exception as exc:  # recorded; the other runs go on
        found = {"consumer": kind, "error": no_paths(f"{exc.__class__.__name__}: {exc}")[:2000]}
    print(
        f"  {kind:<10} {found.get('throughput_tps')} tasks/s,"
        f" CPU {found.get('cpu_ms_per_task')} ms/task"
        + (
            f", slots busy {found['slot_busy_fraction']:.0%},"
            f" idle {found['slot_idle_ms_per_task']} ms per task and slot"
            if "slot_busy_fraction" in found
            else ""
        )
        + (f"  ERROR {found['error'][:300]}" if "error" in found else ""),
        flush=True,
    )
    return found


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--with-pg", action="store_true", help="also bare + one INSERT/result")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--buffer", type=int, default=0, help="also the dispatcher with PREFETCH_BUFFER=N"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bare"]:
        return run_bare(argv[1:])
    result = run(parse(argv))
    write_result("floor", result)
    print(f"  dispatcher / bare: {result['ratio_dispatcher_to_bare']}")
    if "ratio_buffered_dispatcher_to_bare" in result:
        print(f"  dispatcher+buffer / bare: {result['ratio_buffered_dispatcher_to_bare']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
