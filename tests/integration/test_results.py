"""What the gateway reads back from RabbitMQ: task events on `-out`, dead letters on `-dlq`.

* replay: a realistic life of each task (two attempts, progress, one terminal
  event), shuffled and with duplicates, consumed by two gateways at once, ends
  in exactly the terminal state; replaying it all again changes nothing;
* a redelivery resets worker host, progress and start date;
* the seed's own JSON, in both spellings, drives a legacy service;
* messages nobody can read are set aside in `poison_messages`, never retried,
  and never stop the consumer; a terminal one whose task can still be read ends it;
* a service given another queue name or format is consumed as it now is, and the
  queues it left as long as they exist;
* dead-lettered submissions fail their task with a clear message;
* a legacy service's `-in` carries the seed's submission JSON and accepts the
  seed worker's own queue declaration.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import partial
from itertools import permutations
from typing import Any

import aiormq.exceptions
import httpx
import psycopg
import pytest

from conveyor import headers as h
from conveyor import topology
from conveyor.events import (
    EventKind,
    MessageFormat,
    Submission,
    TaskEvent,
    WireMessage,
    decode_submission,
    encode_event,
    encode_submission,
)
from conveyor.settings import GatewaySettings
from gateway import results
from gateway.database_url import libpq
from gateway.results import MAX_RETURNS
from gateway.store import iso
from tests.support.amqp import (
    consumer_count,
    declare_like_seed_worker,
    delete_queues,
    message_count,
    publish,
    publish_without_id,
    queues_of,
    raw_json,
    reject_until_dead_lettered,
    remove_service,
    take_all,
    unacked,
    wait_for_queues,
    wait_until,
)
from tests.support.gateway import GatewayProcess, Platform, Service, gateway_env, run_sync
from tests.support.processes import Processes

TASKS_PER_SEED = 30


@pytest.fixture(scope="module")
def second_gateway(
    database_url: str, amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """Another replica consuming `-out` next to the shared `gateway`."""
    procs = Processes(tmp_path_factory.mktemp("second-gateway"))
    try:
        yield GatewayProcess(
            procs, gateway_env(database_url, amqp_url), "gateway-2", "--only-background"
        )
    finally:
        procs.stop_all()


@pytest.fixture
def replicas(gateway: GatewayProcess, second_gateway: GatewayProcess) -> list[GatewayProcess]:
    return [gateway, second_gateway]


def _service(platform: Platform, amqp_url: str, **options: Any) -> Service:
    service = platform.service(**options)
    wait_for_queues(amqp_url, queues_of(service.queue_name))
    return service


@pytest.fixture
def svc(platform: Platform, amqp_url: str, replicas: list[GatewayProcess]) -> Iterator[Service]:
    service = _service(platform, amqp_url)
    yield service
    remove_service(platform, amqp_url, service)


@pytest.fixture
def legacy_svc(
    platform: Platform, amqp_url: str, replicas: list[GatewayProcess]
) -> Iterator[Service]:
    service = _service(platform, amqp_url, messageFormat="legacy")
    yield service
    remove_service(platform, amqp_url, service)


# -- helpers -------------------------------------------------------------------


def _submit_all(gateway: GatewayProcess, svc: Service, bodies: list[dict[str, Any]]) -> list[str]:
    task_ids = []
    with gateway.http(svc.clients[0]) as http:
        for body in bodies:
            answer = http.post(gateway.tasks_url(svc.name), json={"body": body})
            assert answer.status_code == 201, answer.text
            task_ids.append(answer.json()["data"]["taskId"])
    return task_ids


def _submit(gateway: GatewayProcess, svc: Service, body: dict[str, Any]) -> str:
    return _submit_all(gateway, svc, [body])[0]


def _poll_all(gateway: GatewayProcess, svc: Service, task_ids: list[str]) -> dict[str, Any]:
    polled = {}
    with gateway.http(svc.clients[0]) as http:
        for task_id in task_ids:
            answer = http.get(f"{gateway.tasks_url(svc.name)}/{task_id}")
            assert answer.status_code == 200, answer.text
            polled[task_id] = answer.json()["data"]
    return polled


def _poll(gateway: GatewayProcess, svc: Service, task_id: str) -> dict[str, Any]:
    return _poll_all(gateway, svc, [task_id])[task_id]


def _poll_until(
    gateway: GatewayProcess, svc: Service, task_id: str, timeout: float = 10.0, **expected: Any
) -> dict[str, Any]:
    def matches() -> dict[str, Any] | None:
        data = _poll(gateway, svc, task_id)
        return data if all(data.get(k) == v for k, v in expected.items()) else None

    return wait_until(matches, timeout, what=f"task {task_id} with {expected}")


def _column(platform: Platform, task_id: str, column: str) -> Any:
    return platform.sql(f"SELECT {column} FROM tasks WHERE task_id = %(t)s", {"t": task_id})[0][0]


def _ms(moment: datetime) -> datetime:
    """Rounded to the millisecond, the precision of the API's dates."""
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000)


def _event(svc: Service, kind: EventKind, task_id: str, **fields: Any) -> WireMessage:
    return encode_event(TaskEvent(kind=kind, task_id=task_id, **fields), svc.name)


def _publish_events(amqp_url: str, svc: Service, *messages: WireMessage) -> None:
    publish(amqp_url, topology.out_queue(svc.queue_name), messages)


def _drained(amqp_url: str, queue: str) -> bool:
    return message_count(amqp_url, queue) == 0


def _publish_one_by_one(amqp_url: str, svc: Service, *messages: WireMessage) -> None:
    """Each in a publish of its own, in this order, and every one read off `-out`."""
    for message in messages:
        _publish_events(amqp_url, svc, message)
    wait_until(lambda: _drained(amqp_url, topology.out_queue(svc.queue_name)), what="drained")


def _history(platform: Platform, task_id: str, columns: str) -> list[tuple[Any, ...]]:
    """The task's attempts, first begun first: the attempt id, then `columns`."""
    return platform.sql(
        f"SELECT attempt_id, {columns} FROM task_attempts"
        " WHERE task_id = %(t)s ORDER BY start_date",
        {"t": task_id},
    )


def _unfinished(platform: Platform, task_ids: list[str]) -> int:
    rows = platform.sql(
        "SELECT count(*) FROM tasks WHERE task_id = ANY(%(ids)s::uuid[])"
        " AND status NOT IN ('SUCCESS', 'FAILURE')",
        {"ids": task_ids},
    )
    return rows[0][0]


# -- replay: order, duplicates and replicas change nothing ---------------------


def _life(svc: Service, task_id: str, index: int, start: datetime) -> tuple[list, dict]:
    """The events of one task with a redelivery, and the terminal state they must produce."""
    a, b = f"{task_id}/a", f"{task_id}/b"
    at = [_ms(start + timedelta(seconds=s)) for s in range(7)]
    events = [
        _event(svc, EventKind.STARTED, task_id, host="host-a", attempt=a, time=at[0]),
        _event(svc, EventKind.PROGRESS, task_id, progress=10.0, attempt=a, time=at[1]),
        _event(svc, EventKind.PROGRESS, task_id, progress=20.0, attempt=a, time=at[2]),
        _event(svc, EventKind.STARTED, task_id, host="host-b", attempt=b, time=at[3]),
        _event(svc, EventKind.PROGRESS, task_id, progress=5.0, attempt=b, time=at[4]),
        _event(svc, EventKind.PROGRESS, task_id, progress=50.0, attempt=b, time=at[5]),
    ]
    if index % 2:
        response = {"index": index, "items": [1, "two", None]}
        events.append(
            _event(svc, EventKind.SUCCEEDED, task_id, response=response, attempt=b, time=at[6])
        )
        expected = {"status": "SUCCESS", "response": response, "progress": 100.0}
    else:
        message = f"boom {index}"
        events.append(
            _event(svc, EventKind.FAILED, task_id, error_message=message, attempt=b, time=at[6])
        )
        expected = {"status": "FAILURE", "errorMessage": message}
    expected["endDate"] = iso(at[6])
    return events, expected


def _shuffled_with_duplicates(events: list[WireMessage], rng: random.Random) -> list[WireMessage]:
    stream = events + [e for e in events if rng.random() < 0.3]
    rng.shuffle(stream)
    return stream


def _snapshot(platform: Platform, svc: Service) -> tuple[list, list]:
    tasks = platform.sql("SELECT * FROM tasks WHERE service = %(s)s ORDER BY id", {"s": svc.name})
    attempts = platform.sql(
        "SELECT a.* FROM task_attempts a JOIN tasks t USING (task_id)"
        " WHERE t.service = %(s)s ORDER BY a.id",
        {"s": svc.name},
    )
    return tasks, attempts


def _settled(platform: Platform, svc: Service, amqp_url: str) -> tuple[list, list]:
    """Waits until `-out` is drained and the rows stop changing; returns them."""
    out = topology.out_queue(svc.queue_name)
    previous = None
    while True:
        wait_until(lambda: _drained(amqp_url, out), 20, what="-out drained")
        current = _snapshot(platform, svc)
        if current == previous:
            return current
        previous = current
        time.sleep(0.5)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("seed", [11, 22, 33])
def test_shuffled_duplicated_replay_ends_in_the_terminal_state(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str, seed: int
) -> None:
    rng = random.Random(seed)
    start = datetime.now(UTC) - timedelta(minutes=5)
    expected: dict[str, dict[str, Any]] = {}
    events: list[WireMessage] = []
    task_ids = _submit_all(gateway, svc, [{"index": i} for i in range(TASKS_PER_SEED)])
    for index, task_id in enumerate(task_ids):
        life, expected[task_id] = _life(svc, task_id, index, start)
        events += life

    _publish_events(amqp_url, svc, *_shuffled_with_duplicates(events, rng))
    wait_until(lambda: _unfinished(platform, list(expected)) == 0, 20, what="all finished")
    before = _settled(platform, svc, amqp_url)

    polled = _poll_all(gateway, svc, list(expected))
    for task_id, wanted in expected.items():
        data = polled[task_id]
        assert {k: data.get(k) for k in wanted} == wanted, task_id
        if wanted["status"] == "FAILURE":
            assert data["progress"] in (0.0, 5.0, 10.0, 20.0, 50.0)
            assert "response" not in data
        else:
            assert "errorMessage" not in data

    _publish_events(amqp_url, svc, *_shuffled_with_duplicates(events, rng))
    assert _settled(platform, svc, amqp_url) == before


@pytest.mark.timeout(60)
def test_redelivery_resets_host_progress_and_start_date(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    task_id = _submit(gateway, svc, {"n": 1})
    first = _ms(datetime.now(UTC) - timedelta(seconds=30))
    second = first + timedelta(seconds=10)
    a, b = "attempt-a", "attempt-b"

    _publish_events(
        amqp_url, svc, _event(svc, EventKind.STARTED, task_id, host="host-a", attempt=a, time=first)
    )
    data = _poll_until(gateway, svc, task_id, status="IN_PROGRESS")
    assert data["startDate"] == iso(first) and data["progress"] == 0.0
    assert _column(platform, task_id, "worker_host") == "host-a"
    for value in (10.0, 20.0):
        _publish_events(
            amqp_url, svc, _event(svc, EventKind.PROGRESS, task_id, progress=value, attempt=a)
        )
        _poll_until(gateway, svc, task_id, progress=value)

    _publish_events(
        amqp_url,
        svc,
        _event(svc, EventKind.STARTED, task_id, host="host-b", attempt=b, time=second),
    )
    data = _poll_until(gateway, svc, task_id, startDate=iso(second))
    assert data["status"] == "IN_PROGRESS" and data["progress"] == 0.0
    assert _column(platform, task_id, "worker_host") == "host-b"

    # The killed worker's late progress belongs to an attempt that is over.
    _publish_events(
        amqp_url,
        svc,
        _event(svc, EventKind.PROGRESS, task_id, progress=90.0, attempt=a),
        _event(svc, EventKind.PROGRESS, task_id, progress=50.0, attempt=b),
    )
    _poll_until(gateway, svc, task_id, progress=50.0)
    wait_until(lambda: _drained(amqp_url, topology.out_queue(svc.queue_name)), what="drained")
    assert _poll(gateway, svc, task_id)["progress"] == 50.0

    _publish_events(
        amqp_url, svc, _event(svc, EventKind.SUCCEEDED, task_id, response={"ok": 1}, attempt=b)
    )
    data = _poll_until(gateway, svc, task_id, status="SUCCESS")
    assert data["progress"] == 100.0 and data["response"] == {"ok": 1}
    history = platform.sql(
        "SELECT attempt_id, worker_host, outcome, end_date IS NOT NULL FROM task_attempts"
        " WHERE task_id = %(t)s ORDER BY start_date",
        {"t": task_id},
    )
    assert history == [(a, "host-a", "interrupted", True), (b, "host-b", "success", True)]


def test_a_terminal_event_standing_in_for_started_opens_and_closes_its_attempt(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """A call shorter than STARTED_DELAY_MS sends no `started`: its terminal event carries
    the host and the start, and the task reads as if both events had come."""
    quick = _submit(gateway, svc, {"n": 1})
    began = _ms(datetime.now(UTC) - timedelta(seconds=1))
    _publish_events(
        amqp_url,
        svc,
        _event(
            svc, EventKind.SUCCEEDED, quick, response=1, attempt="c", host="host-c", started=began
        ),
    )
    data = _poll_until(gateway, svc, quick, status="SUCCESS")
    assert data["startDate"] == iso(began) and data["endDate"] >= data["startDate"]
    assert _column(platform, quick, "worker_host") == "host-c"
    assert _column(platform, quick, "attempts") == 1

    # A redelivery that answered quickly, after an attempt that had said `started`.
    redone = _submit(gateway, svc, {"n": 2})
    first = _ms(datetime.now(UTC) - timedelta(seconds=20))
    second = first + timedelta(seconds=10)
    _publish_events(
        amqp_url,
        svc,
        _event(svc, EventKind.STARTED, redone, host="host-a", attempt="a", time=first),
    )
    _poll_until(gateway, svc, redone, status="IN_PROGRESS")
    _publish_events(
        amqp_url,
        svc,
        _event(
            svc,
            EventKind.FAILED,
            redone,
            error_message="Argh!",
            attempt="b",
            host="host-b",
            started=second,
        ),
    )
    data = _poll_until(gateway, svc, redone, status="FAILURE")
    assert data["startDate"] == iso(second) and data["errorMessage"] == "Argh!"
    assert _column(platform, redone, "worker_host") == "host-b"
    history = platform.sql(
        "SELECT task_id::text, attempt_id, worker_host, outcome, error_message,"
        " end_date IS NOT NULL FROM task_attempts"
        " WHERE task_id = ANY(%(t)s::uuid[]) ORDER BY start_date",
        {"t": [quick, redone]},
    )
    assert history == [
        (redone, "a", "host-a", "interrupted", None, True),
        (redone, "b", "host-b", "failure", "Argh!", True),
        (quick, "c", "host-c", "success", None, True),
    ]


# -- a service whose queues change while the gateways run ---------------------------


def _declare_as_admin_apply(amqp_url: str, queue_name: str, message_format: MessageFormat) -> None:
    """What `conveyor admin apply` declares besides writing the service's row."""
    import aio_pika

    async def declare() -> None:
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel()
            limit = GatewaySettings().delivery_limit
            await topology.declare_service(channel, queue_name, message_format, limit)

    run_sync(declare())


@pytest.mark.timeout(90)
def test_a_moved_queue_name_is_consumed_and_the_old_one_while_it_exists(
    replicas: list[GatewayProcess], svc: Service, platform: Platform, amqp_url: str
) -> None:
    """`conveyor admin apply` gives a service another queueName while the gateways run:
    the new queue's dispatchers report on the new `-out`, and the old queue's still finish
    their tasks on the old one. Both are consumed, the old one until the operator deletes it,
    and then never declared again."""
    gateway = replicas[0]
    old_out = topology.out_queue(svc.queue_name)
    wait_until(lambda: consumer_count(amqp_url, old_out) == len(replicas), what="both consuming")
    old_task = _submit(gateway, svc, {"n": 1})  # on the old `-in`: an old dispatcher's
    moved = Service(svc.name, f"{svc.queue_name}-moved", svc.clients)
    platform.apply({"services": [{"name": svc.name, "queueName": moved.queue_name}]})
    _declare_as_admin_apply(amqp_url, moved.queue_name, MessageFormat.CLOUDEVENTS)
    try:
        new_task = _submit(gateway, moved, {"n": 2})
        _publish_events(amqp_url, moved, _event(moved, EventKind.SUCCEEDED, new_task, response=2))
        _publish_events(amqp_url, svc, _event(svc, EventKind.SUCCEEDED, old_task, response=1))
        assert _poll_until(gateway, moved, new_task, status="SUCCESS")["response"] == 2
        assert _poll_until(gateway, svc, old_task, status="SUCCESS")["response"] == 1
        for queue in (topology.out_queue(moved.queue_name), old_out):
            wait_until(lambda q=queue: consumer_count(amqp_url, q) == len(replicas), what=queue)

        delete_queues(amqp_url, queues_of(svc.queue_name))  # the operator, once drained
        time.sleep(2.0)  # refreshes every 0.3 s
        assert [message_count(amqp_url, q) for q in queues_of(svc.queue_name)] == [None] * 3
        later = _submit(gateway, moved, {"n": 3})
        _publish_events(amqp_url, moved, _event(moved, EventKind.FAILED, later, error_message="x"))
        _poll_until(gateway, moved, later, status="FAILURE")
    finally:
        remove_service(platform, amqp_url, moved)


@pytest.mark.timeout(90)
def test_submissions_left_in_a_moved_queue_go_to_the_one_it_moved_to(
    replicas: list[GatewayProcess], svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Submissions still waiting in the old `-in` when their service moves (no dispatcher
    took them yet, or a SIGTERM handed them back there) waited with no consumer until their
    time to live, while the admin API counted the new, empty queue. The gateway publishes
    each unfinished one to the queue its service now has, in its service's format, its
    deliveries counted and its expiry kept; a finished task's message is dropped, an
    unreadable one set aside."""
    gateway = replicas[0]
    old_in = topology.in_queue(svc.queue_name)
    waiting = _submit_all(gateway, svc, [{"n": 1}, {"n": 2}])
    done = _submit(gateway, svc, {"n": 3})
    wait_until(lambda: message_count(amqp_url, old_in) == 3, what="all three published")
    _publish_events(amqp_url, svc, _event(svc, EventKind.SUCCEEDED, done, response=3))
    _poll_until(gateway, svc, done, status="SUCCESS")
    handed_back = take_all(amqp_url, old_in)  # as a dispatcher's SIGTERM would requeue them
    again = [
        replace(m, headers={**m.headers, "x-conveyor-requeues": 2}, expiration=600.0)
        for m in handed_back
    ]
    publish(amqp_url, old_in, [*again, raw_json(b"\x00garbage")])
    moved = Service(svc.name, f"{svc.queue_name}-moved", svc.clients)
    platform.apply(
        {"services": [{"name": svc.name, "queueName": moved.queue_name, "messageFormat": "legacy"}]}
    )
    _declare_as_admin_apply(amqp_url, moved.queue_name, MessageFormat.LEGACY)
    try:
        new_in = topology.in_queue(moved.queue_name)
        wait_until(lambda: message_count(amqp_url, old_in) == 0, 20, what="the old -in drained")
        wait_until(lambda: message_count(amqp_url, new_in) == 2, 20, what="in the new -in")
        taken = take_all(amqp_url, new_in)
        submissions = [decode_submission(m, svc.name) for m in taken]
        assert sorted(s.task_id for s in submissions) == sorted(waiting)
        assert {s.message_format for s in submissions} == {MessageFormat.LEGACY}
        assert sorted(s.body["n"] for s in submissions) == [1, 2]
        assert [m.headers.get("x-conveyor-requeues") for m in taken] == [2, 2]
        polled = _poll_all(gateway, svc, waiting)
        assert {data["status"] for data in polled.values()} == {"PENDING"}
        assert [row[1] for row in _poison(platform, old_in)] == [b"\x00garbage"]  # set aside
    finally:
        remove_service(platform, amqp_url, moved)


@pytest.mark.timeout(90)
def test_submissions_in_a_moved_queue_move_once_when_only_the_gateways_declare_the_new_one(
    replicas: list[GatewayProcess], svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by CI: a service moved by a plain write of its row (nothing declares the new
    queues but the gateways) has no `-in` yet when a gateway subscribes it, which looked
    like an `-in` lost with its messages: its tasks marked published were published again to
    the new queue, and moved there from the old one too, each function called twice. Only a
    task published since the service's last move tells a lost queue now."""
    gateway = replicas[0]
    old_in = topology.in_queue(svc.queue_name)
    waiting = _submit_all(gateway, svc, [{"n": n} for n in range(5)])
    wait_until(lambda: message_count(amqp_url, old_in) == 5, what="all published")
    unmarked = "SELECT count(*) FROM tasks WHERE service = %(s)s AND publish_at IS NOT NULL"
    wait_until(lambda: platform.sql(unmarked, {"s": svc.name})[0][0] == 0, what="marked")
    moved = Service(svc.name, f"{svc.queue_name}-moved", svc.clients)
    platform.apply({"services": [{"name": svc.name, "queueName": moved.queue_name}]})
    try:
        new_in = topology.in_queue(moved.queue_name)
        wait_until(lambda: message_count(amqp_url, old_in) == 0, 20, what="the old -in drained")
        wait_until(lambda: (message_count(amqp_url, new_in) or 0) >= 5, 20, what="moved")
        time.sleep(2.0)  # a republish comes after the 1 s a restored queue is left to settle
        taken = take_all(amqp_url, new_in)
        assert sorted(decode_submission(m, svc.name).task_id for m in taken) == sorted(waiting)
    finally:
        remove_service(platform, amqp_url, moved)


@pytest.mark.timeout(90)
def test_a_service_moved_back_to_a_queue_it_left_takes_its_submissions_there_once(
    replicas: list[GatewayProcess], svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by a black-box sweep: a service moved back to the queue name it had left was
    still consumed there as a left-behind `-in` until the next refresh, and each new
    submission was "moved" into the very queue it was in, taken again, moved again: 136 times
    in 2.4 s for one task, and the copies the refresh handed back counted as crashes. The
    first gateway to move one into the queue it came from stops consuming that queue as one
    left behind: a gateway that took a copy before its own consumer there ended moves it once
    more, none twice."""
    gateway = replicas[0]
    old_in = topology.in_queue(svc.queue_name)
    moved = Service(svc.name, f"{svc.queue_name}-moved", svc.clients)
    platform.apply({"services": [{"name": svc.name, "queueName": moved.queue_name}]})
    _declare_as_admin_apply(amqp_url, moved.queue_name, MessageFormat.CLOUDEVENTS)
    try:
        wait_until(lambda: consumer_count(amqp_url, old_in) == len(replicas), what="retired")
        platform.apply({"services": [{"name": svc.name, "queueName": svc.queue_name}]})
        waiting = _submit_all(gateway, svc, [{"n": n} for n in range(5)])
        wait_until(lambda: consumer_count(amqp_url, old_in) == 0, 20, what="no longer retired")
        time.sleep(1.0)
        taken = take_all(amqp_url, old_in)
        task_ids = [decode_submission(m, svc.name).task_id for m in taken]
        assert sorted(task_ids) == sorted(waiting)  # each once, none lost
        # A copy a gateway held while its refresh replaced its channel (the subscription
        # stale once the service moved back) went back to the queue once and counts that
        # return (seen once in a loaded full run); none went back more than once.
        returns = [int(m.headers.get(h.CRASHES, 0)) for m in taken]
        assert max(returns) <= 1, returns
        logged = "".join(r.proc.log_path.read_text(errors="replace") for r in replicas)
        moves = [line for line in logged.splitlines() if "submission moved" in line]
        per_task = {t: sum(t in line for line in moves) for t in waiting}
        assert max(per_task.values()) <= 1 + len(replicas), per_task
    finally:
        remove_service(platform, amqp_url, moved)


def _restarts(gateway: GatewayProcess) -> float:
    return gateway.metric('conveyor_gateway_loop_restarts_total{loop="results-apply"}')


@pytest.mark.timeout(120)
def test_catalog_changes_while_results_flow_crash_nothing_and_move_each_submission_once(
    replicas: list[GatewayProcess], svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by a black-box test: any service's queueName changed (or a service deleted)
    replaces the gateway's results channel while a batch from it is being applied. The batch's
    ack then raised (its channel closed) and crashed `results-apply`; acks sent on the closing
    channel could get the whole connection closed; and a submission left in a moved-away `-in`,
    published to its service's new queue but not acked, came back and was moved again: its
    function called twice. A batch from a replaced channel is now left to the broker (which
    gives its messages again on the new channel), and a channel is replaced between batches."""
    gateway = replicas[0]
    before = [_restarts(g) for g in replicas]
    waiting = _submit_all(gateway, svc, [{"n": n} for n in range(300)])
    old_in = topology.in_queue(svc.queue_name)
    wait_until(lambda: message_count(amqp_url, old_in) == 300, what="all published")
    other = Service(f"{svc.name}-other", f"{svc.queue_name}-o0", svc.clients)
    platform.apply({"services": [{"name": other.name, "queueName": other.queue_name}]})
    moved = Service(svc.name, f"{svc.queue_name}-moved", svc.clients)
    names = [other.queue_name]
    flooding = threading.Event()
    leftovers: list[Service] = []

    def flood() -> None:  # results a batch at a time, all along
        for _ in range(20):
            if flooding.is_set():
                return
            events = [_event(svc, EventKind.PROGRESS, str(uuid.uuid4()), progress=1.0)]
            _publish_events(amqp_url, svc, *(events * 300))

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        time.sleep(0.5)
        platform.apply({"services": [{"name": svc.name, "queueName": moved.queue_name}]})
        _declare_as_admin_apply(amqp_url, moved.queue_name, MessageFormat.CLOUDEVENTS)
        for n in range(1, 16):  # another service's queue changing, each a replaced channel
            names.append(f"{svc.queue_name}-o{n}")
            platform.apply({"services": [{"name": other.name, "queueName": names[-1]}]})
            time.sleep(0.35)  # the replicas refresh every 0.3 s
        flooding.set()
        flooder.join(30)
        new_in = topology.in_queue(moved.queue_name)
        wait_until(lambda: _drained(amqp_url, topology.out_queue(svc.queue_name)), 60, what="flood")
        wait_until(lambda: message_count(amqp_url, old_in) == 0, 30, what="the old -in drained")
        time.sleep(1.0)  # a submission moved twice would arrive now
        taken = take_all(amqp_url, new_in)
        moved_ids = [decode_submission(m, svc.name).task_id for m in taken]
        assert sorted(moved_ids) == sorted(waiting), "each waiting submission moved once"
        assert [_restarts(g) for g in replicas] == before
        # Every replica still subscribes: in CI one replica's results pacing waited for good on
        # a channel a refresh had replaced, and no later service was ever consumed there.
        later = Service(f"{svc.name}-later", f"{svc.queue_name}-later", svc.clients)
        leftovers.append(later)
        platform.apply({"services": [{"name": later.name, "queueName": later.queue_name}]})
        later_out = topology.out_queue(later.queue_name)
        wait_until(lambda: consumer_count(amqp_url, later_out) == len(replicas), 30, what="later")
    finally:
        remove_service(platform, amqp_url, moved)
        for name in names:
            remove_service(platform, amqp_url, Service(other.name, name, svc.clients))
        for leftover in leftovers:
            remove_service(platform, amqp_url, leftover)


@pytest.mark.timeout(60)
def test_a_changed_message_format_is_declared_again(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """A service turned legacy on its quorum queues: the gateway declares them again as the
    seed's workers will (plain durable queues), and reports the refusal (/readyz) instead of
    going on as if nothing changed; its events are still consumed."""
    platform.apply(
        {"services": [{"name": svc.name, "queueName": svc.queue_name, "messageFormat": "legacy"}]}
    )

    def reported() -> str | None:
        return httpx.get(f"{gateway.url}/readyz").json()["data"].get("services", {}).get(svc.name)

    assert "PRECONDITION_FAILED" in wait_until(reported, what="the service reported")
    task_id = _submit(gateway, svc, {"n": 1})
    _legacy(amqp_url, svc, {"taskId": task_id, "data": {"messageType": "success", "response": 1}})
    assert _poll_until(gateway, svc, task_id, status="SUCCESS")["response"] == 1


# -- the seed's own messages ---------------------------------------------------


def _legacy(amqp_url: str, svc: Service, payload: dict[str, Any]) -> None:
    """One message exactly as the seed's worker writes it: JSON, no headers."""
    publish(amqp_url, topology.out_queue(svc.queue_name), [raw_json(payload)])


@pytest.mark.timeout(60)
@pytest.mark.timeout(60)
def test_a_worker_cannot_end_another_service_s_task(
    gateway: GatewayProcess, svc: Service, legacy_svc: Service, amqp_url: str
) -> None:
    """Found by a black-box probe: a `success` on one service's `-out` naming another
    service's task set that task SUCCESS with the first service's answer. Whatever comes
    from a queue applies only to the tasks of the services that have (or had) its name."""
    theirs = _submit(gateway, svc, {"n": 1})
    succeeded = {"messageType": "success", "response": "not yours"}
    _legacy(amqp_url, legacy_svc, {"taskId": theirs, "data": succeeded})
    failed = {"messageType": "failure", "errorMessage": "not yours either"}
    _legacy(amqp_url, legacy_svc, {"taskId": theirs, "data": failed})
    mine = _submit(gateway, legacy_svc, {"n": 2})
    _legacy(amqp_url, legacy_svc, {"taskId": mine, "data": succeeded})  # after the others
    _poll_until(gateway, legacy_svc, mine, status="SUCCESS")
    assert _poll(gateway, svc, theirs)["status"] == "PENDING"
    _publish_events(amqp_url, svc, _event(svc, EventKind.SUCCEEDED, theirs, response="mine"))
    assert _poll_until(gateway, svc, theirs, status="SUCCESS")["response"] == "mine"


@pytest.mark.timeout(60)
def test_what_a_legacy_worker_sends_oddly_still_ends_its_task_as_it_said(
    gateway: GatewayProcess, legacy_svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by a black-box probe: a `started` whose hostName held a NUL was set aside (the
    task stayed PENDING); a `failure` not in UTF-8 was set aside (the task stayed IN_PROGRESS
    until the watchdog, 20 minutes by default, then failed for silence); an errorMessage of
    megabytes was stored whole, an object one as Python's repr; a null beside the other
    spelling of a field was read as missing."""
    host_nul, not_utf8, huge, spelled = (_submit(gateway, legacy_svc, {"n": n}) for n in range(4))
    started = {"messageType": "started", "hostName": "pod\x00a"}
    _legacy(amqp_url, legacy_svc, {"taskId": host_nul, "data": started})
    _poll_until(gateway, legacy_svc, host_nul, status="IN_PROGRESS")
    assert _column(platform, host_nul, "worker_host") == "pod\ufffda"

    failure = b'{"taskId": "%s", "data": {"messageType": "failure", "errorMessage": "caf\xe9"}}'
    publish(
        amqp_url, topology.out_queue(legacy_svc.queue_name), [raw_json(failure % not_utf8.encode())]
    )
    assert (
        _poll_until(gateway, legacy_svc, not_utf8, status="FAILURE")["errorMessage"] == "caf\ufffd"
    )

    long_one = {"messageType": "failure", "errorMessage": "x" * 100_000}
    _legacy(amqp_url, legacy_svc, {"taskId": huge, "data": long_one})
    assert len(_poll_until(gateway, legacy_svc, huge, status="FAILURE")["errorMessage"]) == 4096

    as_object = {"messageType": None, "message_type": "failure", "errorMessage": {"code": 7}}
    _legacy(amqp_url, legacy_svc, {"taskId": None, "task_id": spelled, "data": as_object})
    data = _poll_until(gateway, legacy_svc, spelled, status="FAILURE")
    assert data["errorMessage"] == '{"code":7}'


@pytest.mark.timeout(60)
def test_a_legacy_workers_raw_control_characters_still_end_its_task_as_it_said(
    gateway: GatewayProcess, legacy_svc: Service, amqp_url: str
) -> None:
    """Found by a black-box sweep: a legacy worker that writes a newline, a tab or a NUL
    into a string as the byte itself (JSON wants them escaped) had its `failure` set aside,
    its task left IN_PROGRESS until the watchdog, its error lost; a Latin-1 byte in the same
    place was read. Its words are read as written."""
    out = topology.out_queue(legacy_svc.queue_name)
    written = {b"line1\nline2": "line1\nline2", b"a\tb": "a\tb", b"a\x00b": "a\ufffdb"}
    tasks = {}
    for raw, expected in written.items():
        task_id = _submit(gateway, legacy_svc, {"n": 1})
        started = {"messageType": "started", "hostName": "legacy-1"}
        _legacy(amqp_url, legacy_svc, {"taskId": task_id, "data": started})
        failure = b'{"taskId": "%s", "data": {"messageType": "failure", "errorMessage": "%s"}}'
        publish(amqp_url, out, [raw_json(failure % (task_id.encode(), raw))])
        tasks[task_id] = expected
    succeeded = _submit(gateway, legacy_svc, {"n": 2})
    success = b'{"taskId": "%s", "data": {"messageType": "success", "response": "a\nb"}}'
    publish(amqp_url, out, [raw_json(success % succeeded.encode())])

    for task_id, expected in tasks.items():
        data = _poll_until(gateway, legacy_svc, task_id, status="FAILURE")
        assert data["errorMessage"] == expected, data
    assert _poll_until(gateway, legacy_svc, succeeded, status="SUCCESS")["response"] == "a\nb"


def test_legacy_messages_in_both_spellings(
    gateway: GatewayProcess, legacy_svc: Service, platform: Platform, amqp_url: str
) -> None:
    winner = _submit(gateway, legacy_svc, {"sleep": 1})
    loser = _submit(gateway, legacy_svc, {"sleep": 2})

    started = {"message_type": "started", "hostname": "myjob-d49t6"}
    _legacy(amqp_url, legacy_svc, {"task_id": winner, "data": started})
    _poll_until(gateway, legacy_svc, winner, status="IN_PROGRESS", progress=0.0)
    assert _column(platform, winner, "worker_host") == "myjob-d49t6"

    progress = {"messageType": "progress", "progress": 10.0}
    _legacy(amqp_url, legacy_svc, {"taskId": winner, "data": progress})
    _poll_until(gateway, legacy_svc, winner, progress=10.0)

    response = {"thumbnail": "s3://bucket/key.png"}
    success = {"messageType": "success", "response": response}
    _legacy(amqp_url, legacy_svc, {"taskId": winner, "data": success})
    data = _poll_until(gateway, legacy_svc, winner, status="SUCCESS")
    assert data["response"] == response and data["progress"] == 100.0

    started = {"messageType": "started", "host_name": "myjob-x"}
    _legacy(amqp_url, legacy_svc, {"taskId": loser, "data": started})
    _poll_until(gateway, legacy_svc, loser, status="IN_PROGRESS")
    assert _column(platform, loser, "worker_host") == "myjob-x"

    failure = {"message_type": "failure", "error_message": "Argh!"}
    _legacy(amqp_url, legacy_svc, {"task_id": loser, "data": failure})
    data = _poll_until(gateway, legacy_svc, loser, status="FAILURE")
    assert data["errorMessage"] == "Argh!"


@pytest.mark.timeout(60)
def test_legacy_service_in_queue_is_the_seeds(
    gateway: GatewayProcess, legacy_svc: Service, platform: Platform, amqp_url: str
) -> None:
    body = {"sleep": 3, "name": "é"}
    task_id = _submit(gateway, legacy_svc, body)
    in_queue = topology.in_queue(legacy_svc.queue_name)

    (message,) = wait_until(lambda: take_all(amqp_url, in_queue), what="submission on -in")
    assert not any(k.startswith("ce-") for k in message.headers)
    # its classic queue has no delivery limit: none is stamped (found by a review)
    assert "x-conveyor-delivery-limit" not in message.headers
    assert json.loads(message.body) == {
        "taskId": task_id,
        "task_id": task_id,
        "data": {"messageType": "submission", "message_type": "submission", "body": body},
    }
    # The seed's worker declares both queues itself, durable and without arguments.
    declare_like_seed_worker(amqp_url, in_queue)
    declare_like_seed_worker(amqp_url, topology.out_queue(legacy_svc.queue_name))


def test_cloudevents_in_queue_refuses_a_plain_declaration(svc: Service, amqp_url: str) -> None:
    """The contrast that makes the legacy check meaningful: quorum `-in` has arguments."""
    with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
        declare_like_seed_worker(amqp_url, topology.in_queue(svc.queue_name))


# -- poison ----------------------------------------------------------------------


def _poison(platform: Platform, queue: str) -> list[tuple[str, bytes]]:
    rows = platform.sql(
        "SELECT reason, body FROM poison_messages WHERE queue = %(q)s ORDER BY id", {"q": queue}
    )
    return [(reason, bytes(body)) for reason, body in rows]


def _malformed_events(svc: Service) -> list[WireMessage]:
    progress = _event(svc, EventKind.PROGRESS, str(uuid.uuid4()), progress=1.0)
    unknown_type = {**progress.headers, "ce-type": "io.conveyor.task.exploded"}
    return [
        raw_json(b"this is not JSON {"),
        raw_json({"data": {"messageType": "progress", "progress": 1.0}}),
        raw_json({"taskId": str(uuid.uuid4()), "data": {"messageType": "exploded"}}),
        WireMessage(b'"a string, not an object"', progress.headers, "application/json"),
        WireMessage(progress.body, unknown_type, "application/json"),
    ]


@pytest.mark.timeout(60)
def test_malformed_events_are_set_aside_and_acked(
    replicas: list[GatewayProcess], svc: Service, platform: Platform, amqp_url: str
) -> None:
    gateway = replicas[0]
    out = topology.out_queue(svc.queue_name)
    task_id = _submit(gateway, svc, {})
    malformed = _malformed_events(svc)
    unknown_task = _event(svc, EventKind.STARTED, str(uuid.uuid4()), host="nobody")
    valid = _event(svc, EventKind.STARTED, task_id, host="host-ok")

    publish(amqp_url, out, [*malformed, unknown_task, valid])

    _poll_until(gateway, svc, task_id, status="IN_PROGRESS")
    wait_until(lambda: len(_poison(platform, out)) >= len(malformed), what="poison stored")
    wait_until(lambda: _drained(amqp_url, out), what="-out drained")
    # Acked, not held back by a stuck consumer. rabbitmqctl reads a quorum queue's counts
    # as of its last tick (every 5 s): one taken while the batch was in hand says 1 or more.
    wait_until(lambda: unacked(out) in (0, None), 15, interval=0.5, what="-out acked")
    poison = _poison(platform, out)
    assert sorted(body for _, body in poison) == sorted(m.body for m in malformed)
    assert all(reason for reason, _ in poison)
    # The unknown task's event is ignored: not poison, and no task is invented for it.
    invented = platform.sql("SELECT count(*) FROM tasks WHERE worker_host = 'nobody'")
    assert invented == [(0,)]
    for replica in replicas:
        with replica.http() as http:
            assert http.get("/healthz").status_code == 200


def _ce(task_id: str, kind: str = "succeeded", **more: Any) -> dict[str, Any]:
    """A CloudEvent's headers as a worker might write them, `more` added."""
    return {
        "ce-specversion": "1.0",
        "ce-id": str(uuid.uuid4()),
        "ce-source": "/x",
        "ce-type": f"io.conveyor.task.{kind}",
        "ce-subject": task_id,
        **more,
    }


@pytest.mark.timeout(90)
def test_poison_of_every_shape_ends_its_task_and_holds_back_nothing(
    replicas: list[GatewayProcess], svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by a sweep: a progress of 400 digits (OverflowError), a NUL in a header's name
    (jsonb refused the poison row itself) and an `x-death` that is a number (TypeError) were
    never set aside: each was handed back in a tight loop, with every event batched beside
    it; a terminal event sent as text/plain was set aside but its task not ended. Each ends
    its task, or is set aside saying why, and the events behind it are applied. (A `ce-time`
    of year 1 at +14:00, 1 BC in UTC, which made the poll answer 500: the clock test.)"""
    gateway = replicas[0]
    out, dlq = topology.out_queue(svc.queue_name), topology.dead_letter_queue(svc.queue_name)
    progressed, plain, last = (_submit(gateway, svc, {}) for _ in range(3))
    json_type = "application/json"
    publish(amqp_url, out, [_event(svc, EventKind.STARTED, progressed, host="h", attempt="a")])
    _poll_until(gateway, svc, progressed, status="IN_PROGRESS")  # two replicas consume: in turn
    publish(
        amqp_url,
        out,
        [
            WireMessage(
                b'{"progress":' + b"9" * 400 + b"}",
                _ce(progressed, "progress", **{"ce-conveyorattempt": "a"}),
                json_type,
                "m1",
            ),
            WireMessage(
                b"{}", {**_ce(str(uuid.uuid4()), "bogus"), "x-bad\x00key": "v"}, json_type, "m2"
            ),
            WireMessage(b"{}", _ce(str(uuid.uuid4()), **{"ce-foo\x00": "v"}), json_type, "m3"),
            WireMessage(b'{"response":1}', _ce(plain), "text/plain", "m4"),
        ],
    )
    publish(amqp_url, dlq, [WireMessage(b"{}", {"x-death": 5}, json_type, "m6")])
    publish(amqp_url, out, [_event(svc, EventKind.SUCCEEDED, last, response={"ok": True})])

    assert _poll_until(gateway, svc, last, status="SUCCESS")["response"] == {"ok": True}
    assert _poll_until(gateway, svc, progressed, progress=100.0)["status"] == "IN_PROGRESS"
    failed = _poll_until(gateway, svc, plain, status="FAILURE")
    assert "could not be stored" in failed["errorMessage"], failed
    wait_until(lambda: len(_poison(platform, out)) >= 3, what="poison stored")
    wait_until(lambda: len(_poison(platform, dlq)) >= 1, what="the dead letter set aside")
    wait_until(lambda: _drained(amqp_url, out) and _drained(amqp_url, dlq), what="drained")
    reasons = platform.sql("SELECT reason, headers::text FROM poison_messages")
    assert not any("\x00" in reason or "\\u0000" in headers for reason, headers in reasons)


def test_a_workers_unreadable_clock_or_byte_array_headers_fail_no_task(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by a black-box test: a `succeeded` whose `ce-time` the CloudEvents binding could
    not read ("garbage", a date alone) FAILed its successful task, saying "invalid
    CloudEvent: invalid literal for int() with base 10: b'garb'"; `time` is optional, and
    the event is now dated when read. A header sent as a byte array (some AMQP clients send
    strings so) was stored as its repr, `bytearray(b'pod-1')`."""
    out = topology.out_queue(svc.queue_name)
    garbage, date_only, byte_host = (_submit(gateway, svc, {}) for _ in range(3))
    started = {"ce-conveyorstarted": "2026-11-30T14:00:00Z"}
    # Found by a later sweep: an unreadable `conveyorstarted` (epoch seconds, an HTTP date,
    # garbage, empty), or a time RFC 3339 allows but UTC cannot hold (year 1 at +14:00, 1 BC
    # in UTC), FAILed the successful task "could not be stored (time is not RFC 3339)".
    # Such a time is dropped as an unreadable `ce-time` is.
    unreadable = [
        ("ce-conveyorstarted", "1733155200"),
        ("ce-conveyorstarted", "Mon, 02 Dec 2024 16:00:00 GMT"),
        ("ce-conveyorstarted", "garbage"),
        ("ce-conveyorstarted", ""),
        ("ce-conveyorstarted", "0001-01-01T00:00:00+14:00"),
        ("ce-time", "0001-01-01T00:00:00+14:00"),
    ]
    odd = [(name, value, _submit(gateway, svc, {})) for name, value in unreadable]
    publish(
        amqp_url,
        out,
        [
            WireMessage(b'{"response":1}', _ce(garbage, **{"ce-time": "garbage"})),
            WireMessage(b'{"response":2}', _ce(date_only, **{"ce-time": "2026-11-30"})),
            WireMessage(
                b'{"response":3}',
                _ce(byte_host, **started, **{"ce-conveyorhost": bytearray(b"pod-1")}),
            ),
            *(
                WireMessage(
                    b'{"response":4}', _ce(task_id, **{name: value, "ce-conveyorhost": "h"})
                )
                for name, value, task_id in odd
            ),
        ],
    )

    for task_id, response in ((garbage, 1), (date_only, 2), (byte_host, 3)):
        assert _poll_until(gateway, svc, task_id, status="SUCCESS")["response"] == response
    assert _column(platform, byte_host, "worker_host") == "pod-1"
    for name, value, task_id in odd:
        task = _poll_until(gateway, svc, task_id, status="SUCCESS")
        assert task["response"] == 4, (name, value, task)
        assert task["startDate"] <= task["endDate"], (name, value, task)
        assert "0001" < task["endDate"] < "9999", (name, value, task)


def test_a_workers_clock_ahead_dates_nothing_in_the_future_nor_a_start_after_the_end(
    gateway: GatewayProcess, svc: Service, amqp_url: str
) -> None:
    """Found by a black-box test: a `succeeded` carrying `ce-conveyorstarted: 9999-12-31…`
    was stored with `startDate` in 9999, after its `endDate`, and the service's queue-wait
    histogram took 1.26e12 s. An event is dated no later than a minute after it is read, and
    an attempt starts no later than it ends (nor ends before it started: an end dated 1999 by
    a clock behind the one that started it)."""
    out = topology.out_queue(svc.queue_name)
    ahead, both_ahead, behind = (_submit(gateway, svc, {}) for _ in range(3))
    host = {"ce-conveyorhost": "pod-1"}
    publish(amqp_url, out, [_event(svc, EventKind.STARTED, behind, host="h", attempt="a")])
    _poll_until(gateway, svc, behind, status="IN_PROGRESS")
    publish(
        amqp_url,
        out,
        [
            WireMessage(
                b'{"response":1}',
                _ce(
                    ahead,
                    **host,
                    **{
                        "ce-time": "2026-11-30T12:00:00Z",
                        "ce-conveyorstarted": "9999-12-31T23:59:59Z",
                    },
                ),
            ),
            WireMessage(
                b'{"response":2}',
                _ce(
                    both_ahead,
                    **host,
                    **{
                        "ce-time": "9999-12-31T23:59:59Z",
                        "ce-conveyorstarted": "9999-12-31T23:59:58Z",
                    },
                ),
            ),
            # ended by a worker whose clock is behind the one that started it
            WireMessage(
                b'{"response":3}',
                _ce(behind, **{"ce-time": "1999-01-01T00:00:00Z", "ce-conveyorattempt": "a"}),
            ),
        ],
    )

    for task_id in (ahead, both_ahead, behind):
        task = _poll_until(gateway, svc, task_id, status="SUCCESS")
        assert task["startDate"] <= task["endDate"] < "9999", task
    assert _poll(gateway, svc, ahead)["endDate"] == "2026-11-30T12:00:00.000Z"


# -- dead letters ----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_crashing_workers_dead_letter_the_task(
    gateway: GatewayProcess, svc: Service, amqp_url: str
) -> None:
    """Every delivery started an attempt (`started`) and never ended it: crashes."""
    task_id = _submit(gateway, svc, {"poison": True})
    in_queue = topology.in_queue(svc.queue_name)
    wait_until(lambda: message_count(amqp_url, in_queue) == 1, what="submission on -in")
    limit = GatewaySettings().delivery_limit
    for n in range(limit + 1):
        attempt = f"crashed-{n}"
        _publish_events(
            amqp_url, svc, _event(svc, EventKind.STARTED, task_id, host=f"pod-{n}", attempt=attempt)
        )
        _poll_until(gateway, svc, task_id, status="IN_PROGRESS")

    deliveries = reject_until_dead_lettered(amqp_url, in_queue)

    assert deliveries == limit + 1  # the queue's x-delivery-limit
    data = _poll_until(gateway, svc, task_id, status="FAILURE")
    assert "dead-lettered" in data["errorMessage"]
    assert "delivery limit" in data["errorMessage"]
    assert message_count(amqp_url, in_queue) == 0


def _attempts_until_dead_lettered(amqp_url: str, queue: str) -> list[int]:
    """`reject_until_dead_lettered`, noting each delivery's X-Conveyor-Attempt as the
    dispatcher computes it (`Delivery.previous_deliveries() + 1`)."""
    import aio_pika

    from dispatcher.consumer import Delivery

    async def crash_every_time() -> list[int]:
        attempts: list[int] = []
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel()
            declared = await channel.get_queue(queue, ensure=True)
            while (message := await declared.get(no_ack=False, fail=False)) is not None:
                attempts.append(Delivery.of(message).previous_deliveries() + 1)
                await message.nack(requeue=True)
        return attempts

    return run_sync(crash_every_time())


@pytest.mark.timeout(90)
def test_returns_without_crashes_give_the_submission_back(
    gateway: GatewayProcess, svc: Service, amqp_url: str
) -> None:
    """A message returned by dropped connections before any attempt started (as when broker
    nodes go away under healthy dispatchers) is not the workers' failure: the gateway
    publishes it again, a bounded number of times, and only then fails the task. Each copy
    counts the deliveries of the ones before: the attempt number never repeats."""
    task_id = _submit(gateway, svc, {"n": 1})
    in_queue = topology.in_queue(svc.queue_name)
    limit = GatewaySettings().delivery_limit
    attempts: list[int] = []
    for returned in range(1, MAX_RETURNS + 1):
        wait_until(lambda: message_count(amqp_url, in_queue) == 1, what="submission on -in")
        attempts += _attempts_until_dead_lettered(amqp_url, in_queue)
        assert len(attempts) == returned * (limit + 1)  # the queue's x-delivery-limit, + 1
        again = wait_until(lambda: take_all(amqp_url, in_queue), what="published again")
        assert len(again) == 1 and again[0].headers["x-conveyor-returns"] == returned
        assert "x-death" not in again[0].headers
        assert decode_submission(again[0]).task_id == task_id
        assert _poll(gateway, svc, task_id)["status"] == "PENDING"
        publish(amqp_url, in_queue, again)  # back where the gateway put it
    attempts += _attempts_until_dead_lettered(amqp_url, in_queue)
    assert attempts == list(range(1, (MAX_RETURNS + 1) * (limit + 1) + 1))
    data = _poll_until(gateway, svc, task_id, status="FAILURE")
    assert "delivery limit" in data["errorMessage"]


def _dead_lettered_by_a_dispatcher(svc: Service, task_id: str, crashes: int) -> WireMessage:
    """A submission as a dispatcher puts it on `-dlq` when its crashes, carried through
    graceful requeues, passed the delivery limit (no `x-death`: the broker did not do it)."""
    submission = encode_submission(
        Submission(task_id=task_id, service=svc.name, body={"n": 1}, delivery_limit=5)
    )
    headers = {
        **submission.headers,
        "x-conveyor-crashes": crashes,
        "x-conveyor-dead-lettered": "delivery_limit",
    }
    return WireMessage(submission.body, headers, "application/json", task_id)


@pytest.mark.timeout(60)
def test_a_dispatchers_dead_letter_of_a_crashing_task_fails_it_as_the_brokers_would(
    gateway: GatewayProcess, svc: Service, amqp_url: str
) -> None:
    """Crashes past the limit, counted through graceful requeues (the broker's count starts
    again with each copy): the dispatcher dead-letters the copy itself, and the gateway judges
    it as it judges the broker's dead letters, by the attempts the workers started."""
    task_id = _submit(gateway, svc, {"n": 1})
    in_queue = topology.in_queue(svc.queue_name)
    wait_until(lambda: message_count(amqp_url, in_queue) == 1, what="submission on -in")
    take_all(amqp_url, in_queue)  # the dispatcher took it
    limit = GatewaySettings().delivery_limit
    for n in range(limit + 1):
        started = _event(svc, EventKind.STARTED, task_id, host=f"pod-{n}", attempt=f"a-{n}")
        _publish_events(amqp_url, svc, started)
        _poll_until(gateway, svc, task_id, status="IN_PROGRESS")
    dlq = topology.dead_letter_queue(svc.queue_name)
    publish(amqp_url, dlq, [_dead_lettered_by_a_dispatcher(svc, task_id, limit + 1)])

    data = _poll_until(gateway, svc, task_id, status="FAILURE")
    assert "delivery limit" in data["errorMessage"]
    wait_until(lambda: _drained(amqp_url, dlq), what="-dlq drained")
    assert message_count(amqp_url, in_queue) == 0


@pytest.mark.timeout(60)
def test_a_dispatchers_dead_letter_without_attempts_started_is_given_back(
    gateway: GatewayProcess, svc: Service, amqp_url: str
) -> None:
    """Returns that no worker's attempt explains (broker nodes gone under healthy
    dispatchers) are not crashes, whoever dead-lettered the copy: it goes back to `-in`,
    its crash count cleared."""
    task_id = _submit(gateway, svc, {"n": 1})
    in_queue = topology.in_queue(svc.queue_name)
    wait_until(lambda: message_count(amqp_url, in_queue) == 1, what="submission on -in")
    take_all(amqp_url, in_queue)
    limit = GatewaySettings().delivery_limit
    dlq = topology.dead_letter_queue(svc.queue_name)
    publish(amqp_url, dlq, [_dead_lettered_by_a_dispatcher(svc, task_id, limit + 1)])

    again = wait_until(lambda: take_all(amqp_url, in_queue), what="given back")
    assert len(again) == 1 and decode_submission(again[0]).task_id == task_id
    assert "x-conveyor-crashes" not in again[0].headers
    assert "x-conveyor-dead-lettered" not in again[0].headers
    assert _poll(gateway, svc, task_id)["status"] == "PENDING"


def test_attempts_a_shutdown_handed_back_do_not_count_against_a_give_back(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by a review: the give-back counted every attempt started, those a dispatcher's
    SIGTERM handed back too; a task requeued by as many deploys as the delivery limit, then
    returned by broker node losses, ended FAILURE as if its function had crashed workers."""
    task_id = _submit(gateway, svc, {"n": 1})
    in_queue = topology.in_queue(svc.queue_name)
    wait_until(lambda: message_count(amqp_url, in_queue) == 1, what="submission on -in")
    take_all(amqp_url, in_queue)
    limit = GatewaySettings().delivery_limit

    def recorded(outcome: str | None) -> int:
        rows = platform.sql(
            "SELECT count(*) FROM task_attempts WHERE task_id = %(t)s"
            " AND outcome IS NOT DISTINCT FROM %(o)s",
            {"t": task_id, "o": outcome},
        )
        return int(rows[0][0])

    # Each attempt handed back by a graceful shutdown, one event applied before the next:
    # the suite's other gateways read this `-out` too, and may apply two events out of order.
    for n in range(limit):
        started = _event(svc, EventKind.STARTED, task_id, attempt=f"a{n}", host=f"pod-{n}")
        _publish_events(amqp_url, svc, started)
        wait_until(lambda: recorded(None) == 1, what=f"attempt {n} started")
        _publish_events(amqp_url, svc, _event(svc, EventKind.REQUEUED, task_id, attempt=f"a{n}"))
        wait_until(lambda n=n: recorded("requeued") == n + 1, what=f"attempt {n} handed back")
    dlq = topology.dead_letter_queue(svc.queue_name)
    publish(amqp_url, dlq, [_dead_lettered_by_a_dispatcher(svc, task_id, limit + 1)])

    again = wait_until(lambda: take_all(amqp_url, in_queue), what="given back")
    assert len(again) == 1 and decode_submission(again[0]).task_id == task_id
    assert _poll(gateway, svc, task_id)["status"] == "PENDING"


def test_a_hand_back_read_after_the_next_attempt_began_is_still_a_hand_back(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by a flaky test: gateway replicas read `-out` side by side, so a dispatcher's
    `requeued` may be applied after the `started` of the attempt that followed it, which had
    closed the handed-back attempt as `interrupted`; the `requeued` then changed nothing, and
    the give-back counted that hand-back as a crash. The attempt is a hand-back either way."""
    task_id = _submit(gateway, svc, {"n": 1})
    first = _ms(datetime.now(UTC) - timedelta(seconds=20))
    started_b = partial(_event, svc, EventKind.STARTED, task_id, host="pod-b", attempt="b")
    _publish_one_by_one(  # in this order on `-out` (one publish each: a batch's may vary)
        amqp_url,
        svc,
        _event(svc, EventKind.STARTED, task_id, host="pod-a", attempt="a", time=first),
        started_b(time=first + timedelta(seconds=5)),
        _event(svc, EventKind.REQUEUED, task_id, attempt="a", time=first + timedelta(seconds=1)),
    )
    history = partial(_history, platform, task_id, "outcome, end_date IS NOT NULL")
    expected = [("a", "requeued", True), ("b", None, False)]
    wait_until(lambda: history() == expected, what="a handed back, b running")
    assert _poll(gateway, svc, task_id)["status"] == "IN_PROGRESS"
    assert _column(platform, task_id, "worker_host") == "pod-b"

    # Its own `started` read again after it (a duplicate, another replica's): the attempt is
    # over, and starts nothing; the task waits in the queue, as it does.
    _publish_events(
        amqp_url,
        svc,
        _event(svc, EventKind.REQUEUED, task_id, attempt="b", time=first + timedelta(seconds=9)),
    )
    _poll_until(gateway, svc, task_id, status="PENDING")
    marker = _submit(gateway, svc, {"n": 2})
    for event in (
        started_b(time=first + timedelta(seconds=5)),
        _event(svc, EventKind.SUCCEEDED, marker, attempt="m", host="pod-m", started=first),
    ):
        _publish_events(amqp_url, svc, event)
    _poll_until(gateway, svc, marker, status="SUCCESS")  # so the `started` before it too
    assert _poll(gateway, svc, task_id)["status"] == "PENDING"
    assert _column(platform, task_id, "attempts") == 2
    assert history() == [("a", "requeued", True), ("b", "requeued", True)]

    # A `requeued` of an attempt that was never this task's touches nothing.
    _publish_events(amqp_url, svc, _event(svc, EventKind.REQUEUED, task_id, attempt="zz"))
    wait_until(lambda: _drained(amqp_url, topology.out_queue(svc.queue_name)), what="drained")
    assert history() == [("a", "requeued", True), ("b", "requeued", True)]


@pytest.mark.timeout(60)
def test_dead_lettered_submission_with_x_death_fails_its_task(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    task_id = _submit(gateway, svc, {"n": 7})
    dlq = topology.dead_letter_queue(svc.queue_name)
    submission = encode_submission(Submission(task_id=task_id, service=svc.name, body={"n": 7}))
    x_death = [
        {
            "count": 1,
            "reason": "rejected",
            "queue": topology.in_queue(svc.queue_name),
            "exchange": "",
            "routing-keys": [topology.in_queue(svc.queue_name)],
        }
    ]
    dead = WireMessage(
        submission.body, {**submission.headers, "x-death": x_death}, "application/json", task_id
    )

    publish(amqp_url, dlq, [dead, raw_json(b"\x00garbage")])

    data = _poll_until(gateway, svc, task_id, status="FAILURE")
    assert "dead-lettered" in data["errorMessage"] and "rejected" in data["errorMessage"]
    wait_until(lambda: _poison(platform, dlq), what="garbage set aside")
    assert _poison(platform, dlq)[0][1] == b"\x00garbage"
    wait_until(lambda: _drained(amqp_url, dlq), what="-dlq drained")


@pytest.mark.timeout(60)
def test_a_submission_expired_in_the_queue_fails_its_task_as_the_reaper_says(
    gateway: GatewayProcess, svc: Service, amqp_url: str
) -> None:
    """Past its time to live a task ends with one message, whether the reaper or its
    message's dead letter comes first: the dead letter said `dead-lettered`, as for a crash."""
    task_id = _submit(gateway, svc, {"n": 8})
    submission = encode_submission(Submission(task_id=task_id, service=svc.name, body={"n": 8}))
    x_death = [{"count": 1, "reason": "expired", "queue": topology.in_queue(svc.queue_name)}]
    dead = WireMessage(
        submission.body, {**submission.headers, "x-death": x_death}, "application/json", task_id
    )
    publish(amqp_url, topology.dead_letter_queue(svc.queue_name), [dead])
    data = _poll_until(gateway, svc, task_id, status="FAILURE")
    assert data["errorMessage"] == (
        "The task expired: it stayed PENDING longer than its time to live."
    )


# -- every task ends: what the database refuses, broken topologies, silence ----------


def test_a_nul_in_a_worker_s_response_is_stored_as_u_fffd(
    gateway: GatewayProcess, svc: Service, legacy_svc: Service, platform: Platform, amqp_url: str
) -> None:
    """PostgreSQL cannot store NUL in jsonb, and a worker that is not a dispatcher (which
    cleans a function's answer itself) may send one: it used to fail the task for a
    character. Keys and strings alike, and a literal backslash-u0000 stays as it is."""
    ce_task = _submit(gateway, svc, {"n": 1})
    legacy_task = _submit(gateway, legacy_svc, {"n": 2})
    response = {"a\x00b": ["x\x00", {"k": "\x00"}], "literal": "\\u0000", "n": 10**30}
    _publish_events(
        amqp_url,
        svc,
        _event(svc, EventKind.STARTED, ce_task, host="h", attempt="a1"),
        _event(svc, EventKind.SUCCEEDED, ce_task, response=response, attempt="a1"),
    )
    _legacy(
        amqp_url,
        legacy_svc,
        {"taskId": legacy_task, "data": {"messageType": "success", "response": "x\x00y"}},
    )
    stored = _poll_until(gateway, svc, ce_task, status="SUCCESS")["response"]
    assert stored == {
        "a\ufffdb": ["x\ufffd", {"k": "\ufffd"}],
        "literal": "\\u0000",
        "n": 10**30,
    }
    assert _poll_until(gateway, legacy_svc, legacy_task, status="SUCCESS")["response"] == "x\ufffdy"
    queues = [topology.out_queue(svc.queue_name), topology.out_queue(legacy_svc.queue_name)]
    assert _poison(platform, queues[0]) == _poison(platform, queues[1]) == []


def test_a_lone_surrogate_in_a_worker_s_response_is_stored_as_u_fffd(
    gateway: GatewayProcess, svc: Service, legacy_svc: Service, platform: Platform, amqp_url: str
) -> None:
    """JSON may escape half a surrogate pair, which jsonb refuses. Found by a sweep: the task
    then ended FAILURE with PostgreSQL's error, which quoted the answer (in the task and in a
    warning). Half a pair now becomes U+FFFD, like a NUL, in keys and strings; a whole pair
    is the character it spells."""
    ce_task = _submit(gateway, svc, {"n": 1})
    legacy_task = _submit(gateway, legacy_svc, {"n": 2})
    failed = _submit(gateway, legacy_svc, {"n": 3})
    ce_body = b'{"response": {"a\\udc00": ["x\\ud800y", "\\ud83d\\ude00"]}}'
    _publish_events(amqp_url, svc, _event(svc, EventKind.STARTED, ce_task, host="h", attempt="a"))
    succeeded = _event(svc, EventKind.SUCCEEDED, ce_task, response=None, attempt="a")
    publish(
        amqp_url,
        topology.out_queue(svc.queue_name),
        [WireMessage(ce_body, succeeded.headers, "application/json")],
    )
    half = f'{{"taskId": "{legacy_task}", "data": {{"messageType": "success", "response": "\\ud800"}}}}'
    failure = f'{{"taskId": "{failed}", "data": {{"messageType": "failure", "errorMessage": "b\\udfffd"}}}}'
    publish(
        amqp_url,
        topology.out_queue(legacy_svc.queue_name),
        [raw_json(half.encode()), raw_json(failure.encode())],
    )
    stored = _poll_until(gateway, svc, ce_task, status="SUCCESS")["response"]
    assert stored == {"a\ufffd": ["x\ufffdy", "\U0001f600"]}
    assert _poll_until(gateway, legacy_svc, legacy_task, status="SUCCESS")["response"] == "\ufffd"
    assert _poll_until(gateway, legacy_svc, failed, status="FAILURE")["errorMessage"] == "b\ufffdd"
    for queue in (topology.out_queue(svc.queue_name), topology.out_queue(legacy_svc.queue_name)):
        assert _poison(platform, queue) == []


def test_what_the_database_refuses_is_set_aside_without_quoting_it(database_url: str) -> None:
    """PostgreSQL's DETAIL and CONTEXT may quote the data it refused: the reason kept (and
    logged, and told in the task's errorMessage) is its primary message alone."""
    with psycopg.connect(libpq(database_url)) as conn, pytest.raises(psycopg.Error) as refused:
        conn.execute("SELECT %s::jsonb", ('{"secret-answer": "\\ud800"}',))
    assert "secret-answer" in str(refused.value)  # PostgreSQL does quote it
    plan = results._refused(results.Plan("succeeded", None), refused.value)
    assert plan.aside is not None and plan.aside.startswith("database refused it: ")
    assert "secret-answer" not in plan.aside and "\n" not in plan.aside


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_a_terminal_event_too_deep_to_read_fails_its_task(
    gateway: GatewayProcess, svc: Service, legacy_svc: Service, platform: Platform, amqp_url: str
) -> None:
    """A hand-made `succeeded` whose response nests deeper than any parser here reads is
    poison, yet its task and kind can still be read (the CloudEvent's headers, the legacy
    message's outer fields): the task ends FAILURE saying why, not IN_PROGRESS until the
    watchdog. So does a CloudEvent's whose data is not JSON at all. A deep event that ends
    nothing is only set aside."""
    ce_task = _submit(gateway, svc, {"n": 1})
    legacy_task = _submit(gateway, legacy_svc, {"n": 2})
    garbled = _submit(gateway, svc, {"n": 3})
    out = topology.out_queue(svc.queue_name)
    legacy_out = topology.out_queue(legacy_svc.queue_name)
    _publish_events(amqp_url, svc, _event(svc, EventKind.STARTED, ce_task, host="h"))
    _legacy(amqp_url, legacy_svc, {"taskId": legacy_task, "data": {"messageType": "started"}})
    _poll_until(gateway, svc, ce_task, status="IN_PROGRESS")
    _poll_until(gateway, legacy_svc, legacy_task, status="IN_PROGRESS")

    succeeded = _event(svc, EventKind.SUCCEEDED, ce_task, response=None)
    deep = f'{{"response": {_nested(5000)}}}'.encode()
    legacy = (
        f'{{"taskId": "{legacy_task}", "data": {{"messageType": "success",'
        f' "response": {{"brackets in a string: ]]}}": {_nested(5000)}}}}}}}'
    ).encode()
    progress = _event(svc, EventKind.PROGRESS, ce_task, progress=50.0)
    publish(
        amqp_url,
        out,
        [
            WireMessage(deep, progress.headers, "application/json"),
            WireMessage(deep, succeeded.headers, "application/json"),
            WireMessage(b"{not JSON", _event(svc, EventKind.SUCCEEDED, garbled).headers),
        ],
    )
    publish(amqp_url, legacy_out, [raw_json(legacy)])

    for service, task_id in ((svc, ce_task), (legacy_svc, legacy_task), (svc, garbled)):
        data = _poll_until(gateway, service, task_id, status="FAILURE")
        assert "result could not be stored" in data["errorMessage"], data
        assert "not JSON" in data["errorMessage"], data
    wait_until(lambda: len(_poison(platform, out)) == 3, what="the events set aside")
    assert len(_poison(platform, legacy_out)) == 1
    assert _poll(gateway, svc, ce_task)["progress"] == 0.0


@pytest.mark.timeout(90)
def test_a_terminal_event_of_millions_of_items_fails_its_task_unread(
    gateway: GatewayProcess, svc: Service, legacy_svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by a black-box test: a legacy or third-party worker's `success` holding millions
    of small values (3.6 MB of `[{},…]`, 1.2 million dicts once read) was read whole by the
    gateway, ~50 MB per MiB, and stored: 8 MiB took ~400 MB, against the gateway's 512Mi
    limit, and an event that kills its reader is read again by the next. Past
    `storable.MAX_ITEMS`, as a dispatcher fails such an answer, the task fails unread."""
    crowded = b"[" + b"{}," * 1_200_000 + b"{}]"
    ce_task = _submit(gateway, svc, {"n": 1})
    legacy_task = _submit(gateway, legacy_svc, {"n": 2})
    succeeded = _event(svc, EventKind.SUCCEEDED, ce_task, response=None)
    body = b'{"response": ' + crowded + b"}"
    _publish_events(amqp_url, svc, WireMessage(body, succeeded.headers, "application/json"))
    legacy = f'{{"taskId": "{legacy_task}", "data": {{"messageType": "success", "response": '
    publish(
        amqp_url,
        topology.out_queue(legacy_svc.queue_name),
        [raw_json(legacy.encode() + crowded + b"}}")],
    )
    for service, task_id in ((svc, ce_task), (legacy_svc, legacy_task)):
        data = _poll_until(gateway, service, task_id, timeout=30, status="FAILURE")
        assert "result could not be stored" in data["errorMessage"], data
        assert "more than 1000000 JSON items" in data["errorMessage"], data


def test_an_error_message_with_nul_is_stored_readably(
    gateway: GatewayProcess, legacy_svc: Service, amqp_url: str
) -> None:
    task_id = _submit(gateway, legacy_svc, {"n": 1})
    failure = {"messageType": "failure", "errorMessage": "bad\x00input"}
    _legacy(amqp_url, legacy_svc, {"taskId": task_id, "data": failure})
    data = _poll_until(gateway, legacy_svc, task_id, status="FAILURE")
    assert data["errorMessage"] == "bad\ufffdinput"


def test_a_duplicated_legacy_started_does_not_reset_the_task(
    gateway: GatewayProcess, legacy_svc: Service, platform: Platform, amqp_url: str
) -> None:
    task_id = _submit(gateway, legacy_svc, {"n": 1})
    started = {"taskId": task_id, "data": {"messageType": "started", "hostName": "worker-1"}}
    out = topology.out_queue(legacy_svc.queue_name)
    publish_without_id(amqp_url, out, json.dumps(started).encode())
    first = _poll_until(gateway, legacy_svc, task_id, status="IN_PROGRESS")
    _legacy(
        amqp_url,
        legacy_svc,
        {"taskId": task_id, "data": {"messageType": "progress", "progress": 40}},
    )
    _poll_until(gateway, legacy_svc, task_id, progress=40.0)
    publish_without_id(amqp_url, out, json.dumps(started).encode())  # a retrying worker's copy
    wait_until(lambda: _drained(amqp_url, topology.out_queue(legacy_svc.queue_name)), 10)
    time.sleep(0.5)
    again = _poll(gateway, legacy_svc, task_id)
    assert (again["progress"], again["startDate"]) == (40.0, first["startDate"])
    # A redelivery to another host is a new attempt, as the seed requires.
    elsewhere = {"taskId": task_id, "data": {"messageType": "started", "hostName": "worker-2"}}
    _legacy(amqp_url, legacy_svc, elsewhere)
    _poll_until(gateway, legacy_svc, task_id, progress=0.0)
    assert _column(platform, task_id, "worker_host") == "worker-2"


@pytest.mark.timeout(60)
def test_one_services_broken_topology_stops_no_other(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    """A queue declared with another delivery limit (an earlier gateway's settings): the
    refresh goes on with every other service, and this one's results are still consumed."""
    import asyncio

    import aio_pika

    broken_name = f"svc-{uuid.uuid4().hex[:10]}"

    async def declare_with_another_limit() -> None:
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel()
            await topology.declare_service(channel, broken_name, MessageFormat.CLOUDEVENTS, 99)

    asyncio.run(declare_with_another_limit())
    broken = platform.service(name=broken_name)
    others = [_service(platform, amqp_url) for _ in range(2)]
    try:
        tasks = {s.name: _submit(gateway, s, {"n": 1}) for s in (broken, *others)}
        for service in (broken, *others):
            _publish_events(
                amqp_url, service, _event(service, EventKind.SUCCEEDED, tasks[service.name])
            )
        for service in (broken, *others):
            _poll_until(gateway, service, tasks[service.name], timeout=20, status="SUCCESS")
        ready = httpx.get(f"{gateway.url}/readyz").json()["data"]
        assert broken_name in ready["services"], ready
        assert "PRECONDITION_FAILED" in ready["services"][broken_name]
        metrics = httpx.get(f"{gateway.url}/metrics").text
        assert f'conveyor_gateway_broken_topology_total{{service="{broken_name}"}}' in metrics
    finally:
        for service in (broken, *others):
            remove_service(platform, amqp_url, service)


@pytest.mark.timeout(60)
def test_the_watchdog_fails_a_task_whose_worker_went_silent(
    platform: Platform, database_url: str, amqp_url: str, procs: Processes
) -> None:
    env = gateway_env(
        database_url, amqp_url, CONVEYOR_SILENCE_MARGIN="1", CONVEYOR_REAPER_INTERVAL="0.3"
    )
    watchdog = GatewayProcess(procs, env, "gateway-watchdog")
    service = _service(platform, amqp_url, taskTimeout=1, maxAttempts=1)
    try:
        task_id = _submit(watchdog, service, {"n": 1})
        _publish_events(amqp_url, service, _event(service, EventKind.STARTED, task_id, host="h"))
        _poll_until(watchdog, service, task_id, status="IN_PROGRESS")
        data = _poll_until(watchdog, service, task_id, timeout=20, status="FAILURE")
        assert data["errorMessage"].startswith("No result from the worker")
        outcome = platform.sql(
            "SELECT outcome, end_date IS NOT NULL FROM task_attempts WHERE task_id = %(t)s",
            {"t": task_id},
        )
        assert outcome == [("abandoned", True)]
        assert "conveyor_gateway_abandoned_total 1.0" in httpx.get(f"{watchdog.url}/metrics").text
    finally:
        remove_service(platform, amqp_url, service)


@pytest.mark.timeout(60)
def test_a_hand_back_read_before_its_own_started_leaves_the_task_pending(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Replicas read `-out` side by side, so a `requeued` may be applied before the `started`
    of its own attempt. It changed nothing then (the task was PENDING), and the `started` set
    the task IN_PROGRESS while its message waited in `-in`: with no dispatcher left to take it
    (scaled to zero, which is when hand-backs happen) the watchdog failed it there."""
    task_id = _submit(gateway, svc, {"n": 1})
    expires = _column(platform, task_id, "expires_at")
    first = _ms(datetime.now(UTC) - timedelta(seconds=20))
    _publish_one_by_one(  # in this order on `-out`
        amqp_url,
        svc,
        _event(svc, EventKind.REQUEUED, task_id, attempt="a", time=first + timedelta(seconds=1)),
        _event(svc, EventKind.STARTED, task_id, host="pod-a", attempt="a", time=first),
    )
    history = partial(_history, platform, task_id, "worker_host, outcome, end_date > start_date")
    wait_until(lambda: history() == [("a", "pod-a", "requeued", True)], what="a handed back")
    pending = _poll(gateway, svc, task_id)
    assert pending["status"] == "PENDING", pending
    assert "workerHost" not in pending and "startDate" not in pending
    assert _column(platform, task_id, "attempts") == 1
    assert _column(platform, task_id, "expires_at") > expires  # its copy's time to live

    # The same `started` again (a duplicate) records nothing more; the next attempt runs.
    for event in (
        _event(svc, EventKind.STARTED, task_id, host="pod-a", attempt="a", time=first),
        _event(svc, EventKind.STARTED, task_id, host="pod-b", attempt="b"),
        _event(svc, EventKind.SUCCEEDED, task_id, attempt="b", response={"ok": 1}),
    ):
        _publish_events(amqp_url, svc, event)
    _poll_until(gateway, svc, task_id, status="SUCCESS")
    assert _column(platform, task_id, "attempts") == 2
    assert [row[:3] for row in history()] == [
        ("a", "pod-a", "requeued"),
        ("b", "pod-b", "success"),
    ]


@pytest.mark.timeout(60)
def test_a_hand_back_committed_while_its_started_waits_for_the_row_is_still_recorded(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by CI: two replicas applying a task's `requeued` and its own `started` at the
    same moment. The `started` waited for the row the `requeued` held, then judged the row by
    what it had read before: the hand-back it now carried was not seen, and the attempt was
    recorded nowhere. The results' statements now lock their tasks' rows first, and read
    them after."""
    import psycopg

    from gateway.database_url import libpq

    task_id = _submit(gateway, svc, {"n": 1})
    first = _ms(datetime.now(UTC) - timedelta(seconds=20))
    with psycopg.connect(libpq(platform.database_url)) as other:  # another replica's batch
        other.execute(
            "UPDATE tasks SET handed_back_attempt = 'a', handed_back_at = %(at)s"
            " WHERE task_id = %(t)s",
            {"t": task_id, "at": first + timedelta(seconds=1)},
        )
        _publish_events(
            amqp_url,
            svc,
            _event(svc, EventKind.STARTED, task_id, host="pod-a", attempt="a", time=first),
        )
        time.sleep(0.8)  # the gateway's `started` now waits for the row (for up to 2 s)
        other.commit()
    history = partial(_history, platform, task_id, "worker_host, outcome, end_date > start_date")
    wait_until(lambda: history() == [("a", "pod-a", "requeued", True)], what="a handed back")
    assert _poll(gateway, svc, task_id)["status"] == "PENDING"


def _handed_back_then_next(svc: Service, task_id: str, first: datetime) -> list[WireMessage]:
    """Attempt a (started at `first`) handed back a second later, and attempt b started on
    another pod a second after that: what a SIGTERM's requeue and the next delivery send."""
    return [
        _event(svc, EventKind.REQUEUED, task_id, attempt="a", time=first + timedelta(seconds=1)),
        _event(
            svc,
            EventKind.STARTED,
            task_id,
            host="pod-b",
            attempt="b",
            time=first + timedelta(seconds=2),
        ),
    ]


def test_a_hand_back_read_before_its_started_and_the_next_attempts_is_still_recorded(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Three events out of order: the `requeued` of attempt a, then the `started` of the next
    attempt b (its republished copy), then a's own `started`. b's start took the task over, and
    a's `started` found it neither PENDING nor older: the handed-back attempt was missing from
    the history and the count, the task right otherwise."""
    task_id = _submit(gateway, svc, {"n": 1})
    first = _ms(datetime.now(UTC) - timedelta(seconds=20))
    _publish_one_by_one(  # in this order on `-out`
        amqp_url,
        svc,
        *_handed_back_then_next(svc, task_id, first),
        _event(svc, EventKind.STARTED, task_id, host="pod-a", attempt="a", time=first),
    )
    history = partial(_history, platform, task_id, "worker_host, outcome")
    wait_until(lambda: len(history()) == 2, what="both attempts recorded")
    assert history() == [("a", "pod-a", "requeued"), ("b", "pod-b", None)]
    running = _poll(gateway, svc, task_id)
    assert running["status"] == "IN_PROGRESS", running
    assert _column(platform, task_id, "worker_host") == "pod-b"
    assert _column(platform, task_id, "attempts") == 2

    _publish_events(amqp_url, svc, _event(svc, EventKind.SUCCEEDED, task_id, attempt="b"))
    _poll_until(gateway, svc, task_id, status="SUCCESS")
    assert [row[:3] for row in history()] == [("a", "pod-a", "requeued"), ("b", "pod-b", "success")]
    assert _column(platform, task_id, "attempts") == 2


def test_a_hand_back_read_before_its_started_and_the_next_attempts_end_is_still_recorded(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Four events out of order: a's `requeued`, then the next attempt b's `started` and
    `succeeded`, then a's own `started`. The task had ended with b: a's `started` found it
    neither PENDING nor IN_PROGRESS, and the handed-back attempt was missing from the history
    and the count. The task's end is untouched."""
    task_id = _submit(gateway, svc, {"n": 1})
    first = _ms(datetime.now(UTC) - timedelta(seconds=20))
    events = [
        *_handed_back_then_next(svc, task_id, first),
        _event(svc, EventKind.SUCCEEDED, task_id, attempt="b", time=first + timedelta(seconds=3)),
    ]
    _publish_one_by_one(amqp_url, svc, *events)  # in this order on `-out`
    ended = _poll_until(gateway, svc, task_id, status="SUCCESS")
    history = partial(_history, platform, task_id, "worker_host, outcome")
    assert [row[:3] for row in history()] == [("b", "pod-b", "success")]

    late = _event(svc, EventKind.STARTED, task_id, host="pod-a", attempt="a", time=first)
    _publish_one_by_one(amqp_url, svc, late)
    wait_until(lambda: len(history()) == 2, what="both attempts recorded")
    assert [row[:3] for row in history()] == [("a", "pod-a", "requeued"), ("b", "pod-b", "success")]
    assert _column(platform, task_id, "attempts") == 2
    assert _poll(gateway, svc, task_id) == ended
    _publish_one_by_one(amqp_url, svc, late)  # again (a duplicate): recorded once
    time.sleep(1.0)
    assert len(history()) == 2 and _column(platform, task_id, "attempts") == 2


@pytest.mark.timeout(60)
def test_a_hand_back_whose_started_never_comes_renews_the_tasks_time_to_live(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """A dispatcher's `started` is best effort: one the broker refused, followed by the
    attempt's `requeued`, left the task PENDING with the expiry it had, while its republished
    copy lives a time to live of its own from the hand-back: the reaper would fail a task its
    copy still carries. The hand-back renews it; no attempt is recorded without a start."""
    task_id = _submit(gateway, svc, {"n": 1})
    expires = _column(platform, task_id, "expires_at")
    _publish_one_by_one(amqp_url, svc, _event(svc, EventKind.REQUEUED, task_id, attempt="a"))
    wait_until(lambda: _column(platform, task_id, "expires_at") > expires, what="renewed")
    assert _poll(gateway, svc, task_id)["status"] == "PENDING"
    assert _history(platform, task_id, "outcome") == []
    assert _column(platform, task_id, "attempts") == 0


def _in_any_order(
    gateway: GatewayProcess,
    svc: Service,
    platform: Platform,
    amqp_url: str,
    life: list[tuple[EventKind, str, str | None]],
    expected: tuple[str, int, list[tuple[str, str, str | None, bool]]],
) -> dict[tuple[int, ...], Any]:
    """`life` (kind, attempt, host), a second apart from 20 s ago, read in every order, one
    task per order; the orders that did not end as `expected` (status, attempts, history)."""
    first = _ms(datetime.now(UTC) - timedelta(seconds=20))
    orders = list(permutations(range(len(life))))
    task_ids = _submit_all(gateway, svc, [{"n": i} for i in range(len(orders))])
    messages = []
    for task_id, order in zip(task_ids, orders, strict=True):
        events = [
            _event(
                svc,
                kind,
                task_id,
                attempt=attempt,
                time=first + timedelta(seconds=second),
                **({"host": host} if kind is EventKind.STARTED else {}),
                **({"response": {"ok": 1}} if kind is EventKind.SUCCEEDED else {}),
            )
            for second, (kind, attempt, host) in enumerate(life)
        ]
        messages += [events[i] for i in order]
    _publish_one_by_one(amqp_url, svc, *messages)

    def wrong() -> dict[tuple[int, ...], Any]:
        polled = _poll_all(gateway, svc, task_ids)
        found = {}
        for task_id, order in zip(task_ids, orders, strict=True):
            history = _history(platform, task_id, "worker_host, outcome, end_date >= start_date")
            got = (
                polled[task_id]["status"],
                _column(platform, task_id, "attempts"),
                [row[:4] for row in history],
            )
            if got != expected:
                found[order] = got
        return found

    with contextlib.suppress(AssertionError):  # the last batches read are applied
        wait_until(lambda: not wrong(), what="every order recorded")
    return wrong()


STARTED, REQUEUED, SUCCEEDED = EventKind.STARTED, EventKind.REQUEUED, EventKind.SUCCEEDED


def test_a_hand_back_and_the_next_attempt_read_in_any_order_record_both_attempts(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by CI (`..._next_attempts_is_still_recorded` failed once under load): replicas
    read `-out` side by side, and a batch held back for a locked row is read again after the
    ones behind it, so a task's events are applied in any order. Read after the next attempt's
    `started` or after the task's end, an attempt's `started` and `requeued` were ignored: 18
    of the 24 orders of four events lost an attempt from the history and the count (the task's
    end was right in all). Every order now records both attempts as read in order."""
    life = [
        (STARTED, "a", "pod-a"),
        (REQUEUED, "a", None),
        (STARTED, "b", "pod-b"),
        (SUCCEEDED, "b", None),
    ]
    history = [("a", "pod-a", "requeued", True), ("b", "pod-b", "success", True)]
    assert _in_any_order(gateway, svc, platform, amqp_url, life, ("SUCCESS", 2, history)) == {}
    # the host of the attempt that ended the task, also when its `started` came last
    assert platform.sql(
        "SELECT count(*) FROM tasks WHERE service = %(s)s AND worker_host IS DISTINCT FROM 'pod-b'",
        {"s": svc.name},
    ) == [(0,)]


def test_an_older_attempts_started_read_after_a_later_hand_back_leaves_the_task_pending(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by a sweep: attempt a crashed, attempt b was handed back (SIGTERM), so the task
    waits in `-in`. Read `b started, b requeued, a started` (or `b requeued, a started, b
    started`), the stale `started` of a made the task IN_PROGRESS on a dead attempt, and the
    watchdog failed it later while its message waited in the queue (4 of 4). Every order now
    leaves it PENDING, a interrupted and b handed back."""
    life = [(STARTED, "a", "pod-a"), (STARTED, "b", "pod-b"), (REQUEUED, "b", None)]
    history = [("a", "pod-a", "interrupted", True), ("b", "pod-b", "requeued", True)]
    assert _in_any_order(gateway, svc, platform, amqp_url, life, ("PENDING", 2, history)) == {}


def test_two_hand_backs_read_before_their_started_in_any_order_record_both(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by a sweep: a task kept one hand-back read before its `started`. Attempts a and b
    both handed back, read `b requeued, a requeued, a started, b started`, left only a's: b's
    `started` then set the task IN_PROGRESS while its message waited in `-in` (the watchdog
    failed it), and other orders recorded a `interrupted`. 4 of the 24 orders were wrong."""
    life = [
        (STARTED, "a", "pod-a"),
        (REQUEUED, "a", None),
        (STARTED, "b", "pod-b"),
        (REQUEUED, "b", None),
    ]
    history = [("a", "pod-a", "requeued", True), ("b", "pod-b", "requeued", True)]
    assert _in_any_order(gateway, svc, platform, amqp_url, life, ("PENDING", 2, history)) == {}


def test_a_legacy_end_read_before_its_started_is_that_attempts_end(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by a sweep: a worker sending no attempt ids, its `succeeded` read before its
    `started`: the task ended with no attempt known, and the late `started` was recorded as an
    attempt `interrupted`. It is the attempt the task ended with."""
    task_id = _submit(gateway, svc, {"n": 1})
    first = _ms(datetime.now(UTC) - timedelta(seconds=20))
    _publish_one_by_one(
        amqp_url,
        svc,
        _event(
            svc, EventKind.SUCCEEDED, task_id, response={"ok": 1}, time=first + timedelta(seconds=1)
        ),
        _event(svc, EventKind.STARTED, task_id, host="pod-a", time=first),
    )
    history = partial(_history, platform, task_id, "worker_host, outcome, end_date >= start_date")
    wait_until(lambda: history(), what="the attempt recorded")
    assert [row[1:] for row in history()] == [("pod-a", "success", True)]
    assert _column(platform, task_id, "attempts") == 1
    assert _column(platform, task_id, "worker_host") == "pod-a"
    assert _poll(gateway, svc, task_id)["status"] == "SUCCESS"


def test_a_failure_keeps_its_own_attempts_progress_not_anothers(
    gateway: GatewayProcess, svc: Service, platform: Platform, amqp_url: str
) -> None:
    """Found by a sweep: attempt a reported 30 % and crashed; attempt b, a short call (its
    `failed` carries its start) or one whose `started` was not read yet, failed: the task
    ended FAILURE at a's 30 %, even read in order. A FAILURE keeps its own attempt's progress;
    one that failed on the attempt that reported keeps it."""
    first = _ms(datetime.now(UTC) - timedelta(seconds=20))
    at = [first + timedelta(seconds=s) for s in range(4)]
    cases = {"stand-in": {"started": at[2], "host": "pod-b"}, "unseen start": {}, "own": None}
    task_ids = _submit_all(gateway, svc, [{"n": n} for n in range(len(cases))])
    for task_id, extra in zip(task_ids, cases.values(), strict=True):
        _publish_one_by_one(
            amqp_url,
            svc,
            _event(svc, EventKind.STARTED, task_id, host="pod-a", attempt="a", time=at[0]),
            _event(svc, EventKind.PROGRESS, task_id, progress=30.0, attempt="a", time=at[1]),
            _event(
                svc,
                EventKind.FAILED,
                task_id,
                error_message="boom",
                time=at[3],
                attempt="a" if extra is None else "b",
                **(extra or {}),
            ),
        )
    for task_id in task_ids:  # read off `-out`, perhaps not applied yet
        _poll_until(gateway, svc, task_id, status="FAILURE")
    ended = _poll_all(gateway, svc, task_ids)
    assert [(ended[t]["status"], ended[t]["progress"]) for t in task_ids] == [
        ("FAILURE", 0.0),
        ("FAILURE", 0.0),
        ("FAILURE", 30.0),
    ]
