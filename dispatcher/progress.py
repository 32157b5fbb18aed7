"""Progress reports from the function, coalesced before they reach the broker.

A function may POST progress as often as it likes (every loop iteration, say).
Publishing each report would cost a confirmed publish and a database write in
the gateway, so per task:

* the last (highest) value wins: values that do not increase are dropped, as
  progress is monotonic within an attempt;
* at most one publish per `PROGRESS_INTERVAL`; the first report goes out at
  once, later ones wait for the end of the interval;
* nothing is published after the terminal event: the worker closes the
  reporter (flushing, or not when the task is being requeued) before it
  publishes `succeeded` / `failed`.

`ProgressBoard` maps the task ids in flight to their reporter, for the local
API's `POST /tasks/{taskId}/progress`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Publish = Callable[[float], Awaitable[None]]


class ProgressReporter:
    def __init__(
        self,
        publish: Publish,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._publish = publish
        self._interval = interval
        self._clock = clock
        self._pending: float | None = None
        self._highest = float("-inf")  # published or pending
        self._last_publish = float("-inf")
        self._flusher: asyncio.Task[None] | None = None
        self._sending = False
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def offer(self, value: float) -> bool:
        """Records a report; False once the task is over (nothing will be published)."""
        if self._closed:
            return False
        if value <= self._highest:
            return True
        self._highest = value
        self._pending = value
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_loop())
        return True

    async def close(self, flush: bool) -> None:
        """Stops the reporter; with `flush`, the pending value goes out first."""
        self._closed = True
        flusher = self._flusher
        if flusher is not None:
            if not self._sending:  # a publish under way must land before the terminal event
                flusher.cancel()
            await asyncio.gather(flusher, return_exceptions=True)
        if flush and self._pending is not None:
            await self._send(self._pending)

    async def _flush_loop(self) -> None:
        try:
            while self._pending is not None and not self._closed:
                wait = self._last_publish + self._interval - self._clock()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                await self._send(self._pending)
        finally:
            self._flusher = None

    async def _send(self, value: float) -> None:
        self._pending = None
        self._last_publish = self._clock()
        self._sending = True
        try:
            await self._publish(value)
        except Exception as exc:  # progress is best effort; the terminal event is not
            log.warning("progress publish failed", extra={"error": repr(exc)})
        finally:
            self._sending = False


class ProgressBoard:
    """Reporters of the tasks in flight, by task id, and each attempt's token.

    Every attempt's progress URL carries its token, a string that lives as long as the
    attempt: a report of an attempt that is over (its dispatcher killed while the function ran
    on) is refused. In knative mode the function runs in another pod and reaches the endpoint
    on the pod's IP (SPEC §11.5): the token is then unguessable, and the only way in.
    """

    def __init__(self) -> None:
        self._reporters: dict[str, ProgressReporter] = {}
        self._tokens: dict[str, str] = {}  # task id -> its current attempt's token

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._reporters

    def open(self, task_id: str, reporter: ProgressReporter, token: str) -> None:
        # A redelivery of a task still running here (after a reconnection)
        # takes over: reports go to the newest attempt, under its token alone.
        self._reporters[task_id] = reporter
        self._tokens[task_id] = token

    def remove(self, task_id: str, reporter: ProgressReporter) -> None:
        if self._reporters.get(task_id) is reporter:
            del self._reporters[task_id]
            self._tokens.pop(task_id, None)

    def allows(self, task_id: str, token: str) -> bool:
        """Whether `token` is the running attempt's of `task_id` (compared in constant time)."""
        expected = self._tokens.get(task_id)
        return expected is not None and hmac.compare_digest(expected.encode(), token.encode())

    def report(self, task_id: str, value: float) -> bool:
        reporter = self._reporters.get(task_id)
        return reporter is not None and reporter.offer(value)
