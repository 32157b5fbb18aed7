"""Tasks accepted per second through batches of 100 against single submits (SPEC §11.2).

One gateway, one service (no capacity, no Idempotency-Key: each path's cheapest case), closed
loops from `bench.loadgen` (a separate process): `POST …/tasks` one task per request, and
`POST …/tasks/batch` with `--size` tasks per request, alternating, `--reps` times. Between runs
the PENDING backlog is finished in SQL and `-in` purged, so each run starts alike. Medians,
and the ratio of tasks per second, batches over singles.

    python -m bench.batch [--size 100] [--duration 5] [--reps 3] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bench.record import PYTHON, banner, metadata, run_json, write_result
from bench.stack import BenchService, Gateway, create_service, fresh_database, processes
from bench.stack import start_gateway as start_bench_gateway
from bench.stats import median, ratio
from bench.submit import reset_backlog


def load(gateway: Gateway, service: BenchService, size: int, options: Any) -> dict[str, Any]:
    if size == 1:
        request = {"method": "POST", "path": service.tasks_path, "body": {"body": {"n": 1}}}
    else:
        items = [{"body": {"n": i}} for i in range(size)]
        request = {
            "method": "POST",
            "path": f"{service.tasks_path}/batch",
            "body": {"tasks": items},
        }
    job = {
        "url": gateway.url,
        "mode": "closed",
        "requests": [request],
        "concurrency": options.concurrency,
        "duration": options.duration,
        "warmup": 0.5,
        "auth": list(service.auth),
    }
    report = run_json(
        [PYTHON, "-m", "bench.loadgen", json.dumps(job)], timeout=options.duration * 3 + 60
    )
    return {
        "size": size,
        "requests_per_s": report["throughput_rps"],
        "tasks_per_s": round(report["throughput_rps"] * size, 1),
        "p50_ms": report["latency_ms"]["p50"],
        "p99_ms": report["latency_ms"]["p99"],
        "statuses": report["statuses"],
    }


def run(options: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "batch", "meta": metadata("bench.batch", vars(options))}
    runs: list[dict[str, Any]] = []
    with fresh_database() as database_url, processes() as procs:
        service = create_service(database_url, bcrypt_rounds=4)
        gateway = start_bench_gateway(procs, database_url)
        for rep in range(options.reps):
            sizes = (1, options.size) if rep % 2 == 0 else (options.size, 1)
            for size in sizes:
                banner(f"repetition {rep + 1}/{options.reps}: {size} task(s) per request")
                found = {"rep": rep + 1, **load(gateway, service, size, options)}
                found["backlog_after"] = reset_backlog(database_url, service)
                runs.append(found)
                print(
                    f"  {found['tasks_per_s']} tasks/s ({found['requests_per_s']} req/s),"
                    f" p99 {found['p99_ms']} ms, statuses {found['statuses']}",
                    flush=True,
                )
    result["runs"] = runs
    single = median(r["tasks_per_s"] for r in runs if r["size"] == 1)
    batched = median(r["tasks_per_s"] for r in runs if r["size"] == options.size)
    result["summary"] = {
        "single_tasks_per_s": single,
        "batch_tasks_per_s": batched,
        "ratio_batch_over_single": ratio(batched, single),
    }
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=100, help="tasks per batch")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse(argv))
    write_result("batch", result)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
