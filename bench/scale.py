"""Benchmark 5: submit and poll latency with 1 k, 100 k and 1 M stored tasks (SPEC §5, §10).

History is bulk-loaded in SQL (`INSERT ... SELECT generate_series`): finished
tasks (90 % SUCCESS, 10 % FAILURE) over the last 6 days, spread over 21
services and 50 clients; one service in ten rows is the measured one, and half
of those belong to the measured client. A backlog of 100 PENDING tasks stays in
place at every level (so `taskPosition` has something to count), then
`VACUUM ANALYZE`, as autovacuum would.

At each level, against one gateway process (concurrency 4, closed loop):

* submit: `POST` on a service with a capacity and a client capacity, so the
  capacity path (advisory lock, two counts) runs too; the tasks it creates are
  deleted afterwards, so the level keeps its size;
* poll, finished task: `GET` of the measured client's finished tasks;
* poll, PENDING task: `GET` of the backlog (the position count runs).

And `EXPLAIN (ANALYZE, BUFFERS)` of the SQL in `gateway/store.py` (insert with
its position subquery, poll, position, both capacity counts) and of the reaper's
expiry pass, stored in the result with a check that none of them reads `tasks`
with a Seq Scan.

Target: p99 at 1 M <= 1.5 x p99 at 1 k.

Then a deep backlog: the measured service's PENDING tasks grow from 100 to
`--deep-backlog` (50,000 by default; 0 skips it) on top of the largest level,
`VACUUM ANALYZE` again, and submit and poll of a PENDING task are measured once
more, with the plans. A burst of that size is what KEDA scales on; the figure is
p99 with the deep backlog / p99 with 100 PENDING at the same number of rows.

    python -m bench.scale [--levels 1000,100000,1000000] [--requests 1000] [--reps 3]
                          [--deep-backlog 50000]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import uuid
from typing import Any

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
from gateway.database_url import libpq

BACKLOG = 100
HISTORY_SERVICES = 20
HISTORY_CLIENTS = 50
CHUNK = 250_000
POLL_SAMPLE = 200

_LOAD = """
INSERT INTO tasks (task_id, client_id, service, status, request, response, error_message,
                   progress, submission_date, start_date, end_date, worker_host, attempts,
                   attempt_id, updated_at)
SELECT gen_random_uuid(),
       CASE WHEN g %% 20 = 0 THEN %(client)s ELSE 'history-client-' || (g %% %(clients)s) END,
       CASE WHEN g %% 10 = 0 THEN %(service)s ELSE 'history-' || (g %% %(services)s) END,
       CASE WHEN g %% 10 = 7 THEN 'FAILURE' ELSE 'SUCCESS' END,
       jsonb_build_object('n', g),
       CASE WHEN g %% 10 = 7 THEN NULL ELSE '{"ok": true}'::jsonb END,
       CASE WHEN g %% 10 = 7 THEN 'The function failed.' END,
       CASE WHEN g %% 10 = 7 THEN 40 ELSE 100 END,
       s.at, s.at + interval '1 second', s.at + interval '3 seconds',
       'worker-' || (g %% 7), 1, 'attempt-' || g, s.at + interval '3 seconds'
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g,
     LATERAL (SELECT now() - make_interval(secs => (g * 7919) %% 518400) AS at) AS s
"""
_BACKLOG = """
INSERT INTO tasks (task_id, client_id, service, request, expires_at)
SELECT gen_random_uuid(), %(client)s, %(service)s, jsonb_build_object('n', g),
       now() + interval '1 day'
FROM generate_series(1, %(count)s::int) AS g
"""


def load_history(database_url: str, service: BenchService, first: int, last: int) -> float:
    """Rows `first..last` of history; returns the seconds it took."""
    started = time.monotonic()
    for low in range(first, last + 1, CHUNK):
        params = {
            "client": service.client_id,
            "service": service.name,
            "clients": HISTORY_CLIENTS,
            "services": HISTORY_SERVICES,
            "first": low,
            "last": min(last, low + CHUNK - 1),
        }
        sql(database_url, _LOAD, params)
    sql(database_url, "VACUUM ANALYZE tasks")
    return round(time.monotonic() - started, 1)


# ---------------------------------------------------------------------------
# latency


def closed_loop(
    gateway: Gateway, service: BenchService, requests: list[dict[str, Any]], count: int
) -> dict[str, Any]:
    job = {
        "url": gateway.url,
        "requests": requests,
        "concurrency": 4,
        "count": count,
        "warmup": 0.5,
        "auth": list(service.auth),
    }
    return run_json([PYTHON, "-m", "bench.loadgen", json.dumps(job)], timeout=600)


def measure_submit(
    gateway: Gateway, service: BenchService, database_url: str, count: int
) -> dict[str, Any]:
    top = sql(database_url, "SELECT coalesce(max(id), 0) FROM tasks")[0][0]
    body = [{"method": "POST", "path": service.tasks_path, "body": {"body": {"n": 1}}}]
    report = closed_loop(gateway, service, body, count)
    time.sleep(0.5)  # published marks are batched
    sql(database_url, "DELETE FROM tasks WHERE id > %(top)s", {"top": top})
    purge_queue(f"{service.name}-in")
    return report


def poll_requests(database_url: str, service: BenchService, status: str) -> list[dict[str, Any]]:
    rows = sql(
        database_url,
        "SELECT task_id FROM tasks WHERE client_id = %(c)s AND service = %(s)s"
        " AND status = %(st)s ORDER BY random() LIMIT %(n)s",
        {"c": service.client_id, "s": service.name, "st": status, "n": POLL_SAMPLE},
    )
    return [{"method": "GET", "path": f"{service.tasks_path}/{row[0]}"} for row in rows]


KINDS = ("submit", "poll_finished", "poll_pending")


def measure_level(
    gateway: Gateway,
    service: BenchService,
    database_url: str,
    options: argparse.Namespace,
    kinds_measured: tuple[str, ...] = KINDS,
) -> dict[str, Any]:
    requests = {
        "poll_finished": poll_requests(database_url, service, "SUCCESS"),
        "poll_pending": poll_requests(database_url, service, "PENDING"),
    }
    kinds: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds_measured}
    for _ in range(options.reps):
        for kind in kinds_measured:
            if kind == "submit":
                report = measure_submit(gateway, service, database_url, options.requests)
            else:
                report = closed_loop(gateway, service, requests[kind], options.requests)
            kinds[kind].append(report)
    return {
        kind: {
            "p50_ms": median(r["latency_ms"]["p50"] for r in runs),
            "p99_ms": median(r["latency_ms"]["p99"] for r in runs),
            "throughput_rps": median(r["throughput_rps"] for r in runs),
            "non_2xx": sum(
                n for r in runs for status, n in r["statuses"].items() if not status.startswith("2")
            ),
            "runs": [{k: r[k] for k in ("latency_ms", "throughput_rps", "statuses")} for r in runs],
        }
        for kind, runs in kinds.items()
    }


# ---------------------------------------------------------------------------
# plans


def _psycopg_sql(statement: Any) -> str:
    """SQLAlchemy's `:name` parameters (or psycopg's own) as psycopg `%(name)s`."""
    raw = getattr(statement, "text", statement)
    return re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", raw)


def _queries() -> dict[str, Any]:
    from gateway import lifecycle, store

    return {
        "insert (with position)": store._INSERT,
        "poll": store._GET,
        "position": store._POSITION,
        "capacity, service": store._PENDING_SERVICE,
        "capacity, client": store._PENDING_CLIENT,
        # not per request: every replica's reaper, every 30 s, whatever the backlog
        "reaper pass (expiry)": lifecycle._EXPIRE,
    }


def _plan_params(database_url: str, service: BenchService) -> dict[str, Any]:
    from psycopg.types.json import Jsonb

    from gateway import lifecycle

    pending = sql(
        database_url,
        "SELECT id, task_id FROM tasks WHERE service = %(s)s AND status = 'PENDING'"
        " ORDER BY id DESC LIMIT 1",
        {"s": service.name},
    )[0]
    return {
        "task_id": uuid.uuid4(),
        "client_id": service.client_id,
        "service": service.name,
        "request": Jsonb({"n": 1}),
        "callback": None,
        "idempotency_key": None,
        # the batched insert of gateway/store.py (here a batch of one)
        "task_ids": [uuid.uuid4()],
        "client_ids": [service.client_id],
        "requests": [Jsonb({"n": 1})],
        "callbacks": [None],
        "keys": [None],
        "not_befores": [None],
        "delays": [None],
        "traceparents": [None],
        "grace": 3.0,
        "time_to_live": 86400.0,
        "time_limit": 900,
        "ttl": 86400.0,
        "message": lifecycle.EXPIRED,
        "id": pending[0],
        "get_task_id": pending[1],
    }


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [{k: plan.get(k) for k in ("Node Type", "Relation Name", "Index Name") if plan.get(k)}]
    for child in plan.get("Plans", []):
        found += _nodes(child)
    return found


def explain(database_url: str, service: BenchService) -> dict[str, Any]:
    import psycopg

    params = _plan_params(database_url, service)
    plans: dict[str, Any] = {}
    # JIT off, as on the gateway's connections (gateway.pgpool)
    with psycopg.connect(libpq(database_url), options="-c jit=off") as conn:
        for name, statement in _queries().items():
            query = _psycopg_sql(statement)
            args = {**params, "task_id": params["get_task_id"]} if name == "poll" else params
            # EXPLAIN ANALYZE really runs the insert: each run is rolled back.
            text_plan = [
                row[0]
                for row in conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + query, args).fetchall()
            ]
            conn.rollback()
            json_plan = conn.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, args
            ).fetchone()[0][0]
            conn.rollback()
            nodes = _nodes(json_plan["Plan"])
            plans[name] = {
                "execution_ms": json_plan.get("Execution Time"),
                "nodes": nodes,
                "seq_scan_on_tasks": any(
                    n.get("Node Type") == "Seq Scan" and n.get("Relation Name") == "tasks"
                    for n in nodes
                ),
                "plan": text_plan,
            }
    return plans


# ---------------------------------------------------------------------------
# the run


def run(options: argparse.Namespace) -> dict[str, Any]:
    levels = sorted(int(x) for x in options.levels.split(","))
    result: dict[str, Any] = {"benchmark": "scale", "meta": metadata("bench.scale", vars(options))}
    found = []
    with fresh_database() as database_url, processes() as procs:
        service = create_service(
            database_url, capacity=1_000_000_000, client_capacity=1_000_000_000
        )
        sql(
            database_url,
            _BACKLOG,
            {"client": service.client_id, "service": service.name, "count": BACKLOG},
        )
        gateway = start_gateway(procs, database_url)
        loaded = 0
        for level in levels:
            banner(f"{level:,} stored tasks")
            seconds = load_history(database_url, service, loaded + 1, level - BACKLOG)
            loaded = level - BACKLOG
            rows = sql(database_url, "SELECT count(*) FROM tasks")[0][0]
            print(f"  loaded in {seconds} s; {rows:,} rows", flush=True)
            measured = measure_level(gateway, service, database_url, options)
            plans = explain(database_url, service)
            found.append({"rows": rows, "load_s": seconds, **measured, "plans": plans})
            for kind in KINDS:
                print(
                    f"  {kind:<14} p50 {measured[kind]['p50_ms']} ms,"
                    f" p99 {measured[kind]['p99_ms']} ms",
                    flush=True,
                )
            seq = [name for name, plan in plans.items() if plan["seq_scan_on_tasks"]]
            print(f"  plans: {'Seq Scan on tasks in ' + ', '.join(seq) if seq else 'indexes only'}")
        if options.deep_backlog > BACKLOG:
            result["deep_backlog"] = measure_deep_backlog(gateway, service, database_url, options)
    result["levels"] = found
    result["p99_ratio_largest_to_smallest"] = {
        kind: ratio(found[-1][kind]["p99_ms"], found[0][kind]["p99_ms"]) for kind in KINDS
    }
    if "deep_backlog" in result:
        result["p99_ratio_deep_backlog"] = {
            kind: ratio(result["deep_backlog"][kind]["p99_ms"], found[-1][kind]["p99_ms"])
            for kind in DEEP_KINDS
        }
    return result


DEEP_KINDS = ("submit", "poll_pending")


def measure_deep_backlog(
    gateway: Gateway, service: BenchService, database_url: str, options: argparse.Namespace
) -> dict[str, Any]:
    """Submit and poll of a PENDING task once the service's backlog is `--deep-backlog` deep:
    both answer a `taskPosition`, which counts the PENDING tasks ahead."""
    banner(f"a backlog of {options.deep_backlog:,} PENDING tasks")
    added = options.deep_backlog - BACKLOG
    sql(
        database_url,
        _BACKLOG,
        {"client": service.client_id, "service": service.name, "count": added},
    )
    sql(database_url, "VACUUM ANALYZE tasks")
    measured = measure_level(gateway, service, database_url, options, DEEP_KINDS)
    plans = explain(database_url, service)
    for kind in DEEP_KINDS:
        print(
            f"  {kind:<14} p50 {measured[kind]['p50_ms']} ms, p99 {measured[kind]['p99_ms']} ms",
            flush=True,
        )
    positions = {
        name: plans[name]["execution_ms"]
        for name in ("insert (with position)", "position", "reaper pass (expiry)")
    }
    print(f"  execution ms: {positions}", flush=True)
    return {"pending": options.deep_backlog, **measured, "plans": plans}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1000,100000,1000000")
    parser.add_argument("--requests", type=int, default=1000, help="per measurement")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--deep-backlog", type=int, default=50_000, help="PENDING tasks at the end (0: skip)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse(argv))
    write_result("scale", result)
    print(f"  p99 at the largest level / the smallest: {result['p99_ratio_largest_to_smallest']}")
    if "p99_ratio_deep_backlog" in result:
        print(f"  p99 with the deep backlog / with {BACKLOG}: {result['p99_ratio_deep_backlog']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
