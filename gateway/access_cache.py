"""Services and grants cached per (client, service), dropped when PostgreSQL says so.

Every submission needs its service and the caller's grant before anything
else (SPEC §3's order of checks). They change rarely, but a revoked grant or a
lowered capacity must take effect at once, on every gateway replica. So the
cache is only trusted while it is invalidated by the database itself:
migration 0002's triggers `NOTIFY conveyor_catalog` on any change to
`services` or `authorizations`, and the gateway's one listening connection
(`gateway.listener`) hears it.

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
from typing import Any

import psycopg

from gateway import catalog
from gateway.listener import Listener, require_triggers
from gateway.pgpool import Pool

log = logging.getLogger("conveyor.gateway.access_cache")

CHANNEL = "conveyor_catalog"
MAX_ENTRIES = 10_000
TRIGGERS = ("services_catalog_changed", "authorizations_catalog_changed")


class AccessCache:
    def __init__(self, pool: Pool, listener: Listener) -> None:
        self.pool = pool
        self._entries: dict[tuple[str, str], catalog.Access] = {}
        self._generation = 0
        self._listening = False
        listener.subscribe(
            CHANNEL, lambda _: self.invalidate(), on_connected=self._trusted, on_lost=self._off
        )

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

    async def _trusted(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Once LISTEN took effect: trusted only if the triggers that notify exist."""
        await require_triggers(conn, TRIGGERS, "no catalog triggers (migration 0002 missing)")
        self.invalidate()  # whatever changed before LISTEN took effect
        self._listening = True
        log.info("caching services and grants")

    def _off(self) -> None:
        self._listening = False
        self.invalidate()
