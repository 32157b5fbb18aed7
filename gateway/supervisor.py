"""Keeps the gateway's background loops alive, and says which are not doing their work.

A loop that raises, or returns when it should run forever, is logged, counted
and started again after a backoff, so one unexpected exception never leaves
results unapplied or callbacks unsent for the life of the process. While a loop
waits for its restart it is reported down, and `/readyz` says which (503).

A loop that catches its own errors and tries again (the reaper, the relay, the listener…)
never crashes, yet it may fail every pass. It says so with `pass_failed` and `pass_succeeded`:
its failures are counted, and `/readyz` names it under `failing` until a pass succeeds,
without turning 503 (the API still serves; an outage of the database or the broker has its
own check). The loop is found through the context its supervisor set, so that a loop's
signature stays its own and a loop run outside a supervisor (a test) reports to nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from conveyor import logs
from gateway import metrics

log = logging.getLogger("conveyor.gateway.supervisor")

LoopFactory = Callable[[], Awaitable[None]]


class LoopEnded(RuntimeError):
    """A loop meant to run forever returned."""


class LoopCancelled(RuntimeError):
    """A loop was cancelled from within: a library cancelled a future it awaited (aiormq
    does, closing a connection it found stuck). Only `stop()` cancels a loop for good."""


# A run this long was healthy: a crash after it starts the backoff over (one crash a day
# waits the first backoff, not the longest one reached during last week's outage).
HEALTHY_RUN = 60.0
# How long stop() waits for the cancelled loops to end.
STOP_PATIENCE = 5.0
_STREAK_CAP = 64  # 2**63 times any backoff is past any maximum; more would overflow a float


class Supervisor:
    def __init__(self, backoff: float = 0.5, backoff_max: float = 10.0) -> None:
        self._backoff = backoff
        self._backoff_max = backoff_max
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._down: dict[str, str] = {}  # loop -> why it is waiting for a restart
        self._failing: dict[str, str] = {}  # loop -> why its last pass failed
        self._started: dict[str, float] = {}  # loop -> when its current run started
        self._streak: dict[str, int] = {}  # loop -> crashes in a row, each soon after a start

    def spawn(self, name: str, loop: LoopFactory) -> None:
        self._tasks[name] = asyncio.create_task(self._keep(name, loop), name=name)

    def failing(self) -> dict[str, str]:
        """The loops whose last pass failed, with its error."""
        return dict(self._failing)

    def down(self) -> dict[str, str]:
        """The loops that are not running now, with their last error."""
        down = dict(self._down)
        for name, task in self._tasks.items():
            if task.done() and name not in down:  # only after stop(), or a bug in _keep
                down[name] = "stopped"
        return down

    async def stop(self) -> None:
        """Cancels every loop and waits STOP_PATIENCE at most for them to end: a loop whose
        cleanup waits on an answer that never comes must not hold the process's shutdown (an
        old worker of `--workers` would keep the loops' lock, and no worker would run them)."""
        for task in self._tasks.values():
            task.cancel()
        tasks = list(self._tasks.values())
        if not tasks:
            return
        _, left = await asyncio.wait(tasks, timeout=STOP_PATIENCE)
        for task in left:
            log.warning(
                "a loop did not end in time; shutting down without it",
                extra={"loop": task.get_name()},
            )

    async def _keep(self, name: str, loop: LoopFactory) -> None:
        _current.set((self, name))  # this task's context, which the loop's own tasks inherit
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(Exception),  # cancellation ends the loop for good
            wait=lambda state: self._pause(name),
            before_sleep=lambda state: self._crashed(name, state),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                self._down.pop(name, None)
                self._started[name] = time.monotonic()
                try:
                    await loop()
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is None or task.cancelling():
                        raise  # stop(): the loop ends for good
                    raise LoopCancelled(f"{name} was cancelled from within") from None
                raise LoopEnded(f"{name} returned")

    def _pause(self, name: str) -> float:
        """Exponential in the crashes that came soon after a start, in a row."""
        healthy = time.monotonic() - self._started.get(name, 0.0) >= HEALTHY_RUN
        streak = 1 if healthy else min(self._streak.get(name, 0) + 1, _STREAK_CAP)
        self._streak[name] = streak
        return float(min(self._backoff * 2.0 ** (streak - 1), self._backoff_max))

    def note_failed(self, name: str, error: BaseException) -> None:
        self._failing[name] = logs.describe(error)
        metrics.child(metrics.LOOP_FAILURES, name).inc()

    def note_succeeded(self, name: str) -> None:
        self._failing.pop(name, None)

    def _crashed(self, name: str, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        self._down[name] = logs.describe(error)
        metrics.child(metrics.LOOP_RESTARTS, name).inc()
        log.error(
            "background loop crashed; restarting",
            exc_info=error,
            extra={"loop": name, "restart_in": round(state.upcoming_sleep, 2)},
        )


_current: ContextVar[tuple[Supervisor, str] | None] = ContextVar("supervised_loop", default=None)


def pass_failed(error: BaseException) -> None:
    """The calling loop's pass failed, and the loop will try again by itself."""
    current = _current.get()
    if current is not None:
        supervisor, name = current
        supervisor.note_failed(name, error)


@contextlib.contextmanager
def one_pass(
    logger: logging.Logger, failed: str, errors: tuple[type[BaseException], ...]
) -> Iterator[None]:
    """One pass of a loop that tries again by itself: `errors` fail the pass (counted, named
    in /readyz, logged as `failed`) instead of crashing the loop; else the pass succeeded."""
    try:
        yield
    except errors as exc:
        pass_failed(exc)
        logger.warning(failed, extra={"error": logs.describe(exc)})
    else:
        pass_succeeded()


def pass_succeeded() -> None:
    """The calling loop's pass did its work: it is no longer named as failing."""
    current = _current.get()
    if current is not None:
        supervisor, name = current
        supervisor.note_succeeded(name)
