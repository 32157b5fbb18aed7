"""The gateway's moving parts, built once per process, and its background loops.

The API and the loops (outbox relay, result consumer, notifier, reaper) share
one engine and one broker connection. `conveyor gateway --no-background` and
`--only-background` split them across processes when an operator wants to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from sqlalchemy import text

from conveyor.settings import GatewaySettings
from gateway.access_cache import AccessCache
from gateway.auth import Authenticator
from gateway.broker import Broker
from gateway.callbacks import CallbackPolicy
from gateway.catalog import SchemaCache
from gateway.db import create_engine
from gateway.housekeeping import reaper_loop
from gateway.intake import Intake
from gateway.notifier import Notifier
from gateway.outbox import Outbox
from gateway.pgpool import Pool
from gateway.results import ResultConsumer

log = logging.getLogger("conveyor.gateway")


class Runtime:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.engine = create_engine(settings)
        self.pool = Pool(settings.database_url, settings.db_pool_size)  # the API's hot path
        self.intake = Intake(self.pool)
        self.access = AccessCache(self.pool, settings.database_url)
        self.broker = Broker(settings.amqp_url, publish_timeout=settings.publish_timeout)
        self.schemas = SchemaCache()
        self.policy = CallbackPolicy(
            allow_http=settings.callback_allow_http,
            allow_private=settings.callback_allow_private,
            allowed_hosts=tuple(settings.callback_allowed_hosts),
        )
        self.auth = Authenticator(
            self._secret_hash,
            cache_ttl=settings.auth_cache_ttl,
            failures_per_minute=settings.auth_failures_per_minute,
        )
        self.outbox = Outbox(
            self.pool, self.broker, grace=settings.outbox_grace, interval=settings.relay_interval
        )
        self.notifier = Notifier(
            self.engine,
            self.policy,
            settings.callback_signing_secret,
            attempts=settings.callback_attempts,
            backoff=settings.callback_backoff,
            timeout=settings.callback_timeout,
        )
        self.results = ResultConsumer(
            self.pool,
            self.broker,
            delivery_limit=settings.delivery_limit,
            refresh_interval=settings.service_refresh_interval,
            on_finished=self.notifier.wake,
        )
        self._tasks: list[asyncio.Task[None]] = []

    async def _secret_hash(self, client_id: str) -> str | None:
        async with self.engine.connect() as conn:
            row = await conn.execute(
                text("SELECT secret_hash FROM clients WHERE client_id = :id"), {"id": client_id}
            )
            return row.scalar_one_or_none()

    async def start(self, background: bool = True) -> None:
        self._spawn(self._keep_broker_connected())
        self._spawn(self.outbox.flush_loop())
        self._spawn(self.access.listen_loop())
        if background:
            s = self.settings
            self._spawn(self.outbox.relay_loop())
            self._spawn(self.results.subscriptions_loop())
            self._spawn(self.results.apply_loop())
            self._spawn(self.notifier.loop())
            self._spawn(
                reaper_loop(self.pool, s.pending_ttl, s.reaper_interval, self.notifier.wake)
            )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        task.add_done_callback(_report_crash)
        self._tasks.append(task)

    async def _keep_broker_connected(self) -> None:
        # connect_robust reconnects once connected; this covers a broker down at start.
        delay = 0.5
        while not self.broker.connected:
            try:
                await self.broker.connect()
            except Exception as exc:
                log.warning("broker unreachable, retrying", extra={"error": repr(exc)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def ready(self) -> dict[str, bool]:
        database = True
        try:
            async with self.engine.connect() as conn:
                await asyncio.wait_for(conn.execute(text("SELECT 1")), 2)
        except Exception:
            database = False
        return {"database": database, "broker": self.broker.connected}

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.intake.close()
        await self.outbox.flush()
        await self.notifier.close()
        await self.broker.close()
        await self.pool.close()
        await self.engine.dispose()
        self.auth.close()


def _report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background loop crashed", exc_info=task.exception())
