"""SIGTERM and SIGINT, and the two ways of stopping (SPEC §7.1).

Kubernetes stops a pod with SIGTERM, then SIGKILL after
`terminationGracePeriodSeconds`. The dispatcher turns the first signal into a
`Shutdown.requested` event; any later signal is logged and otherwise ignored
(Kubernetes and container runtimes sometimes deliver it twice).

Once consuming has stopped, in-flight work is settled according to
`SHUTDOWN_MODE`:

* `requeue` (interruptible tasks, the default): every in-flight call is aborted
  at once and its message handed back to the queue, no terminal event.
* `drain` (short, non-interruptible tasks): in-flight calls may finish until
  `DRAIN_TIMEOUT`; whatever is still running then is aborted and handed back.

Consuming stops first, with `basic.cancel`: the dispatcher has a single
consumer channel (prefetch = CONCURRENCY) rather than the seed's channel per
listener, so once that consumer is cancelled no idle listener is left to grab
a message that is being handed back.

"Handed back" is not a `basic.nack(requeue=true)`: on a quorum queue every
such nack counts toward `x-delivery-limit`, and a long task interrupted by a
few scale-ins would be dead-lettered as poison. The worker republishes the
message to `<q>-in` with confirms, then acks the original (see worker.py). An
`AbortToken` per delivery is how this module reaches into the worker: it
interrupts the HTTP call or the backoff pause, and nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable
from typing import Protocol, TypeVar

from conveyor.dispatcher_settings import ShutdownMode

log = logging.getLogger(__name__)
T = TypeVar("T")

# After aborting, how long republish+ack of every in-flight message may take.
REQUEUE_GRACE = 5.0


class Aborted(Exception):
    """The delivery was interrupted by a shutdown; its message goes back."""


class AbortToken:
    """Interrupts one delivery's function call or backoff pause, on request.

    The guarded work runs in the caller's own task, and an abort cancels that task, as
    `asyncio.timeout` does: no task of its own per call, no wait on two futures, and a
    cancellation from anyone else still propagates as one."""

    def __init__(self) -> None:
        self._aborted = False
        self._guarded: asyncio.Task[object] | None = None  # the task inside `guard`, if any
        self._cancelled_it = False

    @property
    def aborted(self) -> bool:
        return self._aborted

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        if self._guarded is not None:
            self._cancelled_it = True
            self._guarded.cancel()

    async def guard(self, work: Awaitable[T]) -> T:
        """Runs `work` unless aborted first; an abort cancels it and raises `Aborted`."""
        if self._aborted:
            _discard(work)
            raise Aborted
        task = asyncio.current_task()
        assert task is not None, "guard runs in a task"
        cancelling = task.cancelling()
        self._guarded = task
        try:
            result = await work
        except asyncio.CancelledError:
            if self._cancelled_it and task.uncancel() <= cancelling:
                raise Aborted from None
            raise  # someone else's cancellation (ours is counted off)
        finally:
            self._guarded = None
        if self._cancelled_it:  # aborted as it ended, and the work swallowed the cancel
            task.uncancel()
            raise Aborted
        return result

    async def sleep(self, seconds: float) -> None:
        await self.guard(asyncio.sleep(seconds))


def _discard(work: Awaitable[object]) -> None:
    close = getattr(work, "close", None)
    if close is not None:
        close()


class Shutdown:
    """The first SIGTERM/SIGINT requests a shutdown; later ones are harmless."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = asyncio.Event()

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)

    def uninstall(self) -> None:
        """At the very end: a late signal must not turn the exit code 0 into 143.

        The process is exiting anyway, so further signals are ignored. Removing the
        loop's handler restores the default action (die by the signal) for the instant
        before SIG_IGN replaces it: the signals are blocked meanwhile, so that one sent in
        that instant waits, and SIG_IGN discards it (seen in CI: a dispatcher signalled
        every millisecond died by one).
        """
        loop = asyncio.get_running_loop()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        try:
            for sig in self.SIGNALS:
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def request(self, reason: str) -> None:
        if self.requested.is_set():
            log.info("already shutting down; ignoring %s", reason)
            return
        log.info("shutting down", extra={"reason": reason})
        self.requested.set()

    def _on_signal(self, sig: signal.Signals) -> None:
        self.request(sig.name)


class InFlightWork(Protocol):
    def __len__(self) -> int: ...

    def abort_all(self) -> None: ...

    async def wait_idle(self, timeout: float) -> bool: ...


async def settle(work: InFlightWork, mode: ShutdownMode, drain_timeout: float) -> None:
    """Called after consuming stopped: finish or hand back what is in flight."""
    if mode is ShutdownMode.DRAIN and len(work):
        log.info("draining", extra={"in_flight": len(work), "drain_timeout": drain_timeout})
        if await work.wait_idle(drain_timeout):
            return
        log.warning("drain timeout reached; requeueing the rest", extra={"in_flight": len(work)})
    if len(work):
        log.info("requeueing in-flight tasks", extra={"in_flight": len(work)})
    work.abort_all()
    if not await work.wait_idle(REQUEUE_GRACE):
        # Unacked messages return to the queue when the connection closes.
        log.warning("in-flight tasks did not settle in time", extra={"in_flight": len(work)})
