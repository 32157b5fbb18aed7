"""The systems under test, started for one benchmark: a fresh database, a service with a
client and its queues, gateways, dispatchers and the no-op function every peer calls.
Processes come from the test suite's `tests.support.processes` (one implementation)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.record import ADMIN_DB_URL, AMQP_URL, PYTHON
from conveyor import connection as amqp
from gateway.database_url import libpq, with_database
from tests.support.processes import Proc, Processes, free_port, wait_http

DELIVERY_LIMIT = 5  # the gateway's default CONVEYOR_DELIVERY_LIMIT


@contextlib.contextmanager
def processes() -> Iterator[Processes]:
    """Processes stopped at the end; their logs kept (and named) only on failure."""
    log_dir = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    procs = Processes(log_dir)
    failed = True
    try:
        yield procs
        failed = False
    finally:
        procs.stop_all()
        if failed:
            print(f"process logs kept in {log_dir}", file=sys.stderr)
        else:
            import shutil

            shutil.rmtree(log_dir, ignore_errors=True)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def wait_for_broker(timeout: float = 60.0) -> bool:
    """Waits for RabbitMQ to accept connections (it may be restarting); True if it does."""
    from urllib.parse import urlsplit

    from conveyor.connection import NodeList

    nodes = [urlsplit(url) for url in NodeList(AMQP_URL).urls]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for parts in nodes:  # any node of a cluster will do
            try:
                with socket.create_connection(
                    (parts.hostname or "127.0.0.1", parts.port or 5672), 2
                ):
                    return True
            except OSError:
                continue
        time.sleep(1.0)
    return False


@contextlib.contextmanager
def fresh_database(prefix: str = "conveyor_bench") -> Iterator[str]:
    """A database created for this run and migrated to head; dropped at the end, with the
    queues of its services. Open it before `processes()`: a gateway still running when its
    queues go may declare them again (its robust channel restores what it declared)."""
    from gateway.migrate import drop_database, ensure_database, upgrade

    url = with_database(ADMIN_DB_URL, f"{prefix}_{uuid.uuid4().hex[:10]}")
    ensure_database(url)
    try:
        upgrade(url)
        yield url
    finally:
        _delete_services_queues(url)
        drop_database(url)


def _delete_services_queues(database_url: str) -> None:
    """The run's services leave no queues behind: RabbitMQ 3.10 has a file handle budget for
    queues, and leftovers from run after run spend it (docs/operations.md)."""
    try:
        names = [row[0] for row in sql(database_url, "SELECT queue_name FROM services")]
    except Exception:  # the database is gone: nothing to read the names from
        return
    for name in names:
        with contextlib.suppress(Exception):
            asyncio.run(asyncio.wait_for(delete_queues(name), 30))


def sql(database_url: str, statement: str, params: Mapping[str, Any] | None = None) -> list[Any]:
    import psycopg

    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        cur = conn.execute(statement, params or {})
        return cur.fetchall() if cur.description else []


@dataclass(frozen=True)
class BenchService:
    name: str
    client_id: str
    secret: str

    @property
    def auth(self) -> tuple[str, str]:
        return (self.client_id, self.secret)

    @property
    def tasks_path(self) -> str:
        return f"/v1/services/{self.name}/tasks"


def create_service(
    database_url: str,
    name: str | None = None,
    schema: dict[str, Any] | None = None,
    capacity: int | None = None,
    client_capacity: int | None = None,
    bcrypt_rounds: int = 12,
) -> BenchService:
    """A service, a client granted on it (production bcrypt cost), and its queues."""
    from gateway import admin
    from gateway.auth import hash_secret
    from gateway.pgpool import connect
    from gateway.platform_file import PlatformSpec

    service = BenchService(name or unique("bench"), unique("client"), uuid.uuid4().hex)
    spec = PlatformSpec.model_validate(
        {
            "services": [
                {"name": service.name, "jsonSchema": schema, "capacity": capacity, "maxAttempts": 3}
            ],
            "clients": [
                {
                    "id": service.client_id,
                    "secretHash": hash_secret(service.secret, bcrypt_rounds),
                    "grants": [{"service": service.name, "capacity": client_capacity}],
                }
            ],
        }
    )

    async def go() -> None:
        async with await connect(database_url) as conn:
            await admin.apply(conn, spec)
        await declare_queues(service.name)

    asyncio.run(go())
    return service


async def declare_queues(queue_name: str) -> None:
    from conveyor.events import MessageFormat
    from conveyor.topology import declare_service

    connection = await amqp.connect(AMQP_URL, name="conveyor bench")
    try:
        channel = await connection.channel()
        await declare_service(channel, queue_name, MessageFormat.CLOUDEVENTS, DELIVERY_LIMIT)
    finally:
        await connection.close()


async def delete_queues(queue_name: str, url: str = AMQP_URL) -> None:
    """A run's service topology: its three queues, and the control exchange and cancel log
    the gateway declared for cancels (left behind, they piled up on the broker run after run)."""
    from conveyor.topology import (
        cancel_log,
        control_exchange,
        dead_letter_queue,
        in_queue,
        out_queue,
    )

    connection = await amqp.connect(url, name="conveyor bench", timeout=10)
    try:
        names = (in_queue(queue_name), out_queue(queue_name), dead_letter_queue(queue_name))
        for name in (*names, cancel_log(queue_name)):
            channel = await connection.channel()
            with contextlib.suppress(Exception):
                await channel.queue_delete(name)
        channel = await connection.channel()
        with contextlib.suppress(Exception):
            await channel.exchange_delete(control_exchange(queue_name))
    finally:
        await connection.close()


def purge_queue(name: str) -> None:
    async def go() -> None:
        connection = await amqp.connect(AMQP_URL, name="conveyor bench")
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(name, passive=True)
            await queue.purge()
        finally:
            await connection.close()

    with contextlib.suppress(Exception):
        asyncio.run(go())


def gateway_env(database_url: str, **extra: str) -> dict[str, str]:
    return {
        "CONVEYOR_DATABASE_URL": database_url,
        "CONVEYOR_AMQP_URL": AMQP_URL,
        "CONVEYOR_SERVICE_REFRESH_INTERVAL": "0.5",
        "CONVEYOR_CALLBACK_SIGNING_SECRET": "benchmark-signing-secret",
        "CONVEYOR_LOG_FORMAT": "json",
        **extra,
    }


@dataclass
class Gateway:
    proc: Proc
    url: str


def start_gateway(
    procs: Processes, database_url: str, name: str = "gateway", workers: int = 1, **env: str
) -> Gateway:
    port = free_port()
    more = ("--workers", str(workers)) if workers > 1 else ()
    proc = procs.conveyor(
        name, "gateway", "--port", str(port), *more, env=gateway_env(database_url, **env)
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", timeout=60, proc=proc, ok=300)
    return Gateway(proc, url)


def dispatcher_env(queue: str, function_url: str, port: int, **extra: str) -> dict[str, str]:
    return {
        "CONVEYOR_QUEUE": queue,
        "CONVEYOR_AMQP_URL": AMQP_URL,
        "FUNCTION_URL": function_url,
        "DISPATCHER_PORT": str(port),
        "HOSTNAME": f"bench-{port}",
        "CONVEYOR_LOG_FORMAT": "json",
        **extra,
    }


@dataclass
class Dispatcher:
    proc: Proc
    port: int

    @property
    def ready_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/readyz"


def start_dispatcher(
    procs: Processes, name: str, queue: str, function_url: str, wait: bool = True, **env: str
) -> Dispatcher:
    port = free_port()
    proc = procs.conveyor(name, "dispatcher", env=dispatcher_env(queue, function_url, port, **env))
    dispatcher = Dispatcher(proc, port)
    if wait:
        wait_http(dispatcher.ready_url, timeout=60, proc=proc, ok=300)
    return dispatcher


@dataclass
class NoopFunction:
    proc: Proc
    url: str

    def arrivals(self) -> dict[str, float]:
        """Task id -> time.time() at which the function received it."""
        with httpx.Client(timeout=30, trust_env=False) as client:
            return client.get(f"{self.url}arrivals").json()

    def stats(self) -> dict[str, Any]:
        with httpx.Client(timeout=10, trust_env=False) as client:
            return client.get(f"{self.url}stats").json()

    def reset(self) -> None:
        with httpx.Client(timeout=10, trust_env=False) as client:
            client.delete(f"{self.url}arrivals")


def start_noop_function(procs: Processes, name: str = "noop-function") -> NoopFunction:
    port = free_port()
    proc = procs.start(name, [PYTHON, "-m", "bench.noop", "--port", str(port)])
    url = f"http://127.0.0.1:{port}/"
    wait_http(f"{url}healthz", timeout=20, proc=proc)
    return NoopFunction(proc, url)
