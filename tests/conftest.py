"""Shared fixtures: a fresh database per test run, unique queue names per test,
and real processes that are always stopped.

PostgreSQL and RabbitMQ are real (`make test` ensures they run). Set
CONVEYOR_DATABASE_URL / CONVEYOR_AMQP_URL to point the suite elsewhere; the
database named in the URL is only used to create and drop the run's own one.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from conveyor.settings import DEFAULT_AMQP_URL, normalize_database_url
from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import PORT_CLAIMS, Processes, claim_ports_for_this_run
from tests.support.servers import RabbitNode, rabbitmq_available
from tests.support.tcpproxy import TcpProxy

ADMIN_DB_URL = normalize_database_url(
    os.environ.get("CONVEYOR_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
)
AMQP_URL = os.environ.get("CONVEYOR_AMQP_URL", DEFAULT_AMQP_URL)


def pytest_sessionstart(session: pytest.Session) -> None:
    """With pytest-xdist (`make test`), a worker's `pytest.exit` becomes an internal error that
    loses its reason: the controller checks a broker that takes connections once, before any
    worker starts. One that refuses them is left to the tests that need it, as without xdist."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    broker = urlsplit(AMQP_URL.split(";")[0])
    try:
        socket.create_connection((broker.hostname or "127.0.0.1", broker.port or 5672), 2).close()
    except OSError:
        return
    _require_a_broker_that_answers(AMQP_URL)


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config) -> Iterator[object]:
    """The whole run, with a directory its processes claim their ports in (`free_port`): made
    before any xdist worker starts, so that each inherits it, and removed after the last one
    ended. A worker (it has its controller's) makes none."""
    if PORT_CLAIMS in os.environ:
        return (yield)
    with claim_ports_for_this_run():
        return (yield)


@pytest.fixture(scope="session")
def amqp_url() -> str:
    _require_a_broker_that_answers(AMQP_URL)
    return AMQP_URL


def _require_a_broker_that_answers(url: str) -> None:
    """Ends the run at once when the broker accepts TCP but never completes a handshake.

    A RabbitMQ 3.10 node whose file handle budget is spent by leftover queues does exactly
    that: every connection then waits forever, so each test would only end at its timeout
    and a run would take hours instead of failing with the reason.
    """
    import asyncio

    import aio_pika

    async def handshake() -> None:
        connection = await aio_pika.connect(url, timeout=10)
        await connection.close()

    try:
        asyncio.run(asyncio.wait_for(handshake(), 15))
    except Exception as exc:
        pytest.exit(
            f"RabbitMQ ({url.rpartition('@')[2]}) does not complete a connection handshake: "
            f"{exc!r}. A node full of leftover queues (docs/operations.md) or a stopped one;"
            " set CONVEYOR_AMQP_URL to another broker.",
            returncode=3,
        )


@pytest.fixture(scope="session")
def database_url(amqp_url: str) -> Iterator[str]:
    """A database created for this run, migrated to head, dropped at the end.

    On the server(s) CONVEYOR_DATABASE_URL names, its host list and options kept. Made after
    the broker answered (`amqp_url`): a run that cannot reach it leaves no database behind.
    """
    from gateway.database_url import with_database
    from gateway.migrate import drop_database, ensure_database, upgrade

    url = with_database(ADMIN_DB_URL, f"conveyor_test_{uuid.uuid4().hex[:10]}")
    ensure_database(url)
    upgrade(url)
    os.environ["CONVEYOR_TEST_DATABASE_URL"] = url
    yield url
    _delete_service_queues(url)
    drop_database(url)


def _delete_service_queues(url: str) -> None:
    """Removes the run's queues: hundreds of leftover quorum queues slow every broker restart."""
    import psycopg

    from gateway.database_url import libpq
    from tests.support.amqp import delete_topologies

    names = set(Platform.queue_names)  # removed services too: see Platform.queue_names
    try:
        with psycopg.connect(libpq(url)) as conn:
            names.update(row[0] for row in conn.execute("SELECT queue_name FROM services"))
    except psycopg.Error:
        pass
    try:
        delete_topologies(AMQP_URL, sorted(names), timeout=120)
    except Exception as exc:  # cleanup only: never fail the run for it
        print(f"could not delete the run's queues: {exc!r}")


@pytest.fixture(scope="session")
def platform(database_url: str) -> Platform:
    """Creates uniquely named services and clients in the run's database."""
    return Platform(database_url)


@pytest.fixture(scope="session")
def gateway(
    database_url: str, amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """One gateway for the tests that don't need special settings or to kill it."""
    procs = Processes(tmp_path_factory.mktemp("shared-gateway"))
    try:
        yield GatewayProcess(procs, gateway_env(database_url, amqp_url))
    finally:
        procs.stop_all()


@pytest.fixture(scope="session")
def private_rabbit() -> Iterator[RabbitNode]:
    """A RabbitMQ node of the run's own, for tests that restart or kill a broker."""
    if not rabbitmq_available():
        pytest.skip("rabbitmq-server is not installed here: no private node to break")
    node = RabbitNode().start()
    yield node
    node.stop()


@pytest.fixture(autouse=True)
def _remove_the_tests_services() -> Iterator[None]:
    """The services a test made go when it ends (module- and session-wide ones are made before
    it starts, and stay): their rows now, their queues and control exchange a few seconds
    later (`remove_service`)."""
    from tests.support.amqp import remove_due_topologies, remove_service

    before = len(Platform.created)
    yield
    made, Platform.created[before:] = Platform.created[before:], []
    for platform, service in made:
        try:
            remove_service(platform, AMQP_URL, service)
        except Exception as exc:  # cleanup only: the run's end sweeps what is left
            print(f"could not remove service {service.name}: {exc!r}")
    remove_due_topologies()  # those removed by earlier tests, now that their grace is over


@pytest.fixture
def amqp_proxy(amqp_url: str) -> Iterator[TcpProxy]:
    """RabbitMQ behind a TCP proxy of the test's own, which it may sever, pause or orphan."""
    upstream = urlsplit(amqp_url)
    proxy = TcpProxy(upstream.hostname or "127.0.0.1", upstream.port or 5672)
    yield proxy
    proxy.close()


@pytest.fixture
def queue_name() -> str:
    """Unique per test: tests never see each other's queues."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def procs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Processes]:
    manager = Processes(tmp_path)
    yield manager
    failed = getattr(request.node, "rep_call", None)
    manager.stop_all()
    if failed is not None and failed.failed:
        print(manager.dump())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # type: ignore[no-untyped-def]
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
