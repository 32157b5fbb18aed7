"""Prometheus metrics of one dispatcher process, served on `/metrics`.

A registry of its own (with the process collector for RSS and CPU) rather than
the global one, so that two dispatchers in one test process do not collide.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from conveyor import heap

_PREFIX = "conveyor_dispatcher"
CALL_OUTCOMES = ("success", "failure", "retryable", "timeout", "aborted", "error")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.received = Counter(
            f"{_PREFIX}_tasks_received", "Deliveries taken from -in.", registry=r
        )
        self.succeeded = Counter(
            f"{_PREFIX}_tasks_succeeded",
            "Tasks ended with a confirmed succeeded event.",
            registry=r,
        )
        self.failed = Counter(
            f"{_PREFIX}_tasks_failed", "Tasks ended with a confirmed failed event.", registry=r
        )
        self.retried = Counter(
            f"{_PREFIX}_function_retries",
            "Function calls retried after a retryable answer.",
            registry=r,
        )
        self.requeued = Counter(
            f"{_PREFIX}_tasks_requeued", "Deliveries handed back to -in on shutdown.", registry=r
        )
        self.cancelled = Counter(
            f"{_PREFIX}_tasks_cancelled",
            "Deliveries acked without a result because their task was cancelled.",
            registry=r,
        )
        self.expired = Counter(
            f"{_PREFIX}_tasks_expired",
            "Deliveries acked without a call because their task's expiry had passed.",
            registry=r,
        )
        self.poison = Counter(
            f"{_PREFIX}_poison_messages", "Unreadable messages dead-lettered from -in.", registry=r
        )
        self.consumers_replaced = Counter(
            f"{_PREFIX}_consumers_replaced",
            "Consumers of -in replaced on a fresh channel after RECONSUME_IDLE_SECONDS"
            " without a delivery (a consumer the broker stopped feeding heals so).",
            registry=r,
        )
        self.in_flight = Gauge(
            f"{_PREFIX}_tasks_in_flight", "Deliveries being handled.", registry=r
        )
        self.calls = Counter(
            f"{_PREFIX}_function_calls",
            "HTTP calls to the function, by outcome: success, failure (final), retryable"
            " (408, 429, 5xx, network), timeout, aborted (cancel, shutdown), error (a bug).",
            ["outcome"],
            registry=r,
        )
        for outcome in CALL_OUTCOMES:  # exported at 0 from the start: rate() sees the 1st
            self.calls.labels(outcome=outcome)
        self.call_seconds = Histogram(
            f"{_PREFIX}_function_call_seconds",
            "Duration of one HTTP call to the function.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

        self.gc_pauses = Histogram(
            f"{_PREFIX}_gc_pause_seconds",
            "Cyclic garbage collections by generation: the event loop stood still this long.",
            ["generation"],
            buckets=heap.PAUSE_BUCKETS,
            registry=r,
        )

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
