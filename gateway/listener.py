"""One LISTEN connection per gateway process, shared by whatever waits on PostgreSQL's NOTIFY.

The access cache drops its entries on `conveyor_catalog`, the authenticators their verified
secrets on `conveyor_credentials`; the task event streams re-read a task on `conveyor_task`.
Each must know when notifications may have been missed: a subscriber hears `on_connected` once
its channels are listened to again (and may refuse the database, for instance when a
migration's triggers are missing), and `on_lost` whenever the connection goes.
One connection, not one per subscriber or per open stream: a thousand streams cost one.

A connection that LISTENs is not yet one that hears: behind a pooler in transaction mode
(PgBouncer `pool_mode = transaction`), each statement may run on another server session, and
what NOTIFY sends reaches none of ours; the gateway said ready, streams went quiet, and a
revoked grant was honoured for as long as the cache kept it (found by a sweep). So before its
subscribers trust it, the listener sends itself a probe through another connection (`probe`)
and waits for it here; one that does not arrive makes it `deaf`, a readiness failure.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from conveyor import logs
from gateway import supervisor
from gateway.database_url import libpq
from gateway.pgpool import set_up

log = logging.getLogger("conveyor.gateway.listener")

LISTENER_NAME = "conveyor-listener"

Connected = Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]


PROBE_CHANNEL = "conveyor_listener_probe"
PROBE_WAIT = 5.0  # seconds a probe may take to come back
DEAF = (
    "a NOTIFY sent through the database did not reach the gateway's LISTEN connection within"
    f" {PROBE_WAIT:g} s: a pooler in transaction or statement mode (PgBouncer pool_mode ="
    " transaction) is in front of PostgreSQL? Use session mode, or connect directly"
)


class Deaf(Exception):
    """What NOTIFY sends does not reach the listening connection."""


class NotNotified(Exception):
    """The database does not send the notifications a subscriber relies on (a migration is
    missing): trusting it would serve stale answers."""


_TRIGGERS_PRESENT = "SELECT count(DISTINCT tgname) FROM pg_trigger WHERE tgname = ANY(%s)"


async def require_triggers(
    conn: psycopg.AsyncConnection[Any], triggers: Sequence[str], what: str
) -> None:
    """For a subscriber's `on_connected`: NotNotified unless the triggers that notify it exist."""
    found = await (await conn.execute(_TRIGGERS_PRESENT, [list(triggers)])).fetchone()
    if found is None or found[0] < len(triggers):
        raise NotNotified(what)


@dataclass
class _Subscriber:
    on_notify: Callable[[str], None]
    on_connected: Connected | None = None
    on_lost: Callable[[], None] | None = None


@dataclass
class Listener:
    database_url: str
    connect_timeout: int = 5
    # Sends `NOTIFY PROBE_CHANNEL, payload` on another connection (the pool's).
    probe: Callable[[str], Awaitable[None]] | None = None
    listening: bool = False
    deaf: str | None = None  # why the last probe did not come back, until one does
    _channels: dict[str, list[_Subscriber]] = field(default_factory=dict)

    def subscribe(
        self,
        channel: str,
        on_notify: Callable[[str], None],
        on_connected: Connected | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        """Before `listen_loop` starts: `on_notify(payload)` for each notification."""
        self._channels.setdefault(channel, []).append(_Subscriber(on_notify, on_connected, on_lost))

    def _subscribers(self) -> list[_Subscriber]:
        return [s for subscribers in self._channels.values() for s in subscribers]

    async def listen_loop(self, unmigrated_pause: float = 30.0) -> None:
        """Keeps the connection open, reconnecting with backoff (the supervisor restarts it
        if it ever ends)."""
        backoff = wait_exponential(multiplier=0.5, max=5.0)

        def pause(state: RetryCallState) -> float:
            unmigrated = state.outcome is not None and isinstance(
                state.outcome.exception(), NotNotified
            )
            return unmigrated_pause if unmigrated else backoff(state)

        retrying = AsyncRetrying(
            retry=retry_if_exception_type((psycopg.Error, OSError, NotNotified, Deaf)),
            wait=pause,
            before_sleep=_report_lost,
        )
        async for attempt in retrying:
            with attempt:
                try:
                    await self._listen()
                finally:
                    self.listening = False
                    for subscriber in self._subscribers():
                        if subscriber.on_lost is not None:
                            subscriber.on_lost()

    async def _listen(self) -> None:
        conn = await psycopg.AsyncConnection.connect(
            libpq(self.database_url),
            autocommit=True,
            connect_timeout=self.connect_timeout,
            application_name=LISTENER_NAME,  # visible in pg_stat_activity
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=3,
        )
        async with conn:
            await set_up(conn)  # its subscribers read rows on it when it connects
            for channel in [*self._channels, PROBE_CHANNEL]:
                await conn.execute(f"LISTEN {channel}")
            await self._hear_a_probe(conn)
            for subscriber in self._subscribers():
                if subscriber.on_connected is not None:
                    await subscriber.on_connected(conn)
            self.listening = True
            supervisor.pass_succeeded()
            log.info("listening", extra={"channels": sorted(self._channels)})
            # A server that goes away ends this with an OperationalError; one that vanishes
            # silently is caught by the TCP keepalives within about 10 s.
            async for notification in conn.notifies():
                self._deliver(notification)
        raise ConnectionError("the notification stream ended")

    async def _hear_a_probe(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Deaf unless a probe sent on another connection arrives on `conn` in PROBE_WAIT."""
        if self.probe is None:
            return
        token = uuid.uuid4().hex
        await self.probe(token)
        async for notification in conn.notifies(timeout=PROBE_WAIT):
            if notification.channel == PROBE_CHANNEL and notification.payload == token:
                self.deaf = None
                return
            self._deliver(notification)
        self.deaf = DEAF
        raise Deaf(DEAF)

    def _deliver(self, notification: psycopg.Notify) -> None:
        for subscriber in self._channels.get(notification.channel, ()):
            subscriber.on_notify(notification.payload)


def _report_lost(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    if error is not None:
        supervisor.pass_failed(error)
    if isinstance(error, NotNotified):
        log.warning("the database sends no notifications (a migration is missing)")
    elif isinstance(error, Deaf):
        log.error(DEAF)
    else:
        log.warning("notifications lost; listening again", extra={"error": logs.describe(error)})
