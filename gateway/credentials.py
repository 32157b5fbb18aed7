"""Verified secrets forgotten the moment PostgreSQL says a client or an operator changed.

Each gateway process remembers the secrets it verified (gateway.auth: bcrypt costs ~0.25 s).
A deleted client or operator, or a changed secret, must stop working on every replica with
the next request, not once that memory expires. Migration 0016's triggers
`NOTIFY conveyor_credentials` with the table's name on any change to `clients` or
`operators`, and the process's one listening connection (gateway.listener) hears it:

* a notification makes that table's authenticator forget what it verified;
* until the connection listens (and after it is lost), nothing is served from memory:
  every request reads the stored hash, as if there were no cache;
* a database without the triggers is never trusted (NotNotified, as for the access cache).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import psycopg

from gateway.auth import Authenticator
from gateway.listener import Listener, require_triggers

log = logging.getLogger("conveyor.gateway.credentials")

CHANNEL = "conveyor_credentials"
TRIGGERS = ("clients_credentials_changed", "operators_credentials_changed")


class Credentials:
    def __init__(self, listener: Listener, by_table: Mapping[str, Authenticator]) -> None:
        self._by_table = dict(by_table)
        self._all(heard=False)
        listener.subscribe(
            CHANNEL,
            self._changed,
            on_connected=self._trusted,
            on_lost=lambda: self._all(heard=False),
        )

    def _changed(self, table: str) -> None:
        known = self._by_table.get(table)
        for authenticator in [known] if known else self._by_table.values():
            authenticator.forget()  # a table we do not know: everything, to be safe

    def _all(self, heard: bool) -> None:
        for authenticator in self._by_table.values():
            authenticator.hearing(heard)

    async def _trusted(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Once LISTEN took effect: trusted only if the triggers that notify exist."""
        await require_triggers(conn, TRIGGERS, "no credentials triggers (migration 0016 missing)")
        self._all(heard=True)  # also forgets whatever changed before LISTEN took effect
        log.info("caching verified secrets")
