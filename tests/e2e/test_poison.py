"""Poison messages published straight into `-in` and `-out` of a running platform:
none crashes a process or blocks a queue, and each one is accounted for."""

from __future__ import annotations

import json
import uuid

import pytest

from conveyor.events import (
    EventKind,
    Submission,
    TaskEvent,
    WireMessage,
    encode_event,
    encode_submission,
)
from tests.e2e.conftest import Stack
from tests.support.amqp import message_count, publish, wait_for_queues, wait_until
from tests.support.gateway import Platform

SIXTEEN_MB = 16 * 1024 * 1024


def _poison(kind: str) -> list[WireMessage]:
    unknown = str(uuid.uuid4())
    return [
        WireMessage(b"not json at all"),
        WireMessage(json.dumps({"data": {"messageType": kind}}).encode()),  # missing taskId
        WireMessage(json.dumps({"taskId": 42, "data": {"messageType": kind, "body": []}}).encode()),
        WireMessage(b"{" * SIXTEEN_MB),
        WireMessage(b'{"a": 1}', {"ce-specversion": "1.0", "ce-id": "x"}),  # attributes missing
    ], unknown


@pytest.mark.timeout(120)
def test_poison_on_in_and_out_is_accounted_for(stack: Stack, platform: Platform) -> None:
    dispatcher = stack.dispatcher("pod-a")
    queue = stack.service.queue_name
    url = stack.amqp_url
    in_poison, unknown_in = _poison("submission")
    out_poison, unknown_out = _poison("started")
    # Well-formed, but about tasks that do not exist.
    in_poison.append(encode_submission(Submission(unknown_in, stack.service.name, {"sleep": 0})))
    # Found by a black-box test: CloudEvents on -in that are not submissions were called.
    in_poison.append(
        encode_event(TaskEvent(EventKind.FAILED, unknown_in, error_message="x"), queue)
    )
    other_subject = encode_submission(Submission(unknown_in, stack.service.name, {"sleep": 0}))
    other_subject.headers["ce-subject"] = str(uuid.uuid4())
    in_poison.append(other_subject)
    out_poison.append(encode_event(TaskEvent(EventKind.SUCCEEDED, unknown_out, response={}), queue))
    # The gateway declares a new service's queues shortly after it is created.
    wait_for_queues(url, [f"{queue}-in", f"{queue}-out"])
    publish(url, f"{queue}-in", in_poison)
    publish(url, f"{queue}-out", out_poison)

    # -in's poison is dead-lettered by the dispatcher, then set aside by the gateway.
    def accounted() -> dict[str, int]:
        rows = platform.sql(
            "SELECT queue, count(*) FROM poison_messages WHERE queue LIKE %(q)s GROUP BY queue",
            {"q": f"{queue}-%"},
        )
        return dict(rows)

    expected = {f"{queue}-dlq": 7, f"{queue}-out": 5}
    wait_until(lambda: accounted() == expected, 60, what="every poison message set aside")
    for suffix in ("in", "out", "dlq"):  # nothing blocks a queue
        wait_until(
            lambda s=suffix: message_count(url, f"{queue}-{s}") == 0, 30, what=f"-{suffix} empty"
        )
    sizes = platform.sql(
        "SELECT max(body_size), max(length(body)) FROM poison_messages WHERE queue LIKE %(q)s",
        {"q": f"{queue}-%"},
    )
    assert sizes == [(SIXTEEN_MB, 64 * 1024)]  # the size is recorded, the body is truncated
    assert platform.sql(
        "SELECT count(*) FROM tasks WHERE task_id IN (%(a)s, %(b)s)",
        {"a": unknown_in, "b": unknown_out},
    ) == [(0,)]

    # Both processes are alive and the queue still flows.
    assert dispatcher.alive() and stack.gateway.proc.alive()
    final = stack.finish(stack.submit({"sleep": 0}))
    assert final["status"] == "SUCCESS"


@pytest.mark.timeout(120)
def test_a_task_whose_submission_a_dispatcher_refuses_fails_with_the_reason(
    stack: Stack, platform: Platform
) -> None:
    """A submission allowing no attempt, or with an unreadable expiry, is dead-lettered by the
    dispatcher uncalled (a call would have ended it SUCCESS first). From a review: the gateway
    read the dead letter as strictly, found it poison too, and set it aside: its task stayed
    PENDING until its time to live."""
    stack.dispatcher("pod-refuses")
    queue = stack.service.queue_name
    tasks = [str(uuid.uuid4()) for _ in range(2)]
    for task_id in tasks:  # as a gateway leaves a task it published: PENDING, marked
        platform.sql(
            "INSERT INTO tasks (task_id, client_id, service, request, submission_date)"
            " VALUES (%(t)s, %(c)s, %(s)s, '{}', now())",
            {"t": task_id, "c": stack.client.client_id, "s": stack.service.name},
        )
    refused = [encode_submission(Submission(t, stack.service.name, {"sleep": 0})) for t in tasks]
    refused[0].headers["ce-conveyormaxattempts"] = "0"
    refused[1].headers["ce-conveyorexpires"] = "tomorrow"
    wait_for_queues(stack.amqp_url, [f"{queue}-in", f"{queue}-out"])
    publish(stack.amqp_url, f"{queue}-in", refused)
    for task_id in tasks:
        final = stack.finish(task_id, timeout=60)
        assert final["status"] == "FAILURE", final
        assert "dead-lettered" in final["errorMessage"]
