"""Prometheus metrics of the gateway, declared once and imported where counted.

With `conveyor gateway --workers N` every worker counts into files in PROMETHEUS_MULTIPROC_DIR
(prometheus_client's multiprocess mode, set by the supervisor before any worker starts), and
`/metrics`, whichever worker answers, reads them all: one set of figures for the port.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from conveyor import heap

MULTIPROCESS = "PROMETHEUS_MULTIPROC_DIR" in os.environ


def _exposed() -> CollectorRegistry:
    if not MULTIPROCESS:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return registry


EXPOSED = _exposed()  # what /metrics renders; per-process collectors register here too

# A live gauge's file of one worker: `gauge_livesum_<pid>.db` (prometheus_client's naming).
_LIVE_GAUGES = re.compile(r"gauge_live[a-z]*_(\d+)\.db")


def forget_dead_workers() -> None:
    """The live gauges (streams open, slow callback targets) are the sum of each worker's file:
    a worker killed, or ended by a SIGHUP, left its own, counted for good (found by a black-box
    sweep: 20 streams counted, none open). Before each scrape, the files of processes that
    no longer run go (prometheus_client's `mark_process_dead`, which gunicorn calls from a hook
    uvicorn's supervisor does not have); counters keep every worker's counts."""
    if not MULTIPROCESS:
        return
    folder = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        found = _LIVE_GAUGES.fullmatch(name)
        if found and not _running(int(found[1])):
            mark_process_dead(int(found[1]), folder)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.cache
def child(metric: Any, *values: str) -> Any:
    """`metric.labels(*values)`, made once: `labels()` takes a lock and builds its key on
    every call, several times per task on the hot paths. Label values are bounded (routes,
    services, outcomes), and so is this cache."""
    return metric.labels(*values)


REQUESTS = Counter("conveyor_gateway_requests_total", "API answers", ["route", "status"])
SUBMITTED = Counter("conveyor_gateway_tasks_submitted_total", "Tasks accepted", ["service"])
PUBLISHED = Counter("conveyor_gateway_published_total", "Submissions confirmed", ["path"])
EVENTS = Counter("conveyor_gateway_events_total", "Task events read from -out", ["kind", "outcome"])
POISON = Counter("conveyor_gateway_poison_messages_total", "Messages set aside", ["queue_kind"])
DEAD_LETTERED = Counter("conveyor_gateway_dead_lettered_total", "Submissions from -dlq")
RETURNED = Counter(
    "conveyor_gateway_returned_submissions_total",
    "Dead-lettered submissions the broker returned without a crash, published again",
)
NOTIFICATIONS = Counter("conveyor_gateway_notifications_total", "Callbacks", ["outcome"])
REAPED = Counter("conveyor_gateway_reaped_total", "PENDING tasks failed by the reaper")
ABANDONED = Counter(
    "conveyor_gateway_abandoned_total", "IN_PROGRESS tasks failed by the watchdog (no result)"
)
BROKEN_TOPOLOGY = Counter(
    "conveyor_gateway_broken_topology_total",
    "Services whose queues exist with other arguments than the gateway declares",
    ["service"],
)
TABLES_ANALYZED = Counter(
    "conveyor_gateway_tables_analyzed_total",
    "ANALYZEs run by the gateway on tables autovacuum leaves alone",
    ["table"],
)
BATCHES_HANDED_BACK = Counter(
    "conveyor_gateway_result_batches_handed_back_total",
    "Result batches nacked back to the broker after an unexpected error",
)
RESULTS_HELD = Counter(
    "conveyor_gateway_results_held_total",
    "Results put back to their queue because their task's row was locked by a transaction",
)
RESULTS_DEFERRED = Counter(
    "conveyor_gateway_results_deferred_total",
    "Results handed back to their queue unread: those held weighed CONVEYOR_RESULTS_MEMORY",
)
RESULTS_RELEASED = Counter(
    "conveyor_gateway_results_released_total",
    "Times the database refused results long enough that they were handed back to the broker",
)
REPLACED_CHANNELS_REOPENED = Counter(
    "conveyor_gateway_replaced_channels_reopened_total",
    "Replaced results channels a broker reconnection reopened, closed again",
)
# Where a submission's answer waits (bench.e2e reads it for its idle probes): "store" is the
# commit of its row(s), "publish" the broker's confirm of what it published before answering.
SUBMIT_PHASES = Histogram(
    "conveyor_gateway_submit_phase_seconds",
    "Phases of a submission before its answer: store (commit), publish (confirm)",
    ["phase"],
    buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.5, 2, 5),
)
LOOP_RESTARTS = Counter(
    "conveyor_gateway_loop_restarts_total", "Background loops restarted after a crash", ["loop"]
)
LOOP_FAILURES = Counter(
    "conveyor_gateway_loop_failures_total",
    "Passes of a background loop that failed, the loop trying again by itself",
    ["loop"],
)
CALLBACK_SLOW_TARGETS = Gauge(
    "conveyor_gateway_callback_slow_targets",
    "Callback targets that let an attempt time out lately: they take only the slots that"
    " leave CALLBACK_PER_TARGET free",
    multiprocess_mode="livesum",  # only the process that runs the notifier sets it
)
EVENT_STREAMS = Gauge(
    "conveyor_gateway_event_streams",
    "Task event streams open (SSE)",
    multiprocess_mode="livesum",  # all workers' streams
)
GC_PAUSES = Histogram(
    "conveyor_gateway_gc_pause_seconds",
    "Cyclic garbage collections by generation: the event loop stood still this long",
    ["generation"],
    buckets=heap.PAUSE_BUCKETS,
)
AUTH_FAILURES = Counter("conveyor_gateway_auth_failures_total", "403001 answers")
LATENCY = Histogram(
    "conveyor_gateway_request_seconds",
    "API latency",
    ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)

# Task life (SPEC §11.6), counted where the gateway applies a terminal transition: once per
# task, by the statement that really ended it (a duplicate terminal event ends nothing).
_TASK_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)
QUEUE_WAIT = Histogram(
    "conveyor_task_queue_wait_seconds",
    "Task start minus submission (minus notBefore for a task run later)",
    ["service"],
    buckets=_TASK_BUCKETS,
)
RUN_TIME = Histogram(
    "conveyor_task_run_seconds", "Task end minus start", ["service"], buckets=_TASK_BUCKETS
)
FINISHED = Counter(
    "conveyor_tasks_finished_total",
    "Tasks ended, by outcome (SUCCESS | FAILURE; expired, abandoned and cancelled are FAILURE)",
    ["service", "outcome"],
)


def task_finished(
    service: str, outcome: str, waited: float | None, ran: float | None, count: int = 1
) -> None:
    """One task ended (or `count` of them, by the reaper): durations when it ever started."""
    child(FINISHED, service, outcome).inc(count)
    if waited is not None:
        child(QUEUE_WAIT, service).observe(waited)
    if ran is not None:
        child(RUN_TIME, service).observe(ran)
