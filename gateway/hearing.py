"""Since when this gateway can hear the workers' results: what the watchdog's silence counts.

The watchdog fails an IN_PROGRESS task whose worker said nothing for its time limit plus
SILENCE_MARGIN. A worker's word reaches the row through `-out`, the broker connection and the
database; while either is down, frozen or cut off, results wait on `-out` (or in a
dispatcher that cannot publish them) and silence proves nothing. Found by a sweep: after a
database outage the watchdog ran before the results waiting on `-out` were applied, and failed
tasks that had succeeded. So the silence only counts from the moment results could be heard
again: the broker connected (and not lost since), the results consumer's last attempt to
write to the database successful.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

log = logging.getLogger(__name__)

# The event loop's clock ticks this often; a tick this late (seconds) means the process did
# not run (SIGSTOP, a paused VM, a loop blocked): results that waited on `-out` meanwhile are
# only now being read, so silence counts from now. Found by black-box tests and CI: a gateway
# thawed in or between reaper passes failed tasks whose results waited.
TICK = 0.5
STALL = 5.0


class Hearing:
    def __init__(self, connected: Callable[[], bool]) -> None:
        self._connected = connected
        now = datetime.now(UTC)  # a new process hears from now
        self._connected_since: datetime | None = now
        self._writing_since: datetime | None = now
        self._ticked: float | None = None  # the clock's last tick, while it keeps time
        self._clock: asyncio.TimerHandle | None = None

    @contextmanager
    def keeping_time(self) -> Iterator[None]:
        """Ticks on the running loop while the block runs (the reaper's, restarted or not)."""
        loop = asyncio.get_running_loop()

        def tick() -> None:
            self._stalled()
            self._ticked = time.monotonic()
            self._clock = loop.call_later(TICK, tick)

        tick()
        try:
            yield
        finally:
            if self._clock is not None:
                self._clock.cancel()
            self._clock = self._ticked = None

    def _stalled(self) -> None:
        """Asked by the tick and by every look, whichever runs first after a stall."""
        if self._ticked is None:
            return
        now = time.monotonic()
        if (late := now - self._ticked - TICK) > STALL:
            self._ticked = now
            self.restarted()
            log.warning("the process did not run; silence counts from now", extra={"late_s": late})

    def since(self) -> datetime | None:
        """When hearing began, or None while results cannot be heard."""
        self._stalled()
        if not self._connected():
            self._connected_since = None
            return None
        if self._connected_since is None:  # seen connected again
            self._connected_since = datetime.now(UTC)
        if self._writing_since is None:
            return None
        return max(self._connected_since, self._writing_since)

    def lost(self) -> None:
        """The database refused or dropped a write of results (retried until it works)."""
        self._writing_since = None

    def heard(self) -> None:
        """Results were written: hearing begins now, if writing had stopped."""
        if self._writing_since is None:
            self._writing_since = datetime.now(UTC)

    def restarted(self) -> None:
        """The broker connection was made again, or the process was not running (frozen):
        what waited is only now delivered."""
        self._connected_since = datetime.now(UTC)
