"""Helpers shared by the integration tests that look at RabbitMQ and PostgreSQL directly.

* publishing raw messages (CloudEvents or hand-written JSON) with publisher
  confirms, as a worker would;
* looking at a queue without consuming it (`message_count`), taking what it
  holds (`take_all`, `collect`), and deleting a test's queues;
* `wait_until`, the polling loop every eventually-consistent check uses;
* `scratch_database`, a database of its own for a test that must not share
  the session's (migrations, purge, a gateway restarted on its own data).

Everything is synchronous from the caller's side: each call runs its own event
loop in a thread (`run_sync`), so sync and async tests use it alike.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aio_pika
import aiormq.exceptions

from conveyor import topology
from conveyor.amqp import from_amqp, to_amqp
from conveyor.events import WireMessage
from tests.support.gateway import GatewayProcess, Platform, Service, gateway_env, run_sync
from tests.support.processes import Processes

T = TypeVar("T")


# -- polling -------------------------------------------------------------------


def wait_until(
    check: Callable[[], T], timeout: float = 10.0, interval: float = 0.1, what: str = ""
) -> T:
    """Calls `check` until it returns something truthy; returns it, or fails after `timeout`."""
    deadline = time.monotonic() + timeout
    last: T = check()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout}s: {what or check!r} (last: {last!r})")
        time.sleep(interval)
        last = check()
    return last


# -- publishing ----------------------------------------------------------------


def raw_json(payload: Any, message_id: str | None = None) -> WireMessage:
    """A message with a JSON body and no headers at all: what the seed's workers send."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return WireMessage(body, {}, "application/json", message_id)


async def _publish(url: str, queue: str, messages: Sequence[WireMessage]) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = channel.default_exchange
        # Confirmed together rather than one round trip each (the order on the queue may vary).
        await asyncio.gather(
            *(
                exchange.publish(
                    to_amqp(message),
                    routing_key=queue,
                    mandatory=True,  # a missing queue fails the test, not a lost message
                )
                for message in messages
            )
        )


def publish_without_id(url: str, queue: str, body: bytes) -> None:
    """As the seed's JS worker (amqplib) publishes: no message id at all. aio-pika always
    adds one, so this goes through pika, which does not."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        properties = pika.BasicProperties(content_type="application/json", delivery_mode=2)
        channel.basic_publish("", queue, body, properties, mandatory=True)
    finally:
        connection.close()


def publish(url: str, queue: str, messages: Iterable[WireMessage]) -> None:
    """Publishes to `queue` through the default exchange; returns once the broker confirmed."""
    run_sync(_publish(url, queue, list(messages)))


# -- looking at queues ---------------------------------------------------------


def queues_of(queue_name: str) -> list[str]:
    return [
        topology.in_queue(queue_name),
        topology.out_queue(queue_name),
        topology.dead_letter_queue(queue_name),
    ]


async def _declared(url: str, queue: str) -> Any:
    """What a passive declare of `queue` answers, or None if it does not exist."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        try:
            declared = await channel.declare_queue(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return None
        return declared.declaration_result


def message_count(url: str, queue: str) -> int | None:
    """Ready messages in `queue` (a passive declare), or None if it does not exist."""
    declared = run_sync(_declared(url, queue))
    return None if declared is None else int(declared.message_count)


def consumer_count(url: str, queue: str) -> int | None:
    """Consumers of `queue` (a passive declare), or None if it does not exist."""
    declared = run_sync(_declared(url, queue))
    return None if declared is None else int(declared.consumer_count)


def wait_for_queues(url: str, names: Iterable[str], timeout: float = 10.0) -> None:
    """Waits until every queue exists (e.g. declared by the gateway's result consumer)."""
    for name in names:
        wait_until(lambda n=name: message_count(url, n) is not None, timeout, what=f"queue {name}")


_wire = from_amqp


async def _take_all(url: str, queue: str) -> list[WireMessage]:
    connection = await aio_pika.connect(url)
    taken: list[WireMessage] = []
    async with connection:
        channel = await connection.channel()
        declared = await channel.get_queue(queue, ensure=True)
        while (message := await declared.get(no_ack=False, fail=False)) is not None:
            taken.append(_wire(message))
            await message.ack()
    return taken


def take_all(url: str, queue: str) -> list[WireMessage]:
    """Consumes (and acks) every message ready in `queue` now."""
    return run_sync(_take_all(url, queue))


def collect(
    url: str, queue: str, expected: int, timeout: float = 15.0, settle: float = 1.0
) -> list[WireMessage]:
    """Consumes `queue` until `expected` messages arrived, then `settle` seconds more.

    The extra wait lets duplicates show up: a test about "exactly once within a
    window" must see what arrives after the count was first reached.
    """
    taken: list[WireMessage] = []
    deadline = time.monotonic() + timeout
    while len(taken) < expected and time.monotonic() < deadline:
        taken += take_all(url, queue)
        if len(taken) < expected:
            time.sleep(0.2)
    time.sleep(settle)
    return taken + take_all(url, queue)


async def _delete(url: str, names: Iterable[str]) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        for name in names:
            channel = await connection.channel()
            try:
                await channel.queue_delete(name)
            except aiormq.exceptions.AMQPError:
                pass


def delete_queues(url: str, names: Iterable[str]) -> None:
    run_sync(_delete(url, list(names)))


async def _declare_plain(url: str, queue: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True)


def declare_like_seed_worker(url: str, queue: str) -> None:
    """`channel.assertQueue(queue, {durable: true})`, as the seed's JS worker does it.

    Raises `aiormq.exceptions.ChannelPreconditionFailed` if the queue exists
    with other arguments.
    """
    run_sync(_declare_plain(url, queue))


async def _reject_until_dead_lettered(url: str, queue: str, rounds: int) -> int:
    connection = await aio_pika.connect(url)
    deliveries = 0
    async with connection:
        channel = await connection.channel()
        declared = await channel.get_queue(queue, ensure=True)
        for _ in range(rounds):
            message = await declared.get(no_ack=False, fail=False)
            if message is None:
                break
            deliveries += 1
            await message.nack(requeue=True)
    return deliveries


def reject_until_dead_lettered(url: str, queue: str, rounds: int = 50) -> int:
    """Takes the queue's message and gives it back (`basic.nack(requeue=true)`), as a crashing
    worker does, until the broker dead-letters it; returns how many deliveries that took."""
    return run_sync(_reject_until_dead_lettered(url, queue, rounds))


def unacked(queue: str) -> int | None:
    """Messages delivered but not acknowledged, from `rabbitmqctl` (None if it is not here).

    A passive declare only counts ready messages; a consumer that never acks
    would go unnoticed by it.
    """
    if shutil.which("rabbitmqctl") is None:
        return None
    listing = subprocess.run(
        [
            "rabbitmqctl",
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "messages_unacknowledged",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    for line in listing.stdout.splitlines():
        name, _, count = line.rpartition("\t")
        if name == queue:
            return int(count)
    return None


# A service's queues outlive its row by this long. A gateway that read the catalog just before
# the row went may still be declaring them: RabbitMQ 3.10 answers a quorum queue deleted during
# its declaration by crashing the declaring channel, which closes the gateway's whole connection
# with INTERNAL_ERROR (541) until it reconnects, 5 s later.
REMOVAL_GRACE = 5.0
_removed: list[tuple[float, str, str]] = []  # (when its row went, broker URL, queue name)


def remove_service(platform: Platform, url: str, service: Service) -> None:
    """A test's cleanup: the service row now (gateways stop consuming it), its queues and
    control exchange once `REMOVAL_GRACE` has passed, by a later removal or the run's end.
    RabbitMQ 3.10 gives each queue file handles out of a fixed budget (about 900 with the
    usual 1,024 descriptors): once a run's leftover queues spend it, every new connection
    waits forever in the broker's handshake."""
    import psycopg

    Platform.queue_names.add(service.queue_name)  # swept again at the run's end
    try:
        platform.sql("DELETE FROM services WHERE name = %(n)s", {"n": service.name})
    except psycopg.Error:
        pass  # its database is gone already (a scratch database)
    _removed.append((time.monotonic(), url, service.queue_name))
    remove_due_topologies()


def remove_due_topologies() -> None:
    """Deletes the queues of the services removed at least `REMOVAL_GRACE` ago."""
    now = time.monotonic()
    due = [entry for entry in _removed if now - entry[0] >= REMOVAL_GRACE]
    for entry in due:
        _removed.remove(entry)
    for url in {url for _, url, _ in due}:
        names = [queue_name for _, at, queue_name in due if at == url]
        try:
            delete_topologies(url, names)
        except Exception as exc:  # cleanup only: the run's end sweeps what is left
            print(f"could not delete the queues of {names}: {exc!r}")


def delete_topologies(url: str, queue_names: Iterable[str], timeout: float = 30) -> None:
    """Every queue (the cancel log too) and the control exchange of each service's
    `queue_name`, on one connection; a queue the broker refuses to delete is left to the next
    sweep."""

    async def delete() -> None:
        connection = await aio_pika.connect(url, timeout=10)
        async with connection:
            channel = await connection.channel()
            for queue_name in queue_names:
                for name in [*queues_of(queue_name), topology.cancel_log(queue_name)]:
                    try:
                        await channel.queue_delete(name)
                    except aiormq.exceptions.AMQPError:
                        channel = await connection.channel()  # the refusal closed that one
                await channel.exchange_delete(topology.control_exchange(queue_name))

    run_sync(asyncio.wait_for(delete(), timeout))


# -- databases -----------------------------------------------------------------


def create_database(like_url: str, prefix: str = "conveyor_scratch") -> str:
    """Creates an empty database on the server of `like_url`; returns its URL."""
    from gateway.database_url import with_database
    from gateway.migrate import ensure_database

    url = with_database(like_url, f"{prefix}_{uuid.uuid4().hex[:10]}")
    ensure_database(url)
    return url


@contextmanager
def scratch_database(like_url: str, migrate: bool = True) -> Iterator[str]:
    """A database of its own, migrated to head unless told otherwise, dropped afterwards."""
    from gateway.migrate import drop_database, upgrade

    url = create_database(like_url)
    try:
        if migrate:
            upgrade(url)
        yield url
    finally:
        drop_database(url)


def alter_database(admin_url: str, url: str, setting: str) -> None:
    """`ALTER DATABASE <the database at url> <setting>`, run from the database at `admin_url`
    (which stays as it is), and the sessions of the database at `url` ended: a gateway's next
    ones have the setting, as after an operator's change and a restart or a failover."""
    import psycopg

    from gateway.database_url import libpq

    database = urlsplit(url).path.lstrip("/")
    with psycopg.connect(libpq(admin_url), autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{database}" {setting}')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
            [database],
        )


@contextmanager
def own_gateway(
    database_url: str,
    amqp_url: str,
    procs: Processes,
    name: str = "gateway",
    database_via: Callable[[str], str] = str,
    broker_via: Callable[[str], str] = str,
    **env: str,
) -> Iterator[tuple[GatewayProcess, Service, Platform]]:
    """A gateway of its own, ready, on a database of its own with one service: no other
    gateway relays, reaps or notifies for its tasks. It reaches each server at the URL
    `*_via` makes of it (a `TcpProxy`'s, to cut or freeze it); the test reaches them directly."""
    with scratch_database(database_url) as url:
        platform = Platform(url)
        svc = platform.service()
        try:
            gw_env = gateway_env(database_via(url), broker_via(amqp_url), **env)
            gw = GatewayProcess(procs, gw_env, name)
            wait_for_queues(amqp_url, queues_of(svc.queue_name))
            with gw.http() as http:
                wait_until(lambda: http.get("/readyz").status_code == 200, what="gateway ready")
            yield gw, svc, platform
        finally:
            procs.stop_all()
            remove_service(platform, amqp_url, svc)
