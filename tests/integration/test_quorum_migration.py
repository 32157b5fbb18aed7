"""`conveyor admin migrate-queues`: an older installation's classic -out and -dlq become
quorum queues (SPEC §11.7) without losing a message, while a dispatcher keeps publishing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pika
import pika.exceptions
import pytest

from conveyor import topology
from tests.support.amqp import (
    declare_like_seed_worker,
    delete_queues,
    message_count,
    publish,
    queues_of,
    raw_json,
    take_all,
)
from tests.support.gateway import Platform
from tests.support.processes import REPO


def _migrate(database_url: str, amqp_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "admin", "migrate-queues"],
        cwd=REPO,
        env={**os.environ, "CONVEYOR_DATABASE_URL": database_url, "CONVEYOR_AMQP_URL": amqp_url},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _is_quorum(amqp_url: str, queue: str) -> bool:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        connection.channel().queue_declare(queue, durable=True, arguments=topology.QUORUM)
        return True
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 406, exc
        return False
    finally:
        if connection.is_open:
            connection.close()


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

        assert _is_quorum(amqp_url, out) and _is_quorum(amqp_url, dlq)
        bodies = [m.body for m in take_all(amqp_url, out)]
        assert sorted(bodies) == sorted(
            [f'{{"early": {n}}}'.encode() for n in range(300)]
            + [f'{{"late": {n}}}'.encode() for n in range(500)]
        )
        assert message_count(amqp_url, dlq) == 5
        assert message_count(amqp_url, f"{out}.migrating") is None  # the staging queue is gone

        again = _migrate(scratch_db, amqp_url)
        assert again.returncode == 0 and "already quorum" in again.stdout, again.stderr
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
        assert not _is_quorum(amqp_url, out)  # untouched
    finally:
        connection.close()
        delete_queues(amqp_url, queues_of(service.queue_name))


@pytest.fixture
def scratch_db(database_url: str) -> object:
    """A database no running gateway reads: nobody else consumes these services' queues."""
    from tests.support.amqp import scratch_database

    with scratch_database(database_url) as url:
        yield url
