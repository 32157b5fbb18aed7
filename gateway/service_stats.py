"""What an operator sees of each service (SPEC §11.6): the admin API, the dashboard and the
per-service gauges read the same figures from here.

Every figure is bounded, so that it stays cheap with millions of finished rows: PENDING
tasks are the counts the triggers keep (`task_backlog`, a few rows however deep the backlog),
IN_PROGRESS ones are counted through a partial index whose size follows the running tasks; finished tasks only over the last hour, as index-only scans of `ix_tasks_finished`
(which includes the outcome and the start date), and run-time percentiles over at most the
newest `SAMPLE` of them. Throughput is counted in 5-minute buckets, each closed bucket once;
a snapshot then reads only the last few minutes' rows. Counting every finished task ever kept would scan the whole history
(0.3 s at a million rows, bench/README.md); the Prometheus counters give all-time totals. Queue depths come from the broker by passive declare, the
broker's own count (ready messages), and are `None` when it does not answer.

One snapshot serves every reader for `max_age` seconds (single flight), so ten open
dashboards cost what one does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from conveyor import logs, topology
from conveyor.connection import TRANSPORT_ERRORS
from gateway import metrics, supervisor
from gateway.broker import Broker
from gateway.pgpool import CONNECTION_ERRORS, Pool

log = logging.getLogger("conveyor.gateway.service_stats")

BUCKET_SECONDS = 300  # throughput of the last hour in 12 bars of 5 minutes
BUCKETS = 12
SAMPLE = 10_000
SETTLE = 60.0  # results of a closed bucket still arriving (a slow result batch)
QUEUE_TIMEOUT = 2.0

_FIGURES = """
    SELECT s.name, s.queue_name, live.pending, live.running, due.oldest, runs.p50, runs.p95
    FROM services s
    CROSS JOIN LATERAL (
        SELECT (SELECT COALESCE(sum(b.pending), 0)::bigint FROM task_backlog b
                WHERE b.service = s.name) AS pending,
               (SELECT count(*) FROM tasks t
                WHERE t.service = s.name AND t.status = 'IN_PROGRESS') AS running
    ) live
    CROSS JOIN LATERAL (
        SELECT least(
            (SELECT t.submission_date FROM tasks t
             WHERE t.service = s.name AND t.status = 'PENDING' AND t.not_before IS NULL
             ORDER BY t.id LIMIT 1),
            (SELECT min(t.not_before) FROM tasks t
             WHERE t.service = s.name AND t.status = 'PENDING' AND t.not_before <= now())
        ) AS oldest
    ) due
    CROSS JOIN LATERAL (
        SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY r.seconds) AS p50,
               percentile_cont(0.95) WITHIN GROUP (ORDER BY r.seconds) AS p95
        FROM (SELECT extract(epoch FROM t.end_date - t.start_date)::float8 AS seconds
              FROM tasks t
              WHERE t.service = s.name AND t.status IN ('SUCCESS', 'FAILURE')
                AND t.end_date > now() - interval '1 hour' AND t.start_date IS NOT NULL
              ORDER BY t.end_date DESC LIMIT %(sample)s) r
    ) runs
    ORDER BY s.name
    """

_THROUGHPUT = """
    SELECT s.name, b.bucket, b.status, b.n
    FROM services s
    CROSS JOIN LATERAL (
        SELECT floor(extract(epoch FROM t.end_date) / %(size)s)::bigint AS bucket, t.status,
               count(*) AS n
        FROM tasks t
        WHERE t.service = s.name AND t.status IN ('SUCCESS', 'FAILURE')
          AND t.end_date >= to_timestamp(%(since)s)
        GROUP BY 1, 2
    ) b
    """
Counts = dict[str, dict[str, int]]  # service -> outcome -> tasks


class ServiceStats:
    def __init__(self, pool: Pool, broker: Broker, max_age: float = 1.0) -> None:
        self.pool = pool
        self.broker = broker
        self.max_age = max_age
        self._taken = 0.0
        self._last: list[dict[str, Any]] = []
        self._lock = asyncio.Lock()
        self._settled: dict[int, Counts] = {}  # closed buckets, counted once

    @property
    def last(self) -> list[dict[str, Any]]:
        """The latest snapshot, without waiting (the metrics collector's view)."""
        return self._last

    async def snapshot(self) -> list[dict[str, Any]]:
        async with self._lock:
            if time.monotonic() - self._taken >= self.max_age:
                self._last = await self._take()
                self._taken = time.monotonic()
            return self._last

    async def refresh_loop(self, interval: float) -> None:
        """Keeps the gauges fresh when nobody looks at the dashboard."""
        while True:
            # the database away or stuck: tried again, not restarted (/readyz flapped)
            with supervisor.one_pass(log, "service figures not read", CONNECTION_ERRORS):
                await self.snapshot()
            await asyncio.sleep(interval)

    async def _take(self) -> list[dict[str, Any]]:
        current = int(time.time() // BUCKET_SECONDS)
        window = range(current - BUCKETS + 1, current + 1)
        since = min(b for b in window if b not in self._settled)
        async with self.pool.connection() as conn, conn.transaction():
            rows = await (await conn.execute(_FIGURES, {"sample": SAMPLE})).fetchall()
            params = {"size": BUCKET_SECONDS, "since": since * BUCKET_SECONDS}
            bars = await (await conn.execute(_THROUGHPUT, params)).fetchall()
        depths = await self._depths([row.queue_name for row in rows])
        counted = self._count(bars, range(since, current + 1), current)
        now = datetime.now(UTC)
        figures = []
        for row in rows:
            buckets = [
                {
                    outcome: counted[b].get(row.name, {}).get(outcome, 0)
                    for outcome in ("SUCCESS", "FAILURE")
                }
                for b in window
            ]
            oldest = row.oldest
            figures.append(
                {
                    "service": row.name,
                    "tasks": {"PENDING": row.pending, "IN_PROGRESS": row.running},
                    "finishedLastHour": {
                        outcome: sum(bar[outcome] for bar in buckets)
                        for outcome in ("SUCCESS", "FAILURE")
                    },
                    "oldestPendingAgeSeconds": (
                        None if oldest is None else max(0.0, (now - oldest).total_seconds())
                    ),
                    "queues": depths.get(row.queue_name, {"in": None, "out": None, "dlq": None}),
                    "runTimeSeconds": {"p50": row.p50, "p95": row.p95},
                    "throughput": {"bucketSeconds": BUCKET_SECONDS, "buckets": buckets},
                }
            )
        return figures

    def _count(self, bars: list[Any], queried: range, current: int) -> dict[int, Counts]:
        """The window's buckets: those just queried, the settled ones from before. A bucket
        settles (is never counted again) `SETTLE` seconds after it closed, so a snapshot
        reads only the last few minutes' rows however busy the hour was."""
        fresh: dict[int, Counts] = {b: {} for b in queried}
        for bar in bars:
            if bar.bucket in fresh:
                fresh[bar.bucket].setdefault(bar.name, {})[bar.status] = bar.n
        now = time.time()
        for b, counts in fresh.items():
            if (b + 1) * BUCKET_SECONDS + SETTLE <= now:
                self._settled[b] = counts
        for b in [b for b in self._settled if b <= current - BUCKETS]:
            del self._settled[b]
        return {**self._settled, **fresh}

    async def _depths(self, queue_names: list[str]) -> dict[str, dict[str, int | None]]:
        """Each service's ready messages in `-in`, `-out` and `-dlq` (None: not declared yet),
        on the broker's kept probe channel: a channel opened and closed at every pass left
        ~4.4 KB on the connection each time (aio-pika 10.2), 25 MB a day at the default
        interval. `-out` holds the results no gateway has taken: growing, no process runs the
        background loops (found by a black-box sweep: with `--no-background` gateways alone,
        tasks stayed PENDING while their results piled up there, and nothing said so)."""
        found: dict[str, dict[str, int | None]] = {}
        try:
            async with asyncio.timeout(QUEUE_TIMEOUT):
                for name in queue_names:
                    found[name] = {
                        "in": await self._depth(topology.in_queue(name)),
                        "out": await self._depth(topology.out_queue(name)),
                        "dlq": await self._depth(topology.dead_letter_queue(name)),
                    }
        except Exception as exc:  # the broker down or slow: depths unknown, figures still shown
            log.warning("queue depths unavailable", extra={"error": logs.describe(exc)})
        return found

    async def _depth(self, queue: str) -> int | None:
        try:
            return await self.broker.ready_messages(queue)
        except TRANSPORT_ERRORS:
            raise  # the connection lost or frozen: no depth this pass
        except Exception:  # this queue's own (a channel error): no depth to show, the next one
            return None


class ServiceGauges(Collector):
    """The per-service gauges of SPEC §11.6, read from the latest snapshot at scrape time."""

    def __init__(self, stats: ServiceStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        tasks = GaugeMetricFamily(
            "conveyor_service_tasks",
            "Tasks PENDING or IN_PROGRESS now",
            labels=["service", "status"],
        )
        oldest = GaugeMetricFamily(
            "conveyor_service_oldest_pending_seconds",
            "Age of the oldest due PENDING task",
            labels=["service"],
        )
        queues = GaugeMetricFamily(
            "conveyor_service_queue_messages",
            "Messages ready in the service's queues",
            labels=["service", "queue"],
        )
        for figures in self.stats.last:
            name = figures["service"]
            for status, count in figures["tasks"].items():
                tasks.add_metric([name, status], count)
            oldest.add_metric([name], figures["oldestPendingAgeSeconds"] or 0.0)
            for queue, depth in figures["queues"].items():
                if depth is not None:
                    queues.add_metric([name, queue], depth)
        yield from (tasks, oldest, queues)


_gauges: ServiceGauges | None = None


def register_gauges(stats: ServiceStats) -> None:
    """One collector per process on the registry /metrics renders; a second
    app in the same process (tests) points it at its own figures."""
    global _gauges
    if _gauges is None:
        _gauges = ServiceGauges(stats)
        metrics.EXPOSED.register(_gauges)
    else:
        _gauges.stats = stats
