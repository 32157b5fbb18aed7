"""Services and grants cached per (client, service), dropped when PostgreSQL says so.

Every submission needs its service and the caller's grant before anything
else (SPEC §3's order of checks). They change rarely, but a revoked grant or a
lowered capacity must take effect at once, on every gateway replica. So the
cache is only trusted while it is invalidated by the database itself:
migration 0002's triggers `NOTIFY conveyor_catalog` on any change to
`services` or `authorizations`, and a dedicated connection here `LISTEN`s.

* A notification empties the cache.
* While the listening connection is down (database restart, network), the
  cache is bypassed and emptied: every request reads the database, as if
  there were no cache, until the connection is back.
* A read that raced with a notification is not stored: each read notes the
  cache's generation before it starts, and stores its row only if no
  notification arrived meanwhile.
* A database without those triggers (migration 0002 not applied yet) is never
  trusted: the cache stays off, and the gateway checks again from time to time.
* Unknown services are never cached (a client could otherwise fill memory with
  made-up names), and the cache is bounded.
"""

from __future__ import annotations

import logging

import psycopg
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from gateway import catalog
from gateway.database_url import libpq
from gateway.pgpool import Pool

log = logging.getLogger("conveyor.gateway.access_cache")

CHANNEL = "conveyor_catalog"
LISTENER_NAME = "conveyor-catalog-listener"
MAX_ENTRIES = 10_000
TRIGGERS = ("services_catalog_changed", "authorizations_catalog_changed")
_TRIGGERS_PRESENT = "SELECT count(DISTINCT tgname) FROM pg_trigger WHERE tgname = ANY(%s)"


class NotNotified(Exception):
    """The database does not send catalog notifications: caching would serve stale grants."""


class AccessCache:
    def __init__(self, pool: Pool, database_url: str, connect_timeout: int = 5) -> None:
        self.pool = pool
        self.url = libpq(database_url)
        self.connect_timeout = connect_timeout
        self._entries: dict[tuple[str, str], catalog.Access] = {}
        self._generation = 0
        self._listening = False

    @property
    def active(self) -> bool:
        return self._listening

    async def access(self, client_id: str, service: str) -> catalog.Access | None:
        key = (client_id, service)
        if self._listening:
            cached = self._entries.get(key)
            if cached is not None:
                return cached
        generation = self._generation
        async with self.pool.connection() as conn:
            found = await catalog.access(conn, client_id, service)
        if found is not None and self._listening and generation == self._generation:
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
            self._entries[key] = found
        return found

    def invalidate(self) -> None:
        self._generation += 1
        self._entries.clear()

    async def listen_loop(self, unmigrated_pause: float = 30.0) -> None:
        """Keeps a LISTEN connection open; the cache is trusted only while it is."""
        backoff = wait_exponential(multiplier=0.5, max=5.0)

        def pause(state: RetryCallState) -> float:
            unmigrated = state.outcome is not None and isinstance(
                state.outcome.exception(), NotNotified
            )
            return unmigrated_pause if unmigrated else backoff(state)

        retrying = AsyncRetrying(
            retry=retry_if_exception_type((psycopg.Error, OSError, NotNotified)),
            wait=pause,
            before_sleep=_report_lost,
        )
        async for attempt in retrying:
            with attempt:
                try:
                    await self._listen()
                finally:
                    self._listening = False
                    self.invalidate()

    async def _listen(self) -> None:
        conn = await psycopg.AsyncConnection.connect(
            self.url,
            autocommit=True,
            connect_timeout=self.connect_timeout,
            application_name=LISTENER_NAME,  # visible in pg_stat_activity
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=3,
        )
        async with conn:
            await conn.execute(f"LISTEN {CHANNEL}")
            found = await (await conn.execute(_TRIGGERS_PRESENT, [list(TRIGGERS)])).fetchone()
            if found is None or found[0] < len(TRIGGERS):
                raise NotNotified
            self.invalidate()  # whatever changed before LISTEN took effect
            self._listening = True
            log.info("caching services and grants")
            # A server that goes away ends this with an OperationalError; one that vanishes
            # silently is caught by the TCP keepalives within about 10 s.
            async for _ in conn.notifies():
                self.invalidate()
        raise ConnectionError("the notification stream ended")


def _report_lost(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    if isinstance(error, NotNotified):
        log.warning("no catalog triggers (migration 0002 missing); cache off")
    else:
        log.warning("catalog notifications lost; cache off", extra={"error": repr(error)})
