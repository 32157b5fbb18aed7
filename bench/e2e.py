"""Benchmark 2: end-to-end tasks/s and submit -> start latency, Conveyor against Celery 5.

The same work on the same RabbitMQ and PostgreSQL, side by side in one run, at
equal concurrency (SPEC §10): N no-op tasks, each submitted, delivered to a
worker, POSTed to the same no-op HTTP function (`bench.noop`) and stored as
SUCCESS.

peers (total concurrency 4 each, by default):

* `conveyor-1x4`: one gateway, one dispatcher with CONCURRENCY=4;
* `conveyor-4x1`: one gateway, four dispatchers with CONCURRENCY=1 (as many
  worker processes as Celery has);
* `celery-prefork-4`: `celery worker --pool=prefork --concurrency=4`, late
  acks, prefetch multiplier 1, SQLAlchemy result backend (`bench.celery_peer`).

Throughput: N tasks submitted as fast as the client goes (Conveyor: 16
concurrent HTTP clients against the gateway; Celery: `apply_async` in a loop),
timed from the first submission until the N-th SUCCESS is visible in
PostgreSQL (Conveyor's `tasks`, Celery's `celery_taskmeta`, polled every 20 ms).

Latency, idle workers: tasks submitted one at a time with a pause; for each,
the no-op function's arrival time minus the time the submission was answered
(Conveyor: HTTP 201 received; Celery: `apply_async` returned). Negative values
mean the function was called before the client had its answer.

Several repetitions, peers in a rotating order; medians; ratios to Celery.

    python -m bench.e2e [--tasks 5000] [--reps 3] [--latency-samples 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.meters import CpuMeter, ServerMeter, WriteMeter, phase_means_ms, submit_phases
from bench.record import PYTHON, banner, metadata, no_paths, run_json, write_result
from bench.stack import (
    AMQP_URL,
    NoopFunction,
    Processes,
    create_service,
    delete_queues,
    fresh_database,
    processes,
    start_dispatcher,
    start_gateway,
    start_noop_function,
    unique,
    wait_for_broker,
    wait_http,
)
from bench.stats import median, ratio, summarize
from conveyor.settings import normalize_database_url
from gateway.database_url import libpq

POLL_INTERVAL = 0.02  # near the end: when the last task finished, to this much
FAR_POLL_INTERVAL = 0.2  # while more than FAR_AHEAD seconds of work are left
FAR_AHEAD = 1.0
STALL = 60.0  # seconds without a single task finishing: the run is abandoned
WARMUP_TASKS = 20


@dataclass(frozen=True)
class Peer:
    name: str
    kind: str  # conveyor | celery
    processes: int
    concurrency: int  # per process
    buffer: int = 0  # each dispatcher's PREFETCH_BUFFER

    @property
    def total_concurrency(self) -> int:
        return self.processes * self.concurrency


def peers(concurrency: int, buffer: int = 0) -> list[Peer]:
    """`buffer`: also `conveyor-1xC-bufferN` and `conveyor-Cx1-bufferN`, their dispatchers
    with PREFETCH_BUFFER=N."""
    one = Peer(f"conveyor-1x{concurrency}-buffer{buffer}", "conveyor", 1, concurrency, buffer)
    many = Peer(f"conveyor-{concurrency}x1-buffer{buffer}", "conveyor", concurrency, 1, buffer)
    return [
        Peer(f"conveyor-1x{concurrency}", "conveyor", 1, concurrency),
        *([one] if buffer else []),
        Peer(f"conveyor-{concurrency}x1", "conveyor", concurrency, 1),
        *([many] if buffer else []),
        Peer(f"celery-prefork-{concurrency}", "celery", 1, concurrency),
    ]


@dataclass
class Context:
    procs: Processes
    database_url: str
    gateway_url: str
    gateway_pid: int
    function: NoopFunction
    options: argparse.Namespace
    services: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------
# waiting for results


def wait_for_count(count: Callable[[], int], target: int, timeout: float) -> float | None:
    """Polls until `count() >= target`; returns the time.time() it was first seen.

    None after `timeout`, or as soon as nothing has finished for STALL seconds (a
    worker that never recovered from a broker restart, say). Every poll is a query on
    the PostgreSQL being measured, so it polls every FAR_POLL_INTERVAL while, at the
    pace seen so far, more than FAR_AHEAD seconds of work are left, and every
    POLL_INTERVAL after that: the end is still seen to within POLL_INTERVAL.
    """
    started = time.monotonic()
    deadline = started + timeout
    first, last, moved = -1, -1, started
    while time.monotonic() < deadline:
        seen = count()
        if seen >= target:
            return time.time()
        now = time.monotonic()
        if first < 0:
            first = seen
        if seen != last:
            last, moved = seen, now
        elif now - moved > STALL:
            return None
        time.sleep(_pause(target - seen, (seen - first) / max(now - started, 1e-6)))
    return None


def _pause(left: int, pace: float) -> float:
    """How long to wait before the next poll, `left` tasks to go at `pace` per second."""
    if pace > 0 and left / pace > FAR_AHEAD:
        return FAR_POLL_INTERVAL
    return POLL_INTERVAL


class Counter:
    """`SELECT count(*)` of the rows added since it was made, polled on one connection,
    reopened if the server restarts.

    Only rows whose `id` is above the table's highest when it was made are counted, so
    that a poll reads this run's rows by the primary key, not every earlier run's too:
    a count of the whole table was a sequential scan growing with every repetition,
    charged to the peer being measured (bench/README.md, "The benchmark's own polls").
    """

    def __init__(self, database_url: str, table: str, where: str, params: tuple[Any, ...]) -> None:
        self.url = libpq(database_url)
        self.query = f"SELECT count(*) FROM {table} WHERE id > %s AND {where}"
        self.params = params
        self._conn: Any = None
        self._last = 0
        # a table not made yet has no earlier rows
        self._since = self._read(f"SELECT coalesce(max(id), 0) FROM {table}", ()) or 0

    def _read(self, query: str, params: tuple[Any, ...]) -> int | None:
        """One number; None if the server is gone (it may be restarting)."""
        import psycopg

        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
            return int(self._conn.execute(query, params).fetchone()[0])
        except psycopg.errors.UndefinedTable:
            return 0
        except psycopg.OperationalError:
            self._conn = None  # PostgreSQL restarted: retry at the next poll
            return None

    def __call__(self) -> int:
        count = self._read(self.query, (self._since, *self.params))
        if count is not None:  # else the last count stands
            self._last = count
        return self._last


def conveyor_counter(database_url: str, service: str, status: str = "SUCCESS") -> Counter:
    return Counter(database_url, "tasks", "service = %s AND status = %s", (service, status))


def celery_counter(database_url: str, status: str = "SUCCESS") -> Counter:
    return Counter(database_url, "celery_taskmeta", "status = %s", (status,))


class Background:
    """Runs a blocking call in a thread and keeps its result (or error)."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.result = call()
        except BaseException as exc:
            self.error = exc

    def join(self, timeout: float) -> Any:
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.result


def latencies(samples: list[list[Any]], arrivals: dict[str, float]) -> dict[str, Any]:
    """Function arrival minus answer (and minus send), in ms, per sampled task."""
    from_answer, from_send, missing = [], [], 0
    for task_id, sent, answered, _ in samples:
        arrived = arrivals.get(task_id) if task_id else None
        if arrived is None:
            missing += 1
            continue
        from_answer.append((arrived - answered) * 1000)
        from_send.append((arrived - sent) * 1000)
    return {
        "from_answer_ms": summarize(from_answer),
        "from_send_ms": summarize(from_send),
        "missing": missing,
    }


# ---------------------------------------------------------------------------
# Conveyor


def _loadgen(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    return run_json([PYTHON, "-m", "bench.loadgen", json.dumps(job)], timeout=timeout)


def run_conveyor(ctx: Context, peer: Peer) -> dict[str, Any]:
    options = ctx.options
    service = create_service(ctx.database_url, name=unique(peer.name), bcrypt_rounds=4)
    ctx.services.append(service.name)
    submit_job = {
        "url": ctx.gateway_url,
        "requests": [{"method": "POST", "path": service.tasks_path, "body": {"body": {}}}],
        "auth": list(service.auth),
    }
    dispatchers = [
        start_dispatcher(
            ctx.procs,
            f"{peer.name}-{i}",
            service.name,
            ctx.function.url,
            wait=False,
            CONCURRENCY=str(peer.concurrency),
            PREFETCH_BUFFER=str(peer.buffer),
        )
        for i in range(peer.processes)
    ]
    for dispatcher in dispatchers:
        wait_http(dispatcher.ready_url, timeout=60, proc=dispatcher.proc, ok=300)
    succeeded = conveyor_counter(ctx.database_url, service.name)
    failed = conveyor_counter(ctx.database_url, service.name, "FAILURE")
    try:
        _loadgen({**submit_job, "count": WARMUP_TASKS, "concurrency": 4}, 60)
        if wait_for_count(succeeded, WARMUP_TASKS, 60) is None:
            raise RuntimeError(f"{peer.name}: warm-up tasks did not finish")
        meter = CpuMeter([ctx.gateway_pid, *(d.proc.pid for d in dispatchers)])
        gateway_meter = CpuMeter([ctx.gateway_pid])
        function_meter = CpuMeter([ctx.function.proc.pid])
        servers = ServerMeter(ctx.database_url)
        gateway_writes = WriteMeter([ctx.gateway_pid])
        dispatcher_writes = WriteMeter([d.proc.pid for d in dispatchers])
        for m in (meter, gateway_meter, function_meter, servers, gateway_writes, dispatcher_writes):
            m.start()
        load = Background(
            lambda: _loadgen(
                {**submit_job, "count": options.tasks, "concurrency": options.submitters},
                options.timeout,
            )
        )
        done_at = wait_for_count(succeeded, WARMUP_TASKS + options.tasks, options.timeout)
        cpu = meter.stop()
        gateway_cpu = gateway_meter.stop()
        writes = {"gateway": gateway_writes.stop(), "dispatchers": dispatcher_writes.stop()}
        breakdown = _breakdown(
            options.tasks,
            gateway=gateway_cpu,
            dispatchers=cpu - gateway_cpu,
            function=function_meter.stop(),
            **servers.stop(),
        )
        submitted = load.join(options.timeout)
        throughput = _throughput(options.tasks, submitted["first_sent"], done_at)
        result = {
            "peer": peer.name,
            "tasks": options.tasks,
            "submit_statuses": submitted["statuses"],
            "submit_rps": submitted["throughput_rps"],
            "elapsed_s": None if done_at is None else round(done_at - submitted["first_sent"], 3),
            "throughput_tps": throughput,
            "failed": failed(),
            "platform_cpu_s": cpu,
            "platform_cpu_ms_per_task": round(cpu * 1000 / options.tasks, 3),
            "gateway_cpu_ms_per_task": round(gateway_cpu * 1000 / options.tasks, 3),
            "cpu_ms_per_task_by_process": breakdown,
            "writes_per_task_by_process": _per_task(writes, options.tasks),
        }
        if done_at is None:
            raise RuntimeError(f"{succeeded() - WARMUP_TASKS} of {options.tasks} tasks finished")
        result["latency"] = conveyor_latency(ctx, submit_job)
        return result
    finally:
        for dispatcher in dispatchers:
            ctx.procs.stop(dispatcher.proc)


def conveyor_latency(ctx: Context, submit_job: dict[str, Any]) -> dict[str, Any]:
    ctx.function.reset()
    job = {
        **submit_job,
        "mode": "sequential",
        "count": ctx.options.latency_samples,
        "gap": ctx.options.gap,
    }
    phases = submit_phases(ctx.gateway_url)
    samples = _loadgen(job, 120 + ctx.options.latency_samples * (ctx.options.gap + 1))["samples"]
    # Where the idle submission's answer waited: the commit, then the broker's confirm.
    answer_waits = phase_means_ms(phases, submit_phases(ctx.gateway_url))
    time.sleep(0.5)
    return {**latencies(samples, ctx.function.arrivals()), "gateway_phases_mean_ms": answer_waits}


def _breakdown(tasks: int, **cpu_seconds: float) -> dict[str, float]:
    """CPU milliseconds per task of each part, servers included: where the work goes."""
    per_task = {name: round(seconds * 1000 / tasks, 3) for name, seconds in cpu_seconds.items()}
    per_task["total"] = round(sum(per_task.values()), 3)
    return per_task


def _per_task(counts: dict[str, float], tasks: int) -> dict[str, float]:
    """Writing system calls per task of each process group (`meters.WriteMeter`)."""
    return {name: round(count / tasks, 2) for name, count in counts.items()}


def _throughput(tasks: int, first_sent: float | None, done_at: float | None) -> float | None:
    if first_sent is None or done_at is None or done_at <= first_sent:
        return None
    return round(tasks / (done_at - first_sent), 1)


# ---------------------------------------------------------------------------
# Celery


def celery_env(ctx: Context, queue: str) -> dict[str, str]:
    database = normalize_database_url(ctx.database_url)
    return {
        "BENCH_CELERY_BROKER": AMQP_URL if AMQP_URL.endswith("//") else AMQP_URL + "/",
        "BENCH_CELERY_BACKEND": f"db+{database}",
        "BENCH_CELERY_QUEUE": queue,
        "BENCH_FUNCTION_URL": ctx.function.url,
    }


def _celery_client(env: dict[str, str], *args: str, timeout: float) -> dict[str, Any]:
    return run_json([PYTHON, "-m", "bench.celery_peer", *args], timeout=timeout, env=env)


def run_celery(ctx: Context, peer: Peer) -> dict[str, Any]:
    options = ctx.options
    queue = unique("celery")
    env = celery_env(ctx, queue)
    worker = ctx.procs.start(
        peer.name,
        [
            PYTHON,
            "-m",
            "celery",
            "-A",
            "bench.celery_peer",
            "worker",
            "--pool=prefork",
            f"--concurrency={peer.concurrency}",
            "-Q",
            queue,
            "-n",
            f"{queue}@%h",
            "--loglevel=WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        env=env,
    )
    succeeded = celery_counter(ctx.database_url)
    failed = celery_counter(ctx.database_url, "FAILURE")
    try:
        before = succeeded()
        warm = _celery_client(env, "submit", "--count", str(WARMUP_TASKS), timeout=60)
        if wait_for_count(succeeded, before + warm["count"], 90) is None:
            raise RuntimeError(f"{peer.name}: warm-up tasks did not finish\n{worker.tail()}")
        before = succeeded()
        failed_before = failed()
        meter = CpuMeter([worker.pid], tree=True)
        function_meter = CpuMeter([ctx.function.proc.pid])
        servers = ServerMeter(ctx.database_url)
        worker_writes = WriteMeter([worker.pid], tree=True)
        for m in (meter, function_meter, servers, worker_writes):
            m.start()
        load = Background(
            lambda: _celery_client(
                env, "submit", "--count", str(options.tasks), timeout=options.timeout
            )
        )
        done_at = wait_for_count(succeeded, before + options.tasks + 1, options.timeout)
        cpu = meter.stop()
        writes = {"workers": worker_writes.stop()}
        breakdown = _breakdown(
            options.tasks, workers=cpu, function=function_meter.stop(), **servers.stop()
        )
        submitted = load.join(options.timeout)
        result = {
            "peer": peer.name,
            "tasks": options.tasks,
            "elapsed_s": None if done_at is None else round(done_at - submitted["first_sent"], 3),
            "throughput_tps": _throughput(options.tasks + 1, submitted["first_sent"], done_at),
            "failed": failed() - failed_before,
            "platform_cpu_s": cpu,
            "platform_cpu_ms_per_task": round(cpu * 1000 / options.tasks, 3),
            "cpu_ms_per_task_by_process": breakdown,
            "writes_per_task_by_process": _per_task(writes, options.tasks),
        }
        if done_at is None:
            raise RuntimeError(f"{succeeded() - before} of {options.tasks + 1} tasks finished")
        result["latency"] = celery_latency(ctx, env)
        return result
    finally:
        ctx.procs.stop(worker, timeout=20)
        ctx.queues.append(queue)


def celery_latency(ctx: Context, env: dict[str, str]) -> dict[str, Any]:
    ctx.function.reset()
    count, gap = ctx.options.latency_samples, ctx.options.gap
    samples = _celery_client(
        env,
        "sequential",
        "--count",
        str(count),
        "--gap",
        str(gap),
        timeout=120 + count * (gap + 1),
    )["samples"]
    time.sleep(0.5)
    return latencies(samples, ctx.function.arrivals())


async def _delete_queue(name: str) -> None:
    from conveyor.connection import connect

    connection = await connect(AMQP_URL, name="conveyor bench")
    try:
        channel = await connection.channel()
        with contextlib.suppress(Exception):
            await channel.queue_delete(name)
    finally:
        await connection.close()


def cleanup_queues(ctx: Context) -> None:
    """Deletes the run's queues once every process using them has stopped."""
    for name in ctx.services:
        asyncio.run(delete_queues(name))
    for name in ctx.queues:
        asyncio.run(_delete_queue(name))


# ---------------------------------------------------------------------------
# the run


def run_peer(ctx: Context, peer: Peer) -> dict[str, Any]:
    started = time.monotonic()
    try:
        wait_for_broker()
        result = run_conveyor(ctx, peer) if peer.kind == "conveyor" else run_celery(ctx, peer)
    except Exception as exc:  # one failed run is recorded, not fatal to the others
        error = no_paths(f"{exc.__class__.__name__}: {exc}")
        result = {"peer": peer.name, "error": error[:3000]}
    result["wall_s"] = round(time.monotonic() - started, 1)
    latency = result.get("latency", {}).get("from_answer_ms", {})
    print(
        f"  {peer.name:<18} {result.get('throughput_tps')} tasks/s,"
        f" submit->start p50 {latency.get('p50')} ms p99 {latency.get('p99')} ms,"
        f" CPU {result.get('platform_cpu_ms_per_task')} ms/task"
        + (f"  ERROR {result['error'][:300]}" if "error" in result else ""),
        flush=True,
    )
    return result


def summarize_peers(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    found = {}
    for name in names:
        mine = [r for r in runs if r["peer"] == name and "error" not in r]
        found[name] = {
            "runs": len(mine),
            "throughput_tps": median(r["throughput_tps"] for r in mine),
            "latency_p50_ms": median(r["latency"]["from_answer_ms"]["p50"] for r in mine),
            "latency_p99_ms": median(r["latency"]["from_answer_ms"]["p99"] for r in mine),
            "platform_cpu_ms_per_task": median(r["platform_cpu_ms_per_task"] for r in mine),
            "failed": sum(r.get("failed") or 0 for r in mine),
        }
    return found


def run(options: argparse.Namespace) -> dict[str, Any]:
    chosen = peers(options.concurrency, options.buffer)
    if options.peers:
        wanted = options.peers.split(",")
        chosen = [p for p in chosen if p.name in wanted or p.kind in wanted]
    result: dict[str, Any] = {"benchmark": "e2e", "meta": metadata("bench.e2e", vars(options))}
    runs: list[dict[str, Any]] = []
    with fresh_database() as database_url, processes() as procs:
        function = start_noop_function(procs)
        gateway = start_gateway(procs, database_url)
        ctx = Context(procs, database_url, gateway.url, gateway.proc.pid, function, options)
        try:
            for rep in range(options.reps):
                banner(f"end to end, repetition {rep + 1}/{options.reps}, {options.tasks} tasks")
                order = chosen[rep % len(chosen) :] + chosen[: rep % len(chosen)]
                for peer in order:
                    runs.append({**run_peer(ctx, peer), "rep": rep + 1})
        finally:
            procs.stop_all()
            cleanup_queues(ctx)
    result["runs"] = runs
    result["peers"] = summarize_peers(runs, [p.name for p in chosen])
    result["ratios"] = _ratios(result["peers"], options.concurrency)
    return result


def _ratios(found: dict[str, Any], concurrency: int) -> dict[str, Any]:
    celery = found.get(f"celery-prefork-{concurrency}", {}).get("throughput_tps")
    return {
        f"{name}/celery": ratio(peer["throughput_tps"], celery)
        for name, peer in found.items()
        if name.startswith("conveyor")
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4, help="total, for every peer")
    parser.add_argument("--submitters", type=int, default=16, help="concurrent HTTP clients")
    parser.add_argument("--latency-samples", type=int, default=200)
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between latency probes")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per throughput run")
    parser.add_argument("--peers", default="", help="comma-separated peer names or kinds")
    parser.add_argument(
        "--buffer",
        type=int,
        default=0,
        help="also conveyor-1xC-bufferN and conveyor-Cx1-bufferN: PREFETCH_BUFFER=N",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse(argv))
    write_result("e2e", result)
    for name, ratio_value in result["ratios"].items():
        print(f"  {name}: {ratio_value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
