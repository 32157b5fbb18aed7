"""Keeps the gateway's background loops alive.

A loop that raises, or returns when it should run forever, is logged, counted
and started again after a backoff, so one unexpected exception never leaves
results unapplied or callbacks unsent for the life of the process. While a loop
waits for its restart it is reported down, and `/readyz` says which.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from conveyor import logs
from gateway import metrics

log = logging.getLogger("conveyor.gateway.supervisor")

LoopFactory = Callable[[], Awaitable[None]]


class LoopEnded(RuntimeError):
    """A loop meant to run forever returned."""


class LoopCancelled(RuntimeError):
    """A loop was cancelled from within: a library cancelled a future it awaited (aiormq
    does, closing a connection it found stuck). Only `stop()` cancels a loop for good."""


class Supervisor:
    def __init__(self, backoff: float = 0.5, backoff_max: float = 10.0) -> None:
        self._wait = wait_exponential(multiplier=backoff, max=backoff_max)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._down: dict[str, str] = {}  # loop -> why it is waiting for a restart

    def spawn(self, name: str, loop: LoopFactory) -> None:
        self._tasks[name] = asyncio.create_task(self._keep(name, loop), name=name)

    def down(self) -> dict[str, str]:
        """The loops that are not running now, with their last error."""
        down = dict(self._down)
        for name, task in self._tasks.items():
            if task.done() and name not in down:  # only after stop(), or a bug in _keep
                down[name] = "stopped"
        return down

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _keep(self, name: str, loop: LoopFactory) -> None:
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(Exception),  # cancellation ends the loop for good
            wait=self._wait,
            before_sleep=lambda state: self._crashed(name, state),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                self._down.pop(name, None)
                try:
                    await loop()
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is None or task.cancelling():
                        raise  # stop(): the loop ends for good
                    raise LoopCancelled(f"{name} was cancelled from within") from None
                raise LoopEnded(f"{name} returned")

    def _crashed(self, name: str, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        self._down[name] = logs.describe(error)
        metrics.child(metrics.LOOP_RESTARTS, name).inc()
        log.error(
            "background loop crashed; restarting",
            exc_info=error,
            extra={"loop": name, "restart_in": round(state.upcoming_sleep, 2)},
        )
