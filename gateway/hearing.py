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

from collections.abc import Callable
from datetime import UTC, datetime


class Hearing:
    def __init__(self, connected: Callable[[], bool]) -> None:
        self._connected = connected
        now = datetime.now(UTC)  # a new process hears from now
        self._connected_since: datetime | None = now
        self._writing_since: datetime | None = now

    def since(self) -> datetime | None:
        """When hearing began, or None while results cannot be heard."""
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
