"""The gateway's moving parts, built once per process, and its background loops.

The API and the loops (outbox relay, result consumer, notifier, reaper, planner statistics)
share one engine and one broker connection. `conveyor gateway --no-background` and
`--only-background` split them across processes when an operator wants to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial

from tenacity import AsyncRetrying, wait_exponential

from conveyor.settings import GatewaySettings
from gateway import schema
from gateway.access_cache import AccessCache
from gateway.auth import Authenticator
from gateway.body_schema import SchemaCache
from gateway.broker import Broker
from gateway.callbacks import CallbackPolicy, close_resolver
from gateway.cancel import Broadcast, tell_ended
from gateway.credentials import Credentials
from gateway.hearing import Hearing
from gateway.housekeeping import reaper_loop
from gateway.intake import Intake
from gateway.listener import PROBE_CHANNEL, Listener
from gateway.notifier import Notifier
from gateway.outbox import Outbox
from gateway.pgpool import Pool, commits
from gateway.planner_statistics import analyze_loop
from gateway.results import ResultConsumer
from gateway.service_stats import ServiceStats, register_gauges
from gateway.supervisor import Supervisor
from gateway.task_events import TaskEvents

# How often a gateway waiting for `conveyor db upgrade` looks again.
SCHEMA_RECHECK = 1.0
# How long each of /readyz's questions to the database may take (a read, then a commit).
READY_WAIT = 2.0

log = logging.getLogger("conveyor.gateway")


class Runtime:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.pool = Pool(  # the API's hot path
            settings.database_url, settings.db_pool_size, use_timeout=settings.db_timeout
        )
        self.intake = Intake(self.pool, settings.outbox_grace)
        self.listener = Listener(settings.database_url, probe=self._probe)  # one LISTEN
        self.access = AccessCache(self.pool, self.listener)
        self.task_events = TaskEvents(self.listener)
        self.broker = Broker(
            settings.amqp_url,
            publish_timeout=settings.publish_timeout,
            heartbeat=settings.amqp_heartbeat,
        )
        self.schemas = SchemaCache()
        self.policy = CallbackPolicy(
            allow_http=settings.callback_allow_http,
            allow_private=settings.callback_allow_private,
            allowed_hosts=tuple(settings.callback_allowed_hosts),
        )
        self.auth = Authenticator(
            self._client_hash,
            cache_ttl=settings.auth_cache_ttl,
            failures_per_minute=settings.auth_failures_per_minute,
        )
        self.operators = Authenticator(  # its own table: neither opens the other's API
            self._operator_hash,
            cache_ttl=settings.auth_cache_ttl,
            failures_per_minute=settings.auth_failures_per_minute,
            bcrypt_threads=1,
        )
        self.credentials = Credentials(
            self.listener, {"clients": self.auth, "operators": self.operators}
        )
        self.stats = ServiceStats(self.pool, self.broker)
        register_gauges(self.stats)
        self.outbox = Outbox(
            self.pool,
            self.broker,
            ttl=settings.pending_ttl,
            delivery_limit=settings.delivery_limit,
            interval=settings.relay_interval,
            keep_confirmed=settings.outbox_keep_confirmed,
        )
        self.notifier = Notifier(
            self.pool,
            self.policy,
            settings.callback_signing_secret,
            settings.callback_previous_signing_secret,
            attempts=settings.callback_attempts,
            backoff=settings.callback_backoff,
            timeout=settings.callback_timeout,
            concurrency=settings.callback_concurrency,
            per_target=settings.callback_per_target,
            lease=settings.callback_lease,
        )
        self.cancels = Broadcast(self.pool, self.broker)
        self.hearing = Hearing(lambda: self.broker.connected)  # what the watchdog trusts
        self.broker.on_reconnect(self.hearing.restarted)
        self.results = ResultConsumer(
            self.pool,
            self.broker,
            delivery_limit=settings.delivery_limit,
            refresh_interval=settings.service_refresh_interval,
            on_finished=self.notifier.wake,
            hearing=self.hearing,
            on_missing_in=self.outbox.restore_lost,
            memory=settings.results_memory,
        )
        self.loops = Supervisor()
        self.background = False
        self._connecting: asyncio.Task[None] | None = None
        # What the database lacks of our schema (checked at start and by every /readyz).
        self.schema_problem: str | None = "not checked yet: the database did not answer"
        self._schema_wait: asyncio.Task[None] | None = None
        self._loops_spawned = False

    async def _client_hash(self, client_id: str) -> str | None:
        return await self._hash("SELECT secret_hash FROM clients WHERE client_id = %s", client_id)

    async def _operator_hash(self, operator_id: str) -> str | None:
        return await self._hash(
            "SELECT secret_hash FROM operators WHERE operator_id = %s", operator_id
        )

    async def _hash(self, query: str, ident: str) -> str | None:
        async with self.pool.connection() as conn:
            row = await (await conn.execute(query, (ident,))).fetchone()
        return None if row is None else row.secret_hash

    async def start(self, background: bool = True) -> None:
        self._connecting = asyncio.create_task(self._connect_broker())
        self.background = background
        answered = await self._check_schema()
        if self.schema_problem is None:
            self._spawn_loops()
            return
        if answered:
            log.error(self.schema_problem)  # and /readyz says it, until the schema is there
        self._schema_wait = asyncio.create_task(self._spawn_loops_once_the_schema_is_there())

    async def _spawn_loops_once_the_schema_is_there(self) -> None:
        """Started on tables not made yet, every loop would crash and be restarted, a traceback
        each time, for as long as nobody runs the upgrade."""
        while not (await self._check_schema() and self.schema_problem is None):
            await asyncio.sleep(SCHEMA_RECHECK)
        log.info("the database holds this gateway's schema now: starting its loops")
        self._spawn_loops()

    def _spawn_loops(self) -> None:
        self._loops_spawned = True
        loops: dict[str, Callable[[], Awaitable[None]]] = {
            "outbox-flush": self.outbox.flush_loop,
            "listener": self.listener.listen_loop,
            # Every process: a scrape may reach any worker of `--workers`.
            "service-stats": lambda: self.stats.refresh_loop(self.settings.stats_interval),
        }
        for name, loop in loops.items():
            self.loops.spawn(name, loop)
        if self.background:
            self._spawn_background()

    def start_background(self) -> None:
        """The loops one process of a group runs: relay, results, notifier, reaper; at start,
        or once a worker of `--workers` takes them over (gateway/workers.py)."""
        if self.background:
            return
        self.background = True
        if self._loops_spawned:  # else with the others, once the schema is there
            self._spawn_background()

    def _spawn_background(self) -> None:
        s = self.settings
        loops: dict[str, Callable[[], Awaitable[None]]] = {
            "outbox-relay": self.outbox.relay_loop,
            "cancels-retry": self.cancels.retry_loop,
            "queue-check": lambda: self.outbox.queue_check_loop(s.queue_check_interval),
            "results-subscriptions": self.results.subscriptions_loop,
            "results-apply": self.results.apply_loop,
            "notifier": self.notifier.loop,
            "reaper": lambda: reaper_loop(
                self.pool,
                s.pending_ttl,
                s.reaper_interval,
                self.notifier.wake,
                self.hearing,
                s.silence_margin,
                partial(tell_ended, self.pool, self.cancels),
                self.broker.takes_publishes,
            ),
            "planner-statistics": lambda: analyze_loop(self.pool, s.analyze_interval),
        }
        for name, loop in loops.items():
            self.loops.spawn(name, loop)

    async def _connect_broker(self) -> None:
        """The first connection; once made, the robust connection reconnects by itself."""
        retrying = AsyncRetrying(
            wait=wait_exponential(multiplier=0.5, max=5.0),
            before_sleep=lambda state: log.warning(
                "broker unreachable, retrying",
                extra={"error": repr(state.outcome.exception() if state.outcome else None)},
            ),
        )
        async for attempt in retrying:
            with attempt:
                await self.broker.connect()

    async def _check_schema(self) -> bool:
        """Whether the database answered; `schema_problem` says what it lacks, if anything
        (also when a downgrade took it from under a running gateway)."""
        try:
            async with asyncio.timeout(READY_WAIT), self.pool.connection() as conn:
                problem = await schema.problem(conn)
        except Exception:
            return False
        if problem is not None and self.schema_problem is None:
            log.error(problem)
        self.schema_problem = problem
        return True

    async def ready(self) -> dict[str, bool]:
        database = await self._check_schema()
        if database and self.schema_problem is None:
            try:
                async with asyncio.timeout(READY_WAIT), self.pool.connection() as conn:
                    database = await commits(conn) and not self.pool.short_of_room()
            except Exception:
                database = False
        return {
            "database": database,
            "schema": self.schema_problem is None,
            "broker": self.broker.connected,
            "loops": not self.loops.down(),
            "notifications": self.listener.deaf is None,
        }

    async def _probe(self, payload: str) -> None:
        """The listener's probe (gateway.listener), sent as any NOTIFY is: on a pool's
        connection, another server session than the listener's."""
        async with self.pool.connection() as conn:
            await conn.execute("SELECT pg_notify(%s, %s)", [PROBE_CHANNEL, payload])

    def problems(self) -> dict[str, dict[str, str] | str | None]:
        """What /readyz names: the schema the database lacks, why NOTIFY is not heard (a
        pooler in transaction mode, gateway.listener), loops waiting for a restart,
        loops whose last pass failed (not a reason for 503: see gateway.supervisor), services
        whose queues exist with other arguments (their results are still consumed)."""
        return {
            "schema": self.schema_problem,
            "notifications": self.listener.deaf,
            "loops": self.loops.down(),
            "failing": self.loops.failing(),
            "services": self.results.broken(),
        }

    async def stop(self) -> None:
        if self._schema_wait is not None:
            self._schema_wait.cancel()
            await asyncio.gather(self._schema_wait, return_exceptions=True)
        if self._connecting is not None:
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)
        await self.loops.stop()
        await self.intake.close()
        await self.outbox.flush(everything=True)
        await self.notifier.close()
        await close_resolver()
        await self.broker.close()
        await self.pool.close()
        self.auth.close()
        self.operators.close()
