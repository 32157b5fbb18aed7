"""A service's `-out` deleted while the gateway has a backlog of its results (found by a
sweep on a private node: a gateway frozen 8 s, `-out` deleted, thawed).

Thawed, the gateway paced the queue up (its consumer cancelled and made again with a larger
prefetch), and the new consume met the deleted queue: the channel closed, aio-pika reopened
it and declared `-out` again, but restores only consumers it still tracks, and the cancelled
one was not. The gateway never consumed that `-out` again, `/readyz` 200: every later result
of the service waited there, its tasks PENDING, until a restart.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from conveyor import topology
from conveyor.events import EventKind, TaskEvent, encode_event
from tests.support.amqp import (
    delete_queues,
    message_count,
    own_gateway,
    publish,
    wait_until,
)
from tests.support.processes import Processes


def _succeeded(task_id: str, service: str) -> object:
    attempt = str(uuid.uuid4())
    return encode_event(
        TaskEvent(EventKind.SUCCEEDED, task_id, response={"ok": 1}, host="pod", attempt=attempt),
        service,
    )


@pytest.mark.timeout(120)
def test_results_are_consumed_again_after_out_was_deleted_under_a_backlog(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    with own_gateway(database_url, amqp_url, procs) as (gw, svc, _):
        out = topology.out_queue(svc.queue_name)
        with gw.http(svc.clients[0]) as http:

            def submit() -> str:
                answer = http.post(gw.tasks_url(svc.name), json={"body": {"n": 1}})
                assert answer.status_code == 201, answer.text
                return str(answer.json()["data"]["taskId"])

            def status(task_id: str) -> str:
                return str(http.get(f"{gw.tasks_url(svc.name)}/{task_id}").json()["data"]["status"])

            backlog = [submit() for _ in range(60)]
            gw.proc.signal(signal.SIGSTOP)
            try:
                publish(amqp_url, out, [_succeeded(t, svc.name) for t in backlog])  # type: ignore[misc]
                time.sleep(1.0)
                delete_queues(amqp_url, [out])
            finally:
                gw.proc.signal(signal.SIGCONT)
            wait_until(lambda: message_count(amqp_url, out) is not None, 20, what="-out again")
            later = submit()
            publish(amqp_url, out, [_succeeded(later, svc.name)])  # type: ignore[list-item]
            wait_until(lambda: status(later) == "SUCCESS", 30, what="a later result applied")
