"""A real gateway process for integration tests, and ways to set up its data.

Services and clients are created through `gateway.admin` on the test database
(the same code `conveyor admin` runs). Secrets are hashed with a low bcrypt
cost to keep the suite fast; the verification path is the production one.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from gateway import admin
from gateway.auth import hash_secret
from gateway.pgpool import connect
from gateway.platform_file import PlatformSpec
from tests.support.processes import REPO, Proc, Processes, free_port, wait_http

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine to completion from sync or async test code alike."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


# One signing secret for every gateway of a run: any gateway sharing the run's database may
# claim and send a callback, so a test cannot choose which one signs it. Unique per run, so
# that a test can still look for it in logs.
SIGNING_SECRET = f"test-signing-{uuid.uuid4().hex}"


def upgrade_database(url: str) -> None:
    """`conveyor db upgrade`, as an operator runs it, on a database of the test's own."""
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "db", "upgrade"],
        cwd=REPO,
        env={**os.environ, "CONVEYOR_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def fast_hash(secret: str) -> str:
    return hash_secret(secret, rounds=4)


def gateway_env(database_url: str, amqp_url: str, **extra: str) -> dict[str, str]:
    return {
        "CONVEYOR_DATABASE_URL": database_url,
        "CONVEYOR_AMQP_URL": amqp_url,
        "CONVEYOR_CALLBACK_ALLOW_HTTP": "1",
        "CONVEYOR_CALLBACK_ALLOWED_HOSTS": "localhost",
        "CONVEYOR_CALLBACK_SIGNING_SECRET": SIGNING_SECRET,
        "CONVEYOR_CALLBACK_BACKOFF": "0.1",
        "CONVEYOR_SERVICE_REFRESH_INTERVAL": "0.3",
        "CONVEYOR_RELAY_INTERVAL": "0.3",
        "CONVEYOR_PUBLISH_TIMEOUT": "1.5",  # the relay takes rows 3 s old (outbox_grace) ...
        "CONVEYOR_OUTBOX_KEEP_CONFIRMED": "0",  # ... on the shared broker, nobody kills
        "CONVEYOR_REAPER_INTERVAL": "0.5",
        # Off: the suite's gateways share one database, and one that declared again the queues
        # another test deleted on purpose would spoil that test (the test of the check runs
        # a gateway of its own with it on).
        "CONVEYOR_QUEUE_CHECK_INTERVAL": "3600",
        "CONVEYOR_AUTH_CACHE_TTL": "2",
        # Every test connects from 127.0.0.1: a low limit would let one test lock out the others.
        "CONVEYOR_AUTH_FAILURES_PER_MINUTE": "1000",
        "CONVEYOR_LOG_FORMAT": "json",
        **extra,
    }


@dataclass
class Client:
    client_id: str
    secret: str

    @property
    def auth(self) -> tuple[str, str]:
        return (self.client_id, self.secret)


@dataclass
class Service:
    name: str
    queue_name: str
    clients: list[Client] = field(default_factory=list)


class Platform:
    """Creates uniquely named services and clients in the test database."""

    # Every service any Platform made, in order: a test's own are removed when it ends
    # (tests/conftest.py), so that the broker never holds hundreds of leftover queues.
    created: list[tuple[Platform, Service]] = []
    # The queue names of the whole run, kept: a gateway still running when a test removed its
    # service may declare the queues again (a robust channel restores what it declared), so
    # the run's end deletes them all once every gateway has stopped.
    queue_names: set[str] = set()

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url

    def apply(self, spec: dict[str, Any]) -> list[admin.Change]:
        async def go() -> list[admin.Change]:
            async with await connect(self.database_url) as conn:
                return await admin.apply(conn, PlatformSpec.model_validate(spec))

        return run_sync(go())

    def service(
        self,
        clients: int = 1,
        client_capacity: int | None = None,
        **service: Any,
    ) -> Service:
        name = service.pop("name", None) or f"svc-{uuid.uuid4().hex[:10]}"
        service.setdefault("queueName", name)
        made = [Client(f"client-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex) for _ in range(clients)]
        self.apply(
            {
                "services": [{"name": name, **service}],
                "clients": [
                    {
                        "id": c.client_id,
                        "secretHash": fast_hash(c.secret),
                        "grants": [{"service": name, "capacity": client_capacity}],
                    }
                    for c in made
                ],
            }
        )
        made_service = Service(name, service["queueName"], made)
        Platform.created.append((self, made_service))
        Platform.queue_names.add(made_service.queue_name)
        return made_service

    def operator(self) -> Client:
        """An operator (SPEC §11.6): reads every service through the admin API."""
        made = Client(f"op-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex)
        self.apply({"operators": [{"id": made.client_id, "secretHash": fast_hash(made.secret)}]})
        return made

    def sql(self, statement: str, params: Mapping[str, Any] | None = None) -> list[Any]:
        import psycopg

        from gateway.database_url import libpq

        with psycopg.connect(libpq(self.database_url), autocommit=True) as conn:
            cur = conn.execute(statement, params or {})
            return cur.fetchall() if cur.description else []


class GatewayProcess:
    def __init__(self, procs: Processes, env: dict[str, str], name: str = "gateway", *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env
        self.proc: Proc = procs.conveyor(name, "gateway", "--port", str(self.port), *args, env=env)
        wait_http(f"{self.url}/healthz", timeout=30, proc=self.proc)

    def http(self, client: Client | None = None, **kwargs: Any) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, auth=client.auth if client else None, timeout=30, **kwargs
        )

    def tasks_url(self, service: str) -> str:
        return f"/v1/services/{service}/tasks"

    def metric(self, series: str) -> float:
        """One series of its /metrics, as written there (name and labels); 0 if absent."""
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(f"{series} "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0
