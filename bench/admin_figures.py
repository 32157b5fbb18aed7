"""The admin API's figures with millions of rows: how long `GET /v1/admin/services` spends in
PostgreSQL, and the plan it runs (SPEC §11.6 asks for both).

A fresh database gets one service with `--finished` SUCCESS/FAILURE rows spread over the last
week (of which `--last-hour` in the last hour), `--pending` PENDING and `--running` IN_PROGRESS
rows, then VACUUM ANALYZE as autovacuum would. The figures query and the throughput query of
`gateway.service_stats` run `--reps` times each (medians), and once under
`EXPLAIN (ANALYZE, BUFFERS)`; so does the admin task page (`gateway.admin_api`).

    python -m bench.admin_figures [--finished 1000000] [--last-hour 100000] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import psycopg

from bench.record import banner, metadata, write_result
from bench.stack import fresh_database
from bench.stats import median
from gateway.admin_api import _PAGE
from gateway.database_url import libpq
from gateway.service_stats import _FIGURES, _THROUGHPUT, BUCKET_SECONDS, SAMPLE

SERVICE = "figures"

_FILL = """
    INSERT INTO tasks (task_id, client_id, service, status, request, submission_date,
                       start_date, end_date, progress)
    SELECT gen_random_uuid(), 'bench', %(service)s,
           CASE WHEN i %% 20 = 0 THEN 'FAILURE' ELSE 'SUCCESS' END, '{}'::jsonb,
           e - interval '3 seconds', e - interval '2 seconds', e, 100
    FROM (SELECT i, now() - (random() * %(span)s) * interval '1 second' AS e
          FROM generate_series(1, %(n)s) i) g
    """
_OPEN = """
    INSERT INTO tasks (task_id, client_id, service, status, request, start_date)
    SELECT gen_random_uuid(), 'bench', %(service)s, %(status)s, '{}'::jsonb,
           CASE WHEN %(status)s = 'IN_PROGRESS' THEN now() END
    FROM generate_series(1, %(n)s)
    """


def fill(url: str, options: argparse.Namespace) -> float:
    started = time.perf_counter()
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute("INSERT INTO services (name, queue_name) VALUES (%s, %s)", (SERVICE, SERVICE))
        older = options.finished - options.last_hour
        conn.execute(_FILL, {"service": SERVICE, "n": older, "span": 7 * 86400 - 3600})
        conn.execute(
            "UPDATE tasks SET end_date = end_date - interval '1 hour',"
            " start_date = start_date - interval '1 hour' WHERE service = %s",
            (SERVICE,),
        )
        conn.execute(_FILL, {"service": SERVICE, "n": options.last_hour, "span": 3600})
        for status, n in (("PENDING", options.pending), ("IN_PROGRESS", options.running)):
            conn.execute(_OPEN, {"service": SERVICE, "status": status, "n": n})
        conn.execute("VACUUM ANALYZE tasks")
    return time.perf_counter() - started


def measure(url: str, reps: int) -> dict[str, Any]:
    """The throughput is read whole once, then only since the last settled bucket."""
    bucket = int(time.time() // BUCKET_SECONDS)
    hour_ago = (bucket - 11) * BUCKET_SECONDS
    ten_minutes_ago = (bucket - 1) * BUCKET_SECONDS
    queries = {
        "figures": (_FIGURES, {"sample": SAMPLE}),
        "throughput_first": (_THROUGHPUT, {"size": BUCKET_SECONDS, "since": hour_ago}),
        "throughput_then": (_THROUGHPUT, {"size": BUCKET_SECONDS, "since": ten_minutes_ago}),
        "task_page": (
            _PAGE,
            {"service": SERVICE, "before": 2**63 - 1, "status": None, "limit": 51},
        ),
        "failures_page": (
            _PAGE,
            {"service": SERVICE, "before": 2**63 - 1, "status": "FAILURE", "limit": 11},
        ),
    }
    found: dict[str, Any] = {}
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute("SET jit = off")  # as gateway.service_stats does
        for name, (query, params) in queries.items():
            times = []
            for _ in range(reps):
                started = time.perf_counter()
                conn.execute(query, params).fetchall()
                times.append((time.perf_counter() - started) * 1000)
            plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + query, params).fetchall()
            found[name] = {
                "median_ms": round(median(times), 2),
                "runs_ms": [round(t, 2) for t in times],
                "plan": [row[0] for row in plan],
            }
            print(f"  {name}: median {found[name]['median_ms']} ms", flush=True)
    return found


def run(options: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "admin_figures",
        "meta": metadata("bench.admin_figures", vars(options)),
    }
    with fresh_database("conveyor_bench_figures") as url:
        banner(f"filling {options.finished:,} finished rows")
        result["fill_seconds"] = round(fill(url, options), 1)
        banner("measuring")
        result["queries"] = measure(url, options.reps)
    result["summary"] = {name: q["median_ms"] for name, q in result["queries"].items()}
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=1_000_000)
    parser.add_argument("--last-hour", type=int, default=100_000)
    parser.add_argument("--pending", type=int, default=10_000)
    parser.add_argument("--running", type=int, default=100)
    parser.add_argument("--reps", type=int, default=5)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse(argv))
    write_result("admin-figures", result)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
