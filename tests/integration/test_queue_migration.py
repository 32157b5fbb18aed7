"""`conveyor admin migrate-queues`: an older installation's classic -out and -dlq become
quorum queues (SPEC §11.7) without losing a message, while a dispatcher keeps publishing; an
-in declared before it dead-lettered at least once gets this version's arguments, its
submissions kept."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

import aio_pika
import pika
import pika.exceptions
import pytest

from conveyor import topology
from conveyor.events import MessageFormat, WireMessage
from conveyor.settings import GatewaySettings
from gateway.queue_migration import InUse, migrate_queue
from tests.support.amqp import (
    declare_like_seed_worker,
    delete_queues,
    message_count,
    publish,
    queues_of,
    raw_json,
    take_all,
)
from tests.support.gateway import GatewayProcess, Platform, gateway_env, run_sync
from tests.support.processes import REPO, Processes


def _migrate(database_url: str, amqp_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "admin", "migrate-queues"],
        cwd=REPO,
        env={**os.environ, "CONVEYOR_DATABASE_URL": database_url, "CONVEYOR_AMQP_URL": amqp_url},
        capture_output=True,
        text=True,
        timeout=120,
    )


class _Dispatcher(threading.Thread):
    """Publishes like a dispatcher: confirmed, mandatory, retried when returned."""

    def __init__(self, amqp_url: str, queue: str, count: int) -> None:
        super().__init__(daemon=True)
        self.amqp_url, self.queue, self.count = amqp_url, queue, count
        self.returned = 0
        self.done = threading.Event()

    def run(self) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
        channel = connection.channel()
        channel.confirm_delivery()
        for n in range(self.count):
            while True:
                try:
                    channel.basic_publish(
                        "", self.queue, f'{{"late": {n}}}'.encode(), mandatory=True
                    )
                    break
                except pika.exceptions.UnroutableError:
                    self.returned += 1  # the instant the queue is absent: publish again
        connection.close()
        self.done.set()


def test_classic_results_queues_become_quorum_and_keep_every_message(
    scratch_db: str, amqp_url: str
) -> None:
    service = Platform(scratch_db).service()
    out, dlq = (
        topology.out_queue(service.queue_name),
        topology.dead_letter_queue(service.queue_name),
    )
    try:
        declare_like_seed_worker(amqp_url, out)  # what version 0.1 declared
        declare_like_seed_worker(amqp_url, dlq)
        publish(amqp_url, out, [raw_json({"early": n}) for n in range(300)])
        publish(amqp_url, dlq, [raw_json({"dead": n}) for n in range(5)])

        dispatcher = _Dispatcher(amqp_url, out, 500)
        dispatcher.start()
        done = _migrate(scratch_db, amqp_url)
        assert done.returncode == 0, done.stdout + done.stderr
        assert dispatcher.done.wait(60)

        assert _declares(amqp_url, out, topology.QUORUM) and _declares(
            amqp_url, dlq, topology.QUORUM
        )
        bodies = [m.body for m in take_all(amqp_url, out)]
        assert sorted(bodies) == sorted(
            [f'{{"early": {n}}}'.encode() for n in range(300)]
            + [f'{{"late": {n}}}'.encode() for n in range(500)]
        )
        assert message_count(amqp_url, dlq) == 5
        assert message_count(amqp_url, f"{out}.migrating") is None  # the staging queue is gone

        again = _migrate(scratch_db, amqp_url)
        assert again.returncode == 0 and f"{out}: up to date" in again.stdout, again.stderr
    finally:
        delete_queues(amqp_url, [*queues_of(service.queue_name), f"{out}.migrating"])


def test_a_queue_with_consumers_is_refused(scratch_db: str, amqp_url: str) -> None:
    service = Platform(scratch_db).service()
    out = topology.out_queue(service.queue_name)
    declare_like_seed_worker(amqp_url, out)
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.basic_consume(out, lambda *_: None)  # a gateway still running
        done = _migrate(scratch_db, amqp_url)
        assert done.returncode == 1
        assert "stop the gateways" in done.stderr and "Traceback" not in done.stderr
        assert not _declares(amqp_url, out, topology.QUORUM)  # untouched
    finally:
        connection.close()
        delete_queues(amqp_url, queues_of(service.queue_name))


def _older_in_arguments(queue_name: str) -> dict[str, Any]:
    """What versions before at-least-once dead-lettering declared `-in` with."""
    arguments = _in_spec(queue_name).arguments
    return {k: v for k, v in arguments.items() if k not in ("x-dead-letter-strategy", "x-overflow")}


def _in_spec(queue_name: str) -> topology.QueueSpec:
    limit = GatewaySettings().delivery_limit
    return next(
        spec
        for spec in topology.service_queues(queue_name, MessageFormat.CLOUDEVENTS, limit)
        if spec.name == topology.in_queue(queue_name)
    )


def _declares(amqp_url: str, queue: str, arguments: dict[str, Any]) -> bool:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        connection.channel().queue_declare(queue, durable=True, arguments=arguments)
        return True
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 406, exc
        return False
    finally:
        if connection.is_open:
            connection.close()


def _take_with_properties(amqp_url: str, queue: str) -> list[tuple[Any, ...]]:
    """(message id, body, ce-id header, expiration in ms) of every message, each acked."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    taken = []
    try:
        channel = connection.channel()
        while True:
            method, properties, body = channel.basic_get(queue)
            if method is None:
                return taken
            headers = properties.headers or {}
            taken.append((properties.message_id, body, headers.get("ce-id"), properties.expiration))
            channel.basic_ack(method.delivery_tag)
    finally:
        connection.close()


def _older_service(scratch_db: str, amqp_url: str, submissions: int) -> str:
    """A service whose -in an older version declared, holding `submissions` messages."""
    service = Platform(scratch_db).service()
    queue_name = service.queue_name
    for name in (topology.out_queue(queue_name), topology.dead_letter_queue(queue_name)):
        assert _declares(amqp_url, name, topology.QUORUM)
    assert _declares(amqp_url, topology.in_queue(queue_name), _older_in_arguments(queue_name))
    publish(
        amqp_url,
        topology.in_queue(queue_name),
        [
            WireMessage(
                f'{{"n": {n}}}'.encode(),
                {"ce-id": f"id-{n}"},
                "application/json",
                f"id-{n}",
                expiration=3600.0,
            )
            for n in range(submissions)
        ],
    )
    return queue_name


def test_an_older_in_queue_dead_letters_at_least_once_after_and_keeps_its_submissions(
    scratch_db: str, amqp_url: str
) -> None:
    queue_name = _older_service(scratch_db, amqp_url, 200)
    submissions = topology.in_queue(queue_name)
    try:
        done = _migrate(scratch_db, amqp_url)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"{submissions}: declared anew, 200 message(s) moved" in done.stdout

        assert _declares(amqp_url, submissions, _in_spec(queue_name).arguments)
        assert not _declares(amqp_url, submissions, _older_in_arguments(queue_name))
        kept = _take_with_properties(amqp_url, submissions)
        assert sorted(kept) == sorted(
            (f"id-{n}", f'{{"n": {n}}}'.encode(), f"id-{n}", "3600000") for n in range(200)
        )  # an expiration kept: a submission expires from -in with its task
        assert message_count(amqp_url, f"{submissions}.migrating") is None

        again = _migrate(scratch_db, amqp_url)
        assert again.returncode == 0, again.stderr
        assert f"{submissions}: up to date, 0 message(s) moved" in again.stdout
    finally:
        delete_queues(amqp_url, [*queues_of(queue_name), f"{submissions}.migrating"])


@pytest.mark.parametrize("running", ["dispatcher", "gateway"])
def test_an_older_in_queue_is_left_alone_while_its_consumers_or_publishers_run(
    scratch_db: str, amqp_url: str, running: str
) -> None:
    queue_name = _older_service(scratch_db, amqp_url, 3)
    submissions = topology.in_queue(queue_name)
    consumed = submissions if running == "dispatcher" else topology.out_queue(queue_name)
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=1)
        channel.basic_consume(consumed, lambda *_: None)  # holds one, never acks
        done = _migrate(scratch_db, amqp_url)
        assert done.returncode == 1, done.stdout
        assert f"stop the {running}s first" in done.stderr and "Traceback" not in done.stderr
        connection.close()
        assert _declares(amqp_url, submissions, _older_in_arguments(queue_name))  # untouched
        assert message_count(amqp_url, submissions) == 3
        assert message_count(amqp_url, f"{submissions}.migrating") is None
    finally:
        if connection.is_open:
            connection.close()
        delete_queues(amqp_url, [*queues_of(queue_name), f"{submissions}.migrating"])


@pytest.fixture
def scratch_db(database_url: str) -> object:
    """A database no running gateway reads: nobody else consumes these services' queues."""
    from tests.support.amqp import scratch_database

    with scratch_database(database_url) as url:
        yield url


def test_an_interrupted_move_is_finished_and_said_so(scratch_db: str, amqp_url: str) -> None:
    """Found by a black-box test: a run killed while moving the messages back left them in
    `<name>.migrating`; the next run moved them all but said `up to date, 0 message(s)`."""
    queue_name = _older_service(scratch_db, amqp_url, 0)
    submissions = topology.in_queue(queue_name)
    staging = f"{submissions}.migrating"
    try:
        delete_queues(amqp_url, [submissions])
        assert _declares(amqp_url, submissions, _in_spec(queue_name).arguments)
        assert _declares(amqp_url, staging, topology.QUORUM)
        publish(amqp_url, staging, [raw_json({"n": n}) for n in range(40)])
        done = _migrate(scratch_db, amqp_url)
        assert done.returncode == 0, done.stderr
        assert f"{submissions}: move finished, 40 message(s) moved" in done.stdout
        assert message_count(amqp_url, submissions) == 40
        assert message_count(amqp_url, staging) is None
    finally:
        delete_queues(amqp_url, [*queues_of(queue_name), staging])


def test_a_gateway_started_during_the_move_stops_it_before_the_delete(
    scratch_db: str, amqp_url: str
) -> None:
    """Found by a black-box test: `-in` is a quorum queue, which RabbitMQ deletes only
    unconditionally, and the check that no gateway (its publisher) runs came once, before
    the move: a gateway started meanwhile could publish into the queue about to go. The check
    is made again just before the delete; the refusal says where the moved messages wait, and
    the next run brings them back."""
    queue_name = _older_service(scratch_db, amqp_url, 25)
    submissions = topology.in_queue(queue_name)
    staging = f"{submissions}.migrating"
    arguments = _in_spec(queue_name).arguments

    async def started_meanwhile() -> None:
        raise InUse(f"{topology.out_queue(queue_name)} has 1 consumer(s): stop the gateways first")

    async def run(before_delete: Any) -> None:
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            await migrate_queue(connection, submissions, arguments, "stop", before_delete)

    try:
        with pytest.raises(InUse) as refused:
            run_sync(run(started_meanwhile))
        assert staging in str(refused.value) and "run the command again" in str(refused.value)
        assert _declares(amqp_url, submissions, _older_in_arguments(queue_name))  # not deleted
        assert message_count(amqp_url, staging) == 25
        done = _migrate(scratch_db, amqp_url)
        assert done.returncode == 0, done.stderr
        assert message_count(amqp_url, submissions) == 25
        assert message_count(amqp_url, staging) is None
    finally:
        delete_queues(amqp_url, [*queues_of(queue_name), staging])


def test_an_api_only_gateway_is_seen_and_nothing_moves(
    scratch_db: str, amqp_url: str, procs: Processes
) -> None:
    """Found by a review: the check that no gateway publishes to `-in` counted the consumers
    of `-out`, which a gateway serving the API only (`--no-background`) has none of, though it
    publishes each submission to `-in` at once. Gateways are counted in the database now
    (each holds one named listening connection), and nothing moves while one runs, `-out`
    and `-dlq` included."""
    queue_name = _older_service(scratch_db, amqp_url, 5)
    submissions = topology.in_queue(queue_name)
    api_only = GatewayProcess(
        procs, gateway_env(scratch_db, amqp_url), "api-only", "--no-background"
    )
    try:
        done = _migrate(scratch_db, amqp_url)
        assert done.returncode == 1, done.stdout
        assert "gateway process(es) still run" in done.stderr, done.stderr
        assert _declares(amqp_url, submissions, _older_in_arguments(queue_name))  # untouched
        assert message_count(amqp_url, submissions) == 5
    finally:
        api_only.proc.stop()
        delete_queues(amqp_url, [*queues_of(queue_name), f"{submissions}.migrating"])


def test_queues_a_service_moved_away_from_are_migrated_too(scratch_db: str, amqp_url: str) -> None:
    """Found by a black-box test: a service moved to another queueName left its older queues
    behind; `migrate-queues` gave only the new ones this version's arguments, so moving the
    service back was refused ("run migrate-queues") however often it was run. The queues a
    service still reads after a move are migrated too, their submissions kept."""
    left = _older_service(scratch_db, amqp_url, 20)
    moved_to = f"{left}-b"
    submissions = topology.in_queue(left)
    platform = Platform(scratch_db)
    try:
        platform.sql(
            "UPDATE services SET queue_name = %(to)s WHERE queue_name = %(q)s",
            {"to": moved_to, "q": left},
        )
        assert platform.sql(
            "SELECT queue_name FROM moved_queues WHERE queue_name = %(q)s", {"q": left}
        )
        done = _migrate(scratch_db, amqp_url)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"{submissions}: declared anew, 20 message(s) moved" in done.stdout, done.stdout
        assert _declares(amqp_url, submissions, _in_spec(left).arguments)
        assert message_count(amqp_url, submissions) == 20
        assert f"{topology.in_queue(moved_to)}: up to date" in done.stdout, done.stdout

        # A service whose old queues are gone: nothing is declared again for them.
        delete_queues(amqp_url, [*queues_of(left)])
        again = _migrate(scratch_db, amqp_url)
        assert again.returncode == 0, again.stderr
        assert submissions not in again.stdout, again.stdout
        assert message_count(amqp_url, submissions) is None
    finally:
        delete_queues(
            amqp_url, [*queues_of(left), *queues_of(moved_to), f"{submissions}.migrating"]
        )
