"""A server's cyclic garbage collector: what it walks, how often, and how long it stops.

A gateway holds ~130,000 objects once FastAPI, SQLAlchemy, aio-pika and its routes are
loaded, a sidecar ~48,000; they live as long as the process. CPython's cyclic collector walks
every one of them at each full collection (~75 ms for the gateway on a busy 2-core VM, measured
every ~1,500 submissions), and the event loop answers nothing meanwhile: under load that pause
is a request's p99. Once the process is ready, `gc.freeze()` moves them to a generation the
collector never walks (a cycle among frozen objects is never freed, hence the collection just
before), and the youngest generation's threshold goes from 700 to 7,000 allocations: a
server's objects mostly die by reference counting, and a young collection costs about the
same however many were allocated, so it runs ten times less often for the same work.
`watch_pauses` reports every collection's duration, so a stall shows in the metrics; `serve`
does both for a server, into its `*_gc_pause_seconds` histogram.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import Histogram

YOUNG_THRESHOLD = 7_000
PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


def serve(pauses: Histogram) -> int:
    """A server is ready: freeze its start-up objects, then time every collection into
    `pauses` (labelled by `generation`, each exported from 0); answer how many were frozen."""
    frozen = freeze_startup_objects()
    children = {str(g): pauses.labels(str(g)) for g in range(3)}
    watch_pauses(lambda generation, seconds: children[generation].observe(seconds))
    return frozen


def freeze_startup_objects() -> int:
    """Collect the start-up's garbage, freeze what is left, collect the young less often;
    answer how many objects were frozen."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
    return gc.get_freeze_count()


def watch_pauses(observe: Callable[[str, float], None]) -> None:
    """Call `observe(generation, seconds)` after each collection: the time the process stood
    still. `observe` runs inside the collector, so it must be quick and must not raise."""
    started = time.perf_counter()

    def on_collection(phase: str, info: dict[str, int]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            observe(str(info["generation"]), time.perf_counter() - started)

    gc.callbacks.append(on_collection)
