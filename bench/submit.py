"""Benchmark 1: gateway submit throughput and latency (SPEC §10, first row).

`POST /v1/services/<s>/tasks` with everything a real submission does: HTTP
Basic authentication, JSON Schema validation, the task row (its own outbox entry)
in one commit, the position, and the publish confirmed by RabbitMQ. One gateway
process (`conveyor gateway`, background loops on, as deployed); the load
generator (`bench.loadgen`) is a separate process. Closed loop at 1, 16 and 64
concurrent clients, several repetitions of a fixed duration each, medians.

Between repetitions the PENDING tasks are finished in SQL and `-in` is purged,
so each repetition starts from the same state (a PENDING backlog makes
`taskPosition` dearer; the backlog one repetition builds is reported).

Then "what the bcrypt cache buys": the same service, one client, with the
verification cache (`CONVEYOR_AUTH_CACHE_TTL`, default 30 s) and without it
(`CONVEYOR_AUTH_CACHE_TTL=0`: every request pays one bcrypt at the production
cost of 12), at concurrency 1 so that no two requests share a verification.

    python -m bench.submit [--duration 5] [--reps 3] [--concurrency 1,16,64] [--workers 1,2]

`--workers 1,2` measures `conveyor gateway --workers N` at each N in turn (CPU of all its
processes).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bench.meters import CpuMeter, ServerMeter, WriteMeter, gc_figures
from bench.record import PYTHON, banner, metadata, run_json, write_result
from bench.stack import (
    BenchService,
    Gateway,
    create_service,
    fresh_database,
    processes,
    purge_queue,
    sql,
    start_gateway,
)
from bench.stats import median, ratio

SCHEMA = {
    "type": "object",
    "required": ["n"],
    "properties": {"n": {"type": "integer"}, "name": {"type": "string", "maxLength": 100}},
}
BODY = {"body": {"n": 1, "name": "bench"}}


def load(
    gateway: Gateway,
    service: BenchService,
    concurrency: int,
    duration: float,
    warmup: float,
) -> dict[str, Any]:
    job = {
        "url": gateway.url,
        "mode": "closed",
        "requests": [{"method": "POST", "path": service.tasks_path, "body": BODY}],
        "concurrency": concurrency,
        "duration": duration,
        "warmup": warmup,
        "auth": list(service.auth),
    }
    meter = CpuMeter([gateway.proc.pid], tree=True)  # `--workers`: the workers too
    writes = WriteMeter([gateway.proc.pid], tree=True)
    servers = ServerMeter()
    gc_before = gc_figures(gateway.url)
    meter.start()
    writes.start()
    servers.start()
    report = run_json([PYTHON, "-m", "bench.loadgen", json.dumps(job)], timeout=duration * 3 + 120)
    cpu = meter.stop()
    written = writes.stop()
    server_cpu = servers.stop()
    report["gateway_cpu_s"] = cpu
    served = report["requests"] + report.get("warmup_requests", 0)  # the CPU covers both
    report["gateway_cpu_ms_per_request"] = round(cpu * 1000 / served, 3) if served else None
    # its answers, its statements and its publishes: one system call each unless batched
    report["gateway_writes_per_request"] = round(written / served, 2) if served else None
    after = gc_figures(gateway.url)
    report["gateway_gc"] = {
        figure: {g: round(v - gc_before[figure].get(g, 0.0), 4) for g, v in values.items()}
        for figure, values in after.items()
    }
    full = report["gateway_gc"]["collections"].get("2")
    report["gateway_full_gc_per_10k_requests"] = (
        round(full * 10_000 / served, 2) if full is not None and served else None
    )
    paused = report["gateway_gc"]["pause_s"]
    report["gateway_gc_pause_ms_per_request"] = (
        round(sum(paused.values()) * 1000 / served, 4) if paused and served else None
    )
    for name, seconds in server_cpu.items():  # the database's share of a submission, too
        report[f"{name}_cpu_ms_per_request"] = round(seconds * 1000 / served, 3) if served else None
    return report


def reset_backlog(database_url: str, service: BenchService) -> int:
    """Finishes the PENDING tasks and purges `-in`; returns how many there were."""
    rows = sql(
        database_url,
        "WITH done AS (UPDATE tasks SET status = 'SUCCESS', end_date = now(), progress = 100"
        " WHERE service = %(s)s AND status = 'PENDING' RETURNING 1) SELECT count(*) FROM done",
        {"s": service.name},
    )
    purge_queue(f"{service.name}-in")
    sql(database_url, "VACUUM ANALYZE tasks")
    return rows[0][0]


def concurrency_levels(
    gateway: Gateway,
    service: BenchService,
    database_url: str,
    levels: list[int],
    reps: int,
    duration: float,
    warmup: float,
) -> list[dict[str, Any]]:
    found = []
    for concurrency in levels:
        runs = []
        for rep in range(reps):
            report = load(gateway, service, concurrency, duration, warmup)
            report["pending_backlog_after"] = reset_backlog(database_url, service)
            runs.append(report)
            print(
                f"  c={concurrency:>3} rep {rep + 1}: {report['throughput_rps']} req/s,"
                f" p50 {report['latency_ms']['p50']} ms, p99 {report['latency_ms']['p99']} ms,"
                f" statuses {report['statuses']}, errors {report['errors']},"
                f" gateway CPU {report['gateway_cpu_ms_per_request']} ms/req,"
                f" PostgreSQL {report.get('postgresql_cpu_ms_per_request')} ms/req,"
                f" full GCs per 10k {report['gateway_full_gc_per_10k_requests']},"
                f" GC pauses {report['gateway_gc_pause_ms_per_request']} ms/req",
                flush=True,
            )
        found.append(_level_summary(concurrency, runs))
    return found


def _level_summary(concurrency: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "concurrency": concurrency,
        "throughput_rps": median(r["throughput_rps"] for r in runs),
        "p50_ms": median(r["latency_ms"]["p50"] for r in runs),
        "p99_ms": median(r["latency_ms"]["p99"] for r in runs),
        "gateway_cpu_ms_per_request": median(r["gateway_cpu_ms_per_request"] for r in runs),
        "gateway_writes_per_request": median(r["gateway_writes_per_request"] for r in runs),
        "postgresql_cpu_ms_per_request": median(
            r.get("postgresql_cpu_ms_per_request") or 0.0 for r in runs
        ),
        "gateway_full_gc_per_10k_requests": median(
            r["gateway_full_gc_per_10k_requests"] for r in runs
        ),
        "gateway_gc_pause_ms_per_request": median(
            r["gateway_gc_pause_ms_per_request"] for r in runs
        ),
        "non_2xx": sum(
            n for r in runs for status, n in r["statuses"].items() if not status.startswith("2")
        ),
        "runs": runs,
    }


def _by_workers(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per worker count and level: the median over every round of that count."""
    summary = []
    for workers in sorted({r["workers"] for r in rounds}):
        mine = [r["levels"] for r in rounds if r["workers"] == workers]
        for index, level in enumerate(mine[0]):
            runs = [levels[index] for levels in mine]
            summary.append(
                {
                    "workers": workers,
                    "concurrency": level["concurrency"],
                    "throughput_rps": median(r["throughput_rps"] for r in runs),
                    "p99_ms": median(r["p99_ms"] for r in runs),
                    "gateway_cpu_ms_per_request": median(
                        r["gateway_cpu_ms_per_request"] for r in runs
                    ),
                }
            )
    return summary


def auth_cache(
    procs: Any, database_url: str, service: BenchService, duration: float, concurrency: int
) -> dict[str, Any]:
    """The same load with the verification cache (default TTL) and without it (TTL 0)."""
    found: dict[str, Any] = {"concurrency": concurrency, "duration_s": duration}
    for label, ttl in (("cached", None), ("uncached", "0")):
        env = {"CONVEYOR_AUTH_CACHE_TTL": ttl} if ttl is not None else {}
        gateway = start_gateway(procs, database_url, name=f"gateway-auth-{label}", **env)
        try:
            report = load(gateway, service, concurrency, duration, warmup=0.5)
        finally:
            procs.stop(gateway.proc)
        reset_backlog(database_url, service)
        found[label] = report
        print(
            f"  auth {label:>8}: {report['throughput_rps']} req/s,"
            f" p50 {report['latency_ms']['p50']} ms, p99 {report['latency_ms']['p99']} ms",
            flush=True,
        )
    found["speedup"] = ratio(found["cached"]["throughput_rps"], found["uncached"]["throughput_rps"])
    return found


def run(options: argparse.Namespace) -> dict[str, Any]:
    levels = [int(x) for x in options.concurrency.split(",")]
    result: dict[str, Any] = {
        "benchmark": "submit",
        "meta": metadata("bench.submit", vars(options)),
    }
    with fresh_database() as database_url, processes() as procs:
        service = create_service(database_url, schema=SCHEMA)
        rounds: list[dict[str, Any]] = []
        for workers in [int(w) for w in options.workers.split(",")]:
            banner(f"gateway submit: closed loop, {workers} worker(s)")
            gateway = start_gateway(procs, database_url, workers=workers)
            found = concurrency_levels(
                gateway,
                service,
                database_url,
                levels,
                options.reps,
                options.duration,
                options.warmup,
            )
            rounds.append({"workers": workers, "levels": found})
            procs.stop(gateway.proc)
        result["levels"] = rounds[0]["levels"]
        if len(rounds) > 1:
            result["by_workers"] = rounds
            result["workers_summary"] = _by_workers(rounds)
        if not options.skip_auth:
            banner("what the bcrypt verification cache buys")
            result["auth_cache"] = auth_cache(
                procs, database_url, service, options.auth_duration, options.auth_concurrency
            )
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument(
        "--workers", default="1", help="gateway processes (`--workers`), e.g. 1,2: each in turn"
    )
    parser.add_argument("--auth-duration", type=float, default=3.0)
    parser.add_argument("--auth-concurrency", type=int, default=1)
    parser.add_argument("--skip-auth", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse(argv))
    write_result("submit", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
