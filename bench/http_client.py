"""The dispatcher's HTTP call to its function, alone: CPU per call in the calling process.

The same no-op function (`bench.noop`, its own process), the same request (the CloudEvent
headers and a small JSON body, as `dispatcher.invoker.Invocation` builds them), `--calls`
calls at `--concurrency`, through:

* `aiohttp`: `dispatcher.invoker.Invoker`, what the sidecar runs;
* `httpx`: the call the invoker made until it moved to aiohttp (an `httpx.AsyncClient` with
  keep-alive, a prebuilt request sent with `stream=True`, the body read in chunks), which is
  also the bare consumer's client in `bench.floor`.

Alternating repetitions on uvloop; medians of CPU µs per call (this process only) and of
calls per second.

    python -m bench.http_client [--calls 4000] [--reps 3] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import uvloop

from bench.record import banner, metadata, write_result
from bench.stack import processes, start_noop_function
from bench.stats import median, ratio
from dispatcher.invoker import Invocation, Invoker

Call = Callable[[], Awaitable[int]]
TASK_ID = "0f0e0d0c-0b0a-4908-8706-050403020100"


def _invocation(url: str) -> Invocation:
    return Invocation(
        task_id=TASK_ID,
        attempt=1,
        deadline=datetime.now(UTC) + timedelta(minutes=5),
        body=b'{"n": 1, "text": "hello"}',
        ce_type="io.conveyor.task.submitted",
        ce_source="/v1/services/bench",
        ce_time=None,
        progress_url=f"{url}tasks/{TASK_ID}/progress",
    )


async def _aiohttp_calls(url: str, concurrency: int) -> tuple[Call, Callable[[], Awaitable[None]]]:
    invoker = Invoker(url, concurrency)
    invocation = _invocation(url)

    async def call() -> int:
        outcome = await invoker.call(invocation, 0, 30.0)
        return 0 if type(outcome).__name__ == "Success" else 1

    return call, invoker.close


async def _httpx_calls(url: str, concurrency: int) -> tuple[Call, Callable[[], Awaitable[None]]]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    client = httpx.AsyncClient(limits=limits, trust_env=False)
    target = httpx.URL(url)
    invocation = _invocation(url)

    async def call() -> int:
        request = httpx.Request(
            "POST",
            target,
            content=invocation.body,
            headers=invocation.headers(0),
            extensions={"timeout": httpx.Timeout(30.0).as_dict()},
        )
        async with asyncio.timeout(30.0):
            answer = await client.send(request, stream=True)
            try:
                chunks = [chunk async for chunk in answer.aiter_bytes()]
            finally:
                await answer.aclose()
        b"".join(chunks)
        return 0 if answer.status_code < 300 else 1

    return call, client.aclose


CLIENTS = {"aiohttp": _aiohttp_calls, "httpx": _httpx_calls}


async def measure(client: str, url: str, calls: int, concurrency: int) -> dict[str, Any]:
    call, close = await CLIENTS[client](url, concurrency)
    try:
        for _ in range(100):  # warm-up: connections open, code paths hot
            await call()
        left = calls
        failures = 0

        async def worker() -> None:
            nonlocal left, failures
            while left > 0:
                left -= 1
                failures += await call()

        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await close()
    return {
        "client": client,
        "calls": calls,
        "failures": failures,
        "cpu_us_per_call": round(cpu / calls * 1e6, 1),
        "calls_per_s": round(calls / wall, 1),
    }


def run(options: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "http_client",
        "meta": metadata("bench.http_client", vars(options)),
        "runs": [],
    }
    banner(f"{options.calls} calls at concurrency {options.concurrency}, {options.reps} reps")
    with processes() as procs:
        function = start_noop_function(procs)
        for rep in range(1, options.reps + 1):
            order = ("aiohttp", "httpx") if rep % 2 else ("httpx", "aiohttp")
            for client in order:
                run_ = uvloop.run(measure(client, function.url, options.calls, options.concurrency))
                run_["rep"] = rep
                print(f"  {run_}")
                result["runs"].append(run_)
    summary = {}
    for client in CLIENTS:
        mine = [r for r in result["runs"] if r["client"] == client]
        summary[client] = {
            "cpu_us_per_call": median([r["cpu_us_per_call"] for r in mine]),
            "calls_per_s": median([r["calls_per_s"] for r in mine]),
        }
    result["clients"] = summary
    result["cpu_ratio_httpx_to_aiohttp"] = ratio(
        summary["httpx"]["cpu_us_per_call"], summary["aiohttp"]["cpu_us_per_call"]
    )
    print(f"  medians: {summary}, httpx/aiohttp CPU {result['cpu_ratio_httpx_to_aiohttp']}")
    return result


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    write_result("http_client", run(parse(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
