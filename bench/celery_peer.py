"""The Celery 5 peer of the end-to-end benchmark, configured as SPEC §10 says.

Each task POSTs to the same no-op HTTP function as Conveyor's dispatcher does
(one keep-alive `httpx.Client` per worker process), with late acks, a prefetch
multiplier of 1, and results stored by the SQLAlchemy backend in PostgreSQL.
Celery is used as a library, configured from the environment:

    BENCH_CELERY_BROKER    amqp://guest:guest@127.0.0.1:5672//
    BENCH_CELERY_BACKEND   db+postgresql+psycopg://postgres@127.0.0.1:5432/<bench db>
    BENCH_CELERY_QUEUE     the queue of this run (unique per run)
    BENCH_FUNCTION_URL     the no-op function

The worker is started by `bench.e2e` as
`celery -A bench.celery_peer worker --pool=prefork --concurrency=4 -Q <queue>`.
This module also submits (in its own process, like Conveyor's load generator):

    python -m bench.celery_peer submit --count 5000            # as fast as possible
    python -m bench.celery_peer sequential --count 200 --gap 0.05
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from celery import Celery

BROKER = os.environ.get("BENCH_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
BACKEND = os.environ.get(
    "BENCH_CELERY_BACKEND", "db+postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
QUEUE = os.environ.get("BENCH_CELERY_QUEUE", "celery-bench")
FUNCTION_URL = os.environ.get("BENCH_FUNCTION_URL", "http://127.0.0.1:8080/")

app = Celery("bench", broker=BROKER, backend=BACKEND)
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_default_queue=QUEUE,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_client: httpx.Client | None = None


def _http() -> httpx.Client:
    """One keep-alive client per worker process, created after the fork."""
    global _client
    if _client is None:
        _client = httpx.Client(timeout=30.0, trust_env=False)
    return _client


@app.task(name="bench.noop", bind=True)
def noop(self: Any) -> Any:
    answer = _http().post(
        FUNCTION_URL,
        content=b"{}",
        headers={"content-type": "application/json", "x-task-id": self.request.id},
    )
    answer.raise_for_status()
    return answer.json()


# ---------------------------------------------------------------------------
# the submitting side


def submit(count: int, threads: int) -> dict[str, Any]:
    """`count` tasks as fast as the client publishes them; times are time.time()."""
    noop.apply_async(queue=QUEUE)  # opens the producer connection (not timed)
    first = time.time()
    per_thread = [count // threads + (1 if i < count % threads else 0) for i in range(threads)]

    def publish(n: int) -> None:
        for _ in range(n):
            noop.apply_async(queue=QUEUE)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(publish, per_thread))
    return {"first_sent": first, "last_sent": time.time(), "count": count + 1}


def sequential(count: int, gap: float) -> dict[str, Any]:
    """One at a time: [task id, sent, answered, 200] per task (answered = publish returned)."""
    noop.apply_async(queue=QUEUE)
    samples = []
    for _ in range(count):
        sent = time.time()
        result = noop.apply_async(queue=QUEUE)
        samples.append([result.id, sent, time.time(), 200])
        time.sleep(gap)
    return {"samples": samples, "extra": 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Submit no-op tasks to the Celery peer")
    parser.add_argument("mode", choices=["submit", "sequential"])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gap", type=float, default=0.05)
    options = parser.parse_args(argv)
    if options.mode == "submit":
        print(json.dumps(submit(options.count, options.threads)))
    else:
        print(json.dumps(sequential(options.count, options.gap)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
