"""The API with 1,000 task event streams open against none (SPEC §11.3).

One gateway; the API's latency under a closed loop (`bench.loadgen`, a separate process) of
creates and of polls, with no stream open, then with `--streams` Server-Sent Events streams
open on PENDING tasks (held by this process, reading their comment lines), alternating,
`--reps` times; medians, and the ratio of p99s with streams over without. The gateway's
`conveyor_gateway_event_streams` gauge is read during each run with streams, and after them:
streams that go away must leave nothing behind.

    python -m bench.streams [--streams 1000] [--duration 5] [--reps 2] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from typing import Any

import httpx

from bench.record import PYTHON, banner, metadata, run_json, write_result
from bench.stack import BenchService, Gateway, create_service, fresh_database, processes
from bench.stack import start_gateway as start_bench_gateway
from bench.stats import median, ratio


class Streams:
    """`count` event streams held open on a thread of their own, until `close()`."""

    def __init__(self, gateway: Gateway, service: BenchService, task_ids: list[str]) -> None:
        self.opened = 0
        self.comments = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._hold(gateway, service, task_ids)), daemon=True
        )
        self._thread.start()

    async def _hold(self, gateway: Gateway, service: BenchService, task_ids: list[str]) -> None:
        limits = httpx.Limits(max_connections=len(task_ids) + 10)
        async with httpx.AsyncClient(
            base_url=gateway.url, auth=service.auth, limits=limits, timeout=None
        ) as http:
            readers = [asyncio.create_task(self._read(http, service, t)) for t in task_ids]
            while self.opened < len(task_ids) and not self._stop.is_set():
                await asyncio.sleep(0.05)
            self._ready.set()
            while not self._stop.is_set():
                await asyncio.sleep(0.1)
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def _read(self, http: httpx.AsyncClient, service: BenchService, task_id: str) -> None:
        async with http.stream("GET", f"{service.tasks_path}/{task_id}/events") as response:
            response.raise_for_status()
            self.opened += 1
            async for line in response.aiter_lines():
                if line.startswith(":"):
                    self.comments += 1

    def wait_open(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


def open_streams_gauge(gateway: Gateway) -> float | None:
    for line in httpx.get(f"{gateway.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("conveyor_gateway_event_streams "):
            return float(line.split()[1])
    return None


def load(gateway: Gateway, service: BenchService, request: dict[str, Any], options: Any) -> Any:
    job = {
        "url": gateway.url,
        "mode": "closed",
        "requests": [request],
        "concurrency": options.concurrency,
        "duration": options.duration,
        "warmup": 0.5,
        "auth": list(service.auth),
    }
    return run_json(
        [PYTHON, "-m", "bench.loadgen", json.dumps(job)], timeout=options.duration * 3 + 60
    )


def submit(gateway: Gateway, service: BenchService, count: int) -> list[str]:
    """`count` tasks that stay PENDING (no dispatcher runs), in batches of 1,000."""
    ids: list[str] = []
    with httpx.Client(base_url=gateway.url, auth=service.auth, timeout=60) as http:
        while len(ids) < count:
            items = [{"body": {"n": i}} for i in range(min(1000, count - len(ids)))]
            answer = http.post(f"{service.tasks_path}/batch", json={"tasks": items})
            answer.raise_for_status()
            ids += [t["taskId"] for t in answer.json()["data"]["tasks"]]
    return ids


def run(options: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "streams",
        "meta": metadata("bench.streams", vars(options)),
    }
    runs: list[dict[str, Any]] = []
    with fresh_database() as database_url, processes() as procs:
        service = create_service(database_url, bcrypt_rounds=4)
        gateway = start_bench_gateway(procs, database_url)
        followed = submit(gateway, service, options.streams)
        polled = followed[0]
        requests = {
            "create": {"method": "POST", "path": service.tasks_path, "body": {"body": {"n": 1}}},
            "poll": {"method": "GET", "path": f"{service.tasks_path}/{polled}"},
        }
        for rep in range(options.reps):
            for streams_open in (0, options.streams) if rep % 2 == 0 else (options.streams, 0):
                banner(f"repetition {rep + 1}/{options.reps}: {streams_open} streams open")
                held = Streams(gateway, service, followed[:streams_open]) if streams_open else None
                if held is not None and not held.wait_open(120):
                    raise RuntimeError(f"only {held.opened} streams opened")
                gauge = open_streams_gauge(gateway)
                for kind, request in requests.items():
                    report = load(gateway, service, request, options)
                    found = {
                        "streams": streams_open,
                        "kind": kind,
                        "rep": rep + 1,
                        "gauge_during": gauge,
                        "throughput_rps": report["throughput_rps"],
                        "p50_ms": report["latency_ms"]["p50"],
                        "p99_ms": report["latency_ms"]["p99"],
                        "statuses": report["statuses"],
                    }
                    runs.append(found)
                    print(
                        f"  {kind}: {found['throughput_rps']} req/s, p50 {found['p50_ms']} ms,"
                        f" p99 {found['p99_ms']} ms (streams gauge {gauge})",
                        flush=True,
                    )
                if held is not None:
                    held.close()
                    time.sleep(1.0)
        result["gauge_after_all_closed"] = open_streams_gauge(gateway)
    result["runs"] = runs
    result["summary"] = summarize(runs, options.streams)
    return result


def summarize(runs: list[dict[str, Any]], streams: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for kind in ("create", "poll"):
        mine = {
            n: [r for r in runs if r["kind"] == kind and r["streams"] == n] for n in (0, streams)
        }
        found[kind] = {
            str(n): {
                key: median(r[key] for r in rows) for key in ("throughput_rps", "p50_ms", "p99_ms")
            }
            for n, rows in mine.items()
        }
        found[kind]["p99_ratio_streams_over_none"] = ratio(
            found[kind][str(streams)]["p99_ms"], found[kind]["0"]["p99_ms"]
        )
    return found


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per load run")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse(argv))
    write_result("streams", result)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
