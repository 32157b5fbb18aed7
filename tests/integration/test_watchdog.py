"""The watchdog against a real gateway process and PostgreSQL: an IN_PROGRESS task whose worker
fell silent fails, but not a task still running under the limit its message gave it, nor a task
a shutdown handed back to the queue (found by a black-box test of the running platform)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest

from conveyor import topology
from conveyor.events import EventKind, TaskEvent, encode_event
from gateway.database_url import libpq
from tests.support.amqp import publish, queues_of, remove_service, wait_for_queues, wait_until
from tests.support.gateway import GatewayProcess, Platform, Service, gateway_env
from tests.support.processes import Processes
from tests.support.tcpproxy import TcpProxy

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def watchdog(procs: Processes, database_url: str, amqp_url: str) -> GatewayProcess:
    """A gateway whose watchdog looks every 0.3 s, with a margin of 1 s."""
    env = gateway_env(
        database_url, amqp_url, CONVEYOR_SILENCE_MARGIN="1", CONVEYOR_REAPER_INTERVAL="0.3"
    )
    return GatewayProcess(procs, env, "gateway-watchdog")


@pytest.fixture
def make_service(platform: Platform, amqp_url: str) -> Iterator[Any]:
    made: list[Service] = []

    def make(**options: Any) -> Service:
        service = platform.service(**options)
        wait_for_queues(amqp_url, queues_of(service.queue_name))
        made.append(service)
        return service

    yield make
    for service in made:
        remove_service(platform, amqp_url, service)


def _submit(gateway: GatewayProcess, service: Service) -> str:
    with gateway.http(service.clients[0]) as http:
        answer = http.post(gateway.tasks_url(service.name), json={"body": {"n": 1}})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["data"]["taskId"])


def _poll(gateway: GatewayProcess, service: Service, task_id: str) -> dict[str, Any]:
    with gateway.http(service.clients[0]) as http:
        answer = http.get(f"{gateway.tasks_url(service.name)}/{task_id}")
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["data"])


def _until(gateway: GatewayProcess, service: Service, task_id: str, status: str) -> dict:
    def reached() -> dict[str, Any] | None:
        data = _poll(gateway, service, task_id)
        return data if data["status"] == status else None

    return wait_until(reached, 20, what=f"task {task_id} {status}")


def _send(amqp_url: str, service: Service, kind: EventKind, task_id: str, **fields: Any) -> None:
    event = encode_event(TaskEvent(kind=kind, task_id=task_id, **fields), service.name)
    publish(amqp_url, topology.out_queue(service.queue_name), [event])


def _attempts(platform: Platform, task_id: str) -> list[tuple[str, str | None]]:
    return [
        (row[0], row[1])
        for row in platform.sql(
            "SELECT attempt_id, outcome FROM task_attempts WHERE task_id = %(t)s"
            " ORDER BY start_date",
            {"t": task_id},
        )
    ]


def _running(gateway: GatewayProcess, service: Service, amqp_url: str, host: str) -> str:
    """A task submitted, then IN_PROGRESS at attempt `a1` on `host`; its id."""
    task_id = _submit(gateway, service)
    _send(amqp_url, service, EventKind.STARTED, task_id, host=host, attempt="a1")
    _until(gateway, service, task_id, "IN_PROGRESS")
    return task_id


def test_a_lowered_timeout_does_not_fail_the_tasks_already_running(
    watchdog: GatewayProcess, make_service: Any, platform: Platform, amqp_url: str
) -> None:
    service = make_service(taskTimeout=5, maxAttempts=1)
    task_id = _running(watchdog, service, amqp_url, host="h")
    started = time.monotonic()
    # What `admin apply` does to a running system: the service's timeout goes down to 1 s.
    platform.sql("UPDATE services SET task_timeout = 1 WHERE name = %(s)s", {"s": service.name})

    # 1 s + the margin has long passed; the task's own message gave its attempt 5 s.
    time.sleep(3.5)
    assert _poll(watchdog, service, task_id)["status"] == "IN_PROGRESS"

    # The watchdog still fails it once its own limit and the margin are over.
    failed = _until(watchdog, service, task_id, "FAILURE")
    assert failed["errorMessage"].startswith("No result from the worker")
    assert time.monotonic() - started >= 5
    assert platform.sql("SELECT time_limit FROM tasks WHERE task_id = %(t)s", {"t": task_id}) == [
        (5,)
    ]


def test_a_task_handed_back_waits_pending_and_the_watchdog_leaves_it(
    watchdog: GatewayProcess, make_service: Any, platform: Platform, amqp_url: str
) -> None:
    service = make_service(taskTimeout=1, maxAttempts=1)
    task_id = _running(watchdog, service, amqp_url, host="pod-a")

    # An attempt the task is not at any more changes nothing.
    _send(amqp_url, service, EventKind.REQUEUED, task_id, attempt="stale")
    _send(amqp_url, service, EventKind.PROGRESS, task_id, attempt="a1", progress=40.0)
    wait_until(lambda: _poll(watchdog, service, task_id)["progress"] == 40.0, 10, what="progress")
    assert _poll(watchdog, service, task_id)["status"] == "IN_PROGRESS"

    _send(amqp_url, service, EventKind.REQUEUED, task_id, attempt="a1")
    pending = _until(watchdog, service, task_id, "PENDING")
    assert pending["taskPosition"] == 1
    assert "startDate" not in pending and "workerHost" not in pending
    assert _attempts(platform, task_id) == [("a1", "requeued")]

    # The service's time limit and the margin (2 s) pass: the task waits in the queue.
    time.sleep(3.5)
    assert _poll(watchdog, service, task_id)["status"] == "PENDING"

    _send(amqp_url, service, EventKind.STARTED, task_id, host="pod-b", attempt="a2")
    _until(watchdog, service, task_id, "IN_PROGRESS")
    _send(amqp_url, service, EventKind.SUCCEEDED, task_id, attempt="a2", response={"ok": 1})
    assert _until(watchdog, service, task_id, "SUCCESS")["response"] == {"ok": 1}
    assert _attempts(platform, task_id) == [("a1", "requeued"), ("a2", "success")]


def test_results_a_replica_cannot_write_are_applied_by_another_before_its_watchdog_fails_them(
    procs: Processes, make_service: Any, database_url: str, amqp_url: str
) -> None:
    """Found by a black-box test: a replica whose database link stalled held the results it
    had taken from `-out`, unacked, for the whole stall; the other replica's watchdog, which
    could write and hear, counted the silence and failed tasks that had succeeded. A replica
    that cannot write its results for a few seconds now hands them back to the broker."""
    proxy = TcpProxy(*_host_and_port(database_url))
    stalled = GatewayProcess(
        procs,
        gateway_env(proxy.url(database_url), amqp_url, CONVEYOR_DB_TIMEOUT="2"),
        "gateway-stalled",
    )
    healthy = GatewayProcess(
        procs,
        gateway_env(
            database_url, amqp_url, CONVEYOR_SILENCE_MARGIN="25", CONVEYOR_REAPER_INTERVAL="0.3"
        ),
        "gateway-healthy",
    )
    service = make_service(taskTimeout=1, maxAttempts=1)
    try:
        task_ids = [_running(healthy, service, amqp_url, host=f"pod-{n}") for n in range(8)]
        proxy.pause()  # the stalled replica's database stops answering, its sockets open
        for task_id in task_ids:  # each replica takes its share of them
            _send(amqp_url, service, EventKind.SUCCEEDED, task_id, attempt="a1", response={"n": 1})
        # The healthy replica's watchdog would fail each task 26 s after its start.
        for task_id in task_ids:
            assert _until(healthy, service, task_id, "SUCCESS")["response"] == {"n": 1}
        assert _released(stalled) >= 1  # some were the stalled replica's to apply
    finally:
        proxy.resume()
        proxy.close()


def _host_and_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 5432


def _released(gateway: GatewayProcess) -> float:
    text = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("conveyor_gateway_results_released_total ")
    )


@pytest.mark.parametrize("mid_pass", [False, True], ids=["between-passes", "mid-pass"])
def test_a_gateway_frozen_past_the_limit_does_not_fail_tasks_whose_results_wait(
    procs: Processes, make_service: Any, database_url: str, amqp_url: str, mid_pass: bool
) -> None:
    """Found by a black-box test: a gateway frozen (SIGSTOP) longer than a task's limit ran
    its overdue reaper pass first thing once thawed, before it read the results that had
    waited on `-out`, and failed tasks that had succeeded: nothing told its hearing that
    the process had not been running. Then found in CI: frozen in the middle of a pass
    (here: its first statement waits on a table lock, released while it is frozen), the pass
    went on with the silence counted from before. Hearing watches the event loop's clock, and
    the watchdog's transaction is rolled back when hearing changed while it ran."""
    gateway = GatewayProcess(
        procs,
        gateway_env(
            database_url,
            amqp_url,
            CONVEYOR_SILENCE_MARGIN="2",
            CONVEYOR_REAPER_INTERVAL="0.3",
            CONVEYOR_DB_TIMEOUT="60",
        ),
        "gateway-frozen",
    )
    service = make_service(taskTimeout=1, maxAttempts=1)
    task_ids = [_running(gateway, service, amqp_url, host=f"pod-{n}") for n in range(5)]
    pid = gateway.proc.popen.pid
    with psycopg.connect(libpq(database_url)) as holder:
        if mid_pass:
            holder.execute("LOCK TABLE tasks IN SHARE MODE")  # the reaper's UPDATEs wait
            time.sleep(1)
        os.kill(pid, signal.SIGSTOP)
        try:
            for task_id in task_ids:  # their workers answer while the gateway is frozen
                _send(
                    amqp_url, service, EventKind.SUCCEEDED, task_id, attempt="a1", response={"n": 1}
                )
            time.sleep(6)  # past each task's limit and margin (3 s)
            holder.rollback()  # the pass goes on at once: its statement's answer waits
            time.sleep(0.5)
        finally:
            os.kill(pid, signal.SIGCONT)
    for task_id in task_ids:
        assert _until(gateway, service, task_id, "SUCCESS")["response"] == {"n": 1}


@pytest.mark.parametrize("db_timeout", [None, "3"], ids=["default", "db-timeout-3s"])
def test_a_locked_task_row_holds_back_its_own_result_only(
    procs: Processes,
    watchdog: GatewayProcess,
    make_service: Any,
    amqp_url: str,
    database_url: str,
    db_timeout: str | None,
) -> None:
    """Found by a black-box test: one task row held by a transaction (an operator's
    `SELECT … FOR UPDATE`) stalled every result, of every task, for as long as it was held:
    the batch that met the lock waited, then was retried whole. A batch that meets a locked
    row is applied one result at a time; the locked task's goes back to the queue until its
    row is free, the others are applied. Also with a short CONVEYOR_DB_TIMEOUT, whose
    statement timeout (1 s at 3 s) came before the 2 s lock wait: the batch was retried whole."""
    if db_timeout is not None:
        watchdog.proc.stop()
        env = gateway_env(
            database_url,
            amqp_url,
            CONVEYOR_SILENCE_MARGIN="1",
            CONVEYOR_REAPER_INTERVAL="0.3",
            CONVEYOR_DB_TIMEOUT=db_timeout,
        )
        watchdog = GatewayProcess(procs, env, "gateway-short-db-timeout")
    service = make_service(taskTimeout=60, maxAttempts=1)
    locked, *others = [_running(watchdog, service, amqp_url, host=f"pod-{n}") for n in range(5)]
    with psycopg.connect(libpq(database_url)) as holder:
        holder.execute("SELECT 1 FROM tasks WHERE task_id = %s FOR UPDATE", [locked])
        for task_id in (locked, *others):
            _send(amqp_url, service, EventKind.SUCCEEDED, task_id, attempt="a1", response={"n": 1})
        began = time.monotonic()
        for task_id in others:
            _until(watchdog, service, task_id, "SUCCESS")
        assert time.monotonic() - began < 8  # the statement timeout would have come first
        assert _poll(watchdog, service, locked)["status"] == "IN_PROGRESS"
        holder.rollback()
    assert _until(watchdog, service, locked, "SUCCESS")["response"] == {"n": 1}


def test_large_results_are_applied_in_batches_the_database_can_write_in_time(
    procs: Processes, make_service: Any, amqp_url: str, database_url: str
) -> None:
    """Found by a black-box test: a function answering large JSON within MAX_RESPONSE_BYTES
    (8 MiB arrays and objects) wedged the results of every service. A batch of a dozen took
    the database longer than CONVEYOR_DB_TIMEOUT, so its connection was cut, the batch handed
    back and taken again, for ever (tasks PENDING for good, the gateway at 5 GB). A batch now
    carries at most BATCH_BYTES of messages; a larger message is applied alone."""
    env = gateway_env(database_url, amqp_url, CONVEYOR_DB_TIMEOUT="3")
    gateway = GatewayProcess(procs, env, "gateway-large-results")
    service = make_service(taskTimeout=120, maxAttempts=1)
    large = [_running(gateway, service, amqp_url, host=f"pod-{n}") for n in range(12)]
    small = _running(gateway, service, amqp_url, host="pod-small")
    wide = [0] * 500_000  # 1 MB of JSON, a few tenths of a second of the database's time
    events = [
        encode_event(
            TaskEvent(EventKind.SUCCEEDED, task_id, attempt="a1", response=wide), service.name
        )
        for task_id in large
    ]
    small_event = TaskEvent(EventKind.SUCCEEDED, small, attempt="a1", response={"n": 1})
    publish(
        amqp_url,
        topology.out_queue(service.queue_name),
        [*events, encode_event(small_event, service.name)],
    )
    began = time.monotonic()
    for task_id in (small, *large):
        wait_until(
            lambda t=task_id: _poll(gateway, service, t)["status"] == "SUCCESS",
            60,
            what=f"task {task_id} SUCCESS",
        )
    assert time.monotonic() - began < 45, time.monotonic() - began
