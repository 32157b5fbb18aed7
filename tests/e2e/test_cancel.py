"""POST …/tasks/{taskId}/cancel (SPEC §11.1) on the real stack: gateway, dispatchers and the
sleeper function as processes, the sleeper recording each call and each caller that went away
(CALL_LOG: `aborted`).

Every row of §11.1's table, and a cancel racing each moment: before any dispatcher runs, during
the call, while `started` is being published, while the function answers, while the dispatcher
is being SIGTERMed, and a dispatcher started after the broadcast.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from conveyor import topology
from conveyor.client import AsyncConveyorClient, ConveyorClient
from conveyor.events import EventKind, TaskEvent, encode_event
from tests.e2e.conftest import CallbackSink, Stack, calls_of
from tests.support.amqp import message_count, publish, wait_until
from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes
from tests.support.tcpproxy import TcpProxy

CANCELLED = "Task cancelled."


def _cancel(stack: Stack, task_id: str, http: httpx.Client | None = None) -> httpx.Response:
    client = http or stack.http
    return client.post(f"{stack.gateway.tasks_url(stack.service.name)}/{task_id}/cancel")


def _cancelled(data: dict[str, Any]) -> bool:
    return data["status"] == "FAILURE" and data["errorMessage"] == CANCELLED


def _in_queue_empty(stack: Stack) -> bool:
    return message_count(stack.amqp_url, f"{stack.service.queue_name}-in") == 0


def test_a_pending_task_is_cancelled_and_never_called(stack: Stack, call_log: Path) -> None:
    """A dispatcher started after the cancel reads the cancel log before it consumes. Where a
    start reads it from (all the memory holds, not the minute of a reconnection's overlap):
    tests/dispatcher/test_units.py, rather than a dispatcher started after a minute here."""
    task_id = stack.submit({"sleep": 0.1})
    queued = f"{stack.service.queue_name}-in"
    assert wait_until(lambda: message_count(stack.amqp_url, queued) == 1, 15)  # published
    answer = _cancel(stack, task_id)
    assert answer.status_code == 200, answer.text
    data = answer.json()["data"]
    assert _cancelled(data) and data["endDate"] and data["taskId"] == task_id
    assert "startDate" not in data  # it never started (SPEC §3.2: startDate comes with a start)
    again = _cancel(stack, task_id)  # idempotent
    assert again.status_code == 200 and again.json()["data"] == data
    stack.dispatcher("late-pod")  # not there for the broadcast; its message is still queued
    assert wait_until(lambda: _in_queue_empty(stack), 15)
    time.sleep(1.0)
    assert calls_of(call_log, task_id) == []  # it read the cancel log before consuming
    assert _cancelled(stack.poll(task_id))


def test_a_job_that_meets_a_cancelled_task_takes_no_second_message(
    stack: Stack, call_log: Path
) -> None:
    """Found by a black-box test: a ONE_SHOT dispatcher acked a cancelled task's message
    without a call, and the broker sent it the next message before its consumer was cancelled;
    that message was handed back, so its task's first call said X-Conveyor-Attempt: 2. A Job
    now cancels its consumer before it settles its one message."""
    cancelled = stack.submit({"sleep": 0})
    queued = f"{stack.service.queue_name}-in"
    assert wait_until(lambda: message_count(stack.amqp_url, queued) == 1, 15)
    assert _cancel(stack, cancelled).status_code == 200
    waiting = stack.submit({"sleep": 0})
    assert wait_until(lambda: message_count(stack.amqp_url, queued) == 2, 15)
    job = stack.dispatcher("job-cancelled", ONE_SHOT="1", IDLE_EXIT_SECONDS="5")
    assert job.wait(timeout=30) == 0
    assert calls_of(call_log, cancelled) == []
    stack.dispatcher("pod-after-the-job")
    assert stack.finish(waiting)["status"] == "SUCCESS"
    assert [call[1] for call in calls_of(call_log, waiting)] == ["1"]


def test_an_in_progress_call_is_aborted_and_the_message_acked(stack: Stack, call_log: Path) -> None:
    stack.dispatcher("pod-a")
    task_id = stack.submit({"sleep": 30})
    stack.watch(task_id, lambda d: d["status"] == "IN_PROGRESS")
    began = time.monotonic()
    answer = _cancel(stack, task_id)
    assert answer.status_code == 200 and _cancelled(answer.json()["data"])
    # The function sees its caller go away (the sleeper checks between its naps).
    assert wait_until(lambda: ["aborted"] == [c[2] for c in calls_of(call_log, task_id)], 10)
    assert time.monotonic() - began < 10
    assert wait_until(lambda: _in_queue_empty(stack), 10)
    assert stack.http.get("/readyz").status_code in (200, 503)  # the gateway is fine
    time.sleep(1.0)
    assert len(calls_of(call_log, task_id)) == 1  # acked, not retried
    assert _cancelled(stack.poll(task_id))


def test_an_in_progress_call_of_a_legacy_service_is_aborted_too(
    procs: Processes,
    e2e_gateway: GatewayProcess,
    sleeper_url: str,
    amqp_url: str,
    platform: Platform,
    call_log: Path,
) -> None:
    """Found by a black-box test: a service in the seed's legacy format, served by Conveyor's
    dispatcher, got no cancel broadcast ("legacy workers read no cancels"): the task was
    FAILURE at once, but the function ran to its end. The seed's own workers ignore the
    exchange; Conveyor's dispatcher hears it whatever the format."""
    service = platform.service(messageFormat="legacy", taskTimeout=60, maxAttempts=3)
    stack = Stack(procs, e2e_gateway, sleeper_url, amqp_url, service)
    try:
        stack.dispatcher("legacy-pod")
        task_id = stack.submit({"sleep": 30})
        stack.watch(task_id, lambda d: d["status"] == "IN_PROGRESS")
        answer = _cancel(stack, task_id)
        assert answer.status_code == 200 and _cancelled(answer.json()["data"])
        assert wait_until(lambda: ["aborted"] == [c[2] for c in calls_of(call_log, task_id)], 10)
        assert wait_until(lambda: _in_queue_empty(stack), 10)  # acked, not handed back
        time.sleep(1.0)
        assert len(calls_of(call_log, task_id)) == 1
        assert _cancelled(stack.poll(task_id))
    finally:
        stack.http.close()


def test_a_call_on_the_queue_its_service_left_is_aborted_too(
    stack: Stack, platform: Platform, call_log: Path
) -> None:
    """A service given another queueName while its old queue's dispatcher still runs a
    task: the cancel went out on the new queue's exchange only, and the old dispatcher's call
    ran to its end."""
    stack.dispatcher("old-queue-pod")  # stays on the queue it was started with
    task_id = stack.submit({"sleep": 30})
    stack.watch(task_id, lambda d: d["status"] == "IN_PROGRESS")
    moved = f"{stack.service.queue_name}-moved"
    platform.apply({"services": [{"name": stack.service.name, "queueName": moved}]})
    Platform.queue_names.add(moved)  # swept at the run's end
    time.sleep(1.0)  # the gateway's catalog knows the move
    answer = _cancel(stack, task_id)
    assert answer.status_code == 200 and _cancelled(answer.json()["data"])
    assert wait_until(lambda: ["aborted"] == [c[2] for c in calls_of(call_log, task_id)], 10)
    assert wait_until(lambda: _in_queue_empty(stack), 10)  # acked, not handed back
    assert _cancelled(stack.poll(task_id))


def _delete_service(
    stack: Stack, database_url: str, amqp_url: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`conveyor admin service delete` of the stack's service, as an operator runs it."""
    env = {
        **os.environ,
        "CONVEYOR_DATABASE_URL": database_url,
        "CONVEYOR_AMQP_URL": amqp_url or stack.amqp_url,
    }
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "admin", "service", "delete", stack.service.name],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _untold(platform: Platform, stack: Stack) -> int:
    rows = platform.sql(
        "SELECT count(*) FROM untold_cancels WHERE service = %(s)s", {"s": stack.service.name}
    )
    return int(rows[0][0])


def _made_again_none_is_called(
    stack: Stack, platform: Platform, call_log: Path, waiting: list[str]
) -> None:
    """The service made again under its name and queue, and a dispatcher started on it: the
    messages of the tasks the delete ended are acked without a call."""
    platform.apply(
        {"services": [{"name": stack.service.name, "queueName": stack.service.queue_name}]}
    )
    stack.dispatcher("pod-b")
    assert wait_until(lambda: _in_queue_empty(stack), 15)
    time.sleep(1.0)
    assert [calls_of(call_log, task_id) for task_id in waiting] == [[], [], []]


def test_tasks_a_service_delete_ended_are_not_run_afterwards(
    stack: Stack, platform: Platform, call_log: Path, database_url: str
) -> None:
    """`admin service delete` ends every unfinished task FAILURE `Service deleted.`; the
    function still ran them all, the one under way and those waiting in `-in`, even once the
    service was made again under its name and a dispatcher started on its queue."""
    stack.dispatcher("pod-a", CONCURRENCY="1")
    running = stack.submit({"sleep": 30})
    stack.watch(running, lambda d: d["status"] == "IN_PROGRESS")
    waiting = [stack.submit({"sleep": 0}) for _ in range(3)]
    done = _delete_service(stack, database_url)
    assert done.returncode == 0, done.stderr
    assert "4 unfinished tasks" in done.stdout
    assert wait_until(lambda: ["aborted"] == [c[2] for c in calls_of(call_log, running)], 10)
    platform.apply(  # the same name and queue again, at once
        {"services": [{"name": stack.service.name, "queueName": stack.service.queue_name}]}
    )
    stack.dispatcher("pod-b")
    assert wait_until(lambda: _in_queue_empty(stack), 15)
    time.sleep(1.0)
    assert [calls_of(call_log, task_id) for task_id in waiting] == [[], [], []]
    assert len(calls_of(call_log, running)) == 1


def test_tasks_a_service_delete_ended_while_no_dispatcher_ran_are_not_run_by_a_later_one(
    stack: Stack, platform: Platform, call_log: Path, database_url: str
) -> None:
    """Found by a black-box sweep: with no dispatcher running (scaled to zero), the CLI's
    broker was not connected yet when it declared the service's `-cancels` stream, so it
    declared nothing, and the cancels went to a `-control` exchange no queue was bound to:
    the dispatcher KEDA then started for the messages left in `-in` called the function for
    every task the delete had ended."""
    waiting = [stack.submit({"sleep": 0}) for _ in range(3)]
    done = _delete_service(stack, database_url)
    assert done.returncode == 0, done.stderr
    assert "3 unfinished tasks" in done.stdout
    assert "warning" not in done.stderr, done.stderr
    assert _untold(platform, stack) == 0  # told at once: nothing left for the gateways
    _made_again_none_is_called(stack, platform, call_log, waiting)


def test_tasks_a_service_delete_ended_while_the_broker_was_away_are_told_once_it_is_back(
    stack: Stack,
    platform: Platform,
    call_log: Path,
    database_url: str,
    amqp_url: str,
    amqp_proxy: TcpProxy,
) -> None:
    """Found by a sweep: a delete whose CLI could not reach RabbitMQ kept none of its cancels,
    and once the broker was back every function of the tasks it ended was called (50 of 50).
    The delete keeps them in the database (`untold_cancels`); a running gateway tells them."""
    waiting = [stack.submit({"sleep": 0}) for _ in range(3)]
    queued = topology.in_queue(stack.service.queue_name)
    assert wait_until(lambda: message_count(amqp_url, queued) == 3, 15)  # published
    amqp_proxy.sever()  # the CLI's way to the broker
    done = _delete_service(stack, database_url, amqp_proxy.url(amqp_url))
    assert done.returncode == 0, done.stderr
    assert "3 unfinished tasks" in done.stdout
    assert "did not take every cancel" in done.stderr, done.stderr
    cancels = topology.cancel_log(stack.service.queue_name)
    assert wait_until(lambda: message_count(amqp_url, cancels) == 3, 30), "never told"
    assert wait_until(lambda: _untold(platform, stack) == 0, 10)
    _made_again_none_is_called(stack, platform, call_log, waiting)


def test_a_task_its_function_failed_with_the_cancel_message_is_not_taken_for_cancelled(
    stack: Stack, platform: Platform
) -> None:
    """Found by a black-box test: a cancelled task was recognised by its error message, which
    a function can send too: a task its function failed with "Task cancelled." answered a
    cancel `200` (already cancelled) instead of `409001`. A cancel is recorded as such now."""
    failed = stack.submit({"sleep": 0})  # no dispatcher: PENDING, then failed as a function would
    platform.sql(
        "UPDATE tasks SET status = 'FAILURE', error_message = %(m)s, end_date = now()"
        " WHERE task_id = %(t)s",
        {"m": CANCELLED, "t": failed},
    )
    refused = _cancel(stack, failed)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["number"] == 409001
    cancelled = stack.submit({"sleep": 0})
    first, again = _cancel(stack, cancelled), _cancel(stack, cancelled)
    assert (first.status_code, again.status_code) == (200, 200), again.text
    assert again.json()["data"] == first.json()["data"]


def test_finished_tasks_answer_409001(stack: Stack) -> None:
    stack.dispatcher("pod-a")
    done = stack.submit({"sleep": 0})
    failed = stack.submit({"sleep": 0, "mustSucceed": False})
    assert stack.finish(done)["status"] == "SUCCESS"
    assert stack.finish(failed)["errorMessage"] == "Argh!"
    for task_id in (done, failed):
        answer = _cancel(stack, task_id)
        assert (answer.status_code, answer.json()["error"]["number"]) == (409, 409001)
    assert stack.poll(done)["status"] == "SUCCESS"  # nothing changed


def test_cancel_is_authorized_and_isolated_like_the_poll(stack: Stack, platform: Platform) -> None:
    task_id = stack.submit({"sleep": 0})
    other = platform.service()
    with stack.gateway.http() as anonymous, stack.gateway.http(other.clients[0]) as stranger:
        url = f"{stack.gateway.tasks_url(stack.service.name)}/{task_id}/cancel"
        answers = {
            "anonymous": anonymous.post(url),
            "ungranted": stranger.post(url),
            "no service": stranger.post(f"/v1/services/nope/tasks/{task_id}/cancel"),
            "someone else's": stranger.post(
                f"{stack.gateway.tasks_url(other.name)}/{task_id}/cancel"
            ),
            "no task": stranger.post(
                f"{stack.gateway.tasks_url(other.name)}/{uuid.uuid4()}/cancel"
            ),
        }
    assert {k: a.json()["error"]["number"] for k, a in answers.items()} == {
        "anonymous": 403001,
        "ungranted": 403001,
        "no service": 404001,
        "someone else's": 404002,
        "no task": 404002,
    }
    assert stack.poll(task_id)["status"] == "PENDING"


def test_the_callback_is_sent_for_a_cancelled_task(stack: Stack, sink: CallbackSink) -> None:
    task_id = stack.submit({"sleep": 0}, callback=sink.url)
    assert _cancel(stack, task_id).status_code == 200
    assert wait_until(lambda: len(sink.received) == 1, 10)
    body = sink.received[0]["body"]
    assert body["taskId"] == task_id and body["errorMessage"] == CANCELLED


@pytest.mark.parametrize("moment", [0.0, 0.02, 0.05])
def test_a_cancel_racing_the_start_and_the_answer_stays_cancelled(
    stack: Stack, moment: float
) -> None:
    """Right as the dispatcher publishes `started`, or while a quick function answers: the
    result that may still arrive changes nothing."""
    stack.dispatcher("pod-a")
    task_ids = [stack.submit({"sleep": 0.05}) for _ in range(8)]
    time.sleep(moment)
    answers = [_cancel(stack, t) for t in task_ids]
    cancelled = [t for t, a in zip(task_ids, answers, strict=True) if a.status_code == 200]
    finished = [t for t, a in zip(task_ids, answers, strict=True) if a.status_code == 409]
    assert len(cancelled) + len(finished) == len(task_ids)
    assert wait_until(lambda: _in_queue_empty(stack), 15)
    time.sleep(1.0)  # late results, if any, have been applied by now
    for task_id in cancelled:
        assert _cancelled(stack.poll(task_id))
    for task_id in finished:
        assert stack.poll(task_id)["status"] == "SUCCESS"


def test_a_cancel_during_a_sigterm_requeue_is_not_run_again(stack: Stack, call_log: Path) -> None:
    pod = stack.dispatcher("pod-a", SHUTDOWN_MODE="requeue")
    task_id = stack.submit({"sleep": 20})
    stack.watch(task_id, lambda d: d["status"] == "IN_PROGRESS")
    pod.signal(signal.SIGTERM)  # hands the message back
    assert _cancel(stack, task_id).status_code == 200
    assert pod.reap(15) == 0
    stack.dispatcher("pod-b")  # takes the requeued copy, if any, and must not finish it
    assert wait_until(lambda: _in_queue_empty(stack), 15)
    time.sleep(1.0)
    assert _cancelled(stack.poll(task_id))
    assert all(c[2] == "aborted" for c in calls_of(call_log, task_id))


async def test_the_sdks_and_the_cli_cancel(stack: Stack) -> None:
    client_id, secret = stack.client.auth
    first, second, third = (stack.submit({"sleep": 0}) for _ in range(3))
    with ConveyorClient(stack.gateway.url, client_id, secret) as client:
        assert client.cancel(stack.service.name, first).error_message == CANCELLED
    async with AsyncConveyorClient(stack.gateway.url, client_id, secret) as aclient:
        assert (await aclient.cancel(stack.service.name, second)).status == "FAILURE"
    env = {
        **os.environ,
        "CONVEYOR_GATEWAY_URL": stack.gateway.url,
        "CONVEYOR_CLIENT_ID": client_id,
        "CONVEYOR_CLIENT_SECRET": secret,
    }
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "conveyor", "task", "cancel", stack.service.name, third],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["errorMessage"] == CANCELLED


@pytest.mark.parametrize("untold_cancels", ["free", "locked 12 s"])
def test_a_task_the_watchdog_failed_is_not_called_by_a_later_dispatcher(
    untold_cancels: str,
    procs: Processes,
    sleeper_url: str,
    database_url: str,
    amqp_url: str,
    platform: Platform,
    call_log: Path,
) -> None:
    """Found by a review: the watchdog fails a task whose worker fell silent (it crashed, and
    its `started` was the last word), but the task's message is still queued; a dispatcher
    that took it later called the function for a task already FAILURE. The watchdog's
    failures are now broadcast as cancels are: the message is acked without a call. Then a
    sweep: its cancels were kept after its failures had committed, and a database error in
    between (here a lock on their table past the statement timeout) lost them."""
    watchdog = GatewayProcess(
        procs,
        gateway_env(
            database_url, amqp_url, CONVEYOR_SILENCE_MARGIN="1", CONVEYOR_REAPER_INTERVAL="0.3"
        ),
        "gateway-watchdog",
    )
    service = platform.service(taskTimeout=1, maxAttempts=1)
    stack = Stack(procs, watchdog, sleeper_url, amqp_url, service)
    try:
        task_id = stack.submit({"sleep": 0})
        queued = f"{service.queue_name}-in"
        assert wait_until(lambda: message_count(amqp_url, queued) == 1, 15)  # published
        # A worker took it, said `started`, and crashed: nothing more is heard of it.
        started = TaskEvent(kind=EventKind.STARTED, task_id=task_id, host="gone", attempt="a1")
        publish(
            amqp_url, topology.out_queue(service.queue_name), [encode_event(started, service.name)]
        )
        stack.watch(task_id, lambda d: d["status"] == "IN_PROGRESS")
        if untold_cancels == "locked 12 s":
            holder = threading.Thread(
                target=platform.sql,
                args=(
                    "BEGIN; LOCK TABLE untold_cancels IN SHARE MODE; SELECT pg_sleep(12); COMMIT",
                ),
            )
            holder.start()
        failed = stack.watch(task_id, lambda d: d["status"] == "FAILURE", timeout=40)[-1]
        assert failed["errorMessage"].startswith("No result from the worker")
        if untold_cancels == "locked 12 s":
            holder.join()

        stack.dispatcher("later-pod")  # the broker redelivers what the crashed worker held
        assert wait_until(lambda: _in_queue_empty(stack), 15)
        time.sleep(1.0)
        assert calls_of(call_log, task_id) == []
        assert stack.poll(task_id) == failed
    finally:
        stack.http.close()


@pytest.mark.parametrize("its_gateway", ["lives", "is SIGKILLed"])
def test_a_cancel_the_broker_did_not_take_is_told_once_it_is_back(
    its_gateway: str,
    procs: Processes,
    sleeper_url: str,
    database_url: str,
    amqp_url: str,
    amqp_proxy: TcpProxy,
    platform: Platform,
    call_log: Path,
) -> None:
    """Found by a soak: a cancel answered during a broker outage was never broadcast (the
    gateway logged it and went on), so a dispatcher took the task's message once the broker
    was back and called the function: 5 of 5 cancelled tasks. Then a sweep: such cancels were
    kept in the memory of the gateway that answered them, and one SIGKILLed before the broker
    came back took them along. The database keeps them; a gateway tells them once the broker
    takes them, and a dispatcher started after that acks the messages without a call."""
    gateway = GatewayProcess(procs, gateway_env(database_url, amqp_proxy.url(amqp_url)), "gw-cut")
    service = platform.service()
    stack = Stack(procs, gateway, sleeper_url, amqp_url, service)
    try:
        task_ids = [stack.submit({"sleep": 0}) for _ in range(3)]
        queued = topology.in_queue(service.queue_name)
        assert wait_until(lambda: message_count(amqp_url, queued) == 3, 15)  # published
        amqp_proxy.sever()
        assert wait_until(lambda: stack.http.get("/readyz").status_code == 503, 15)
        for task_id in task_ids:
            answer = _cancel(stack, task_id)
            assert answer.status_code == 200 and _cancelled(answer.json()["data"]), answer.text
        if its_gateway == "is SIGKILLed":
            gateway.proc.signal(signal.SIGKILL)
            gateway.proc.wait(10)
            GatewayProcess(procs, gateway_env(database_url, amqp_url), "gw-next")
        amqp_proxy.restore()
        cancels = topology.cancel_log(service.queue_name)
        assert wait_until(lambda: message_count(amqp_url, cancels) == 3, 30), "never told"
        stack.dispatcher("after-the-outage")
        assert wait_until(lambda: message_count(amqp_url, queued) == 0, 15)
        time.sleep(1.0)
        assert [calls_of(call_log, t) for t in task_ids] == [[], [], []]
    finally:
        stack.http.close()


def test_a_repeated_cancel_tells_the_dispatchers_again(
    stack: Stack, platform: Platform, call_log: Path
) -> None:
    """Found by a sweep: a gateway SIGKILLed between a cancel's commit and its broadcast (or
    a cancel answered 503 that committed all the same) left the task cancelled and nobody
    told, and the client's repeated cancel answered 200 without telling anyone either: a
    dispatcher then took the message and called the function. A repeat tells them again."""
    task_id = stack.submit({"sleep": 0})
    queued = topology.in_queue(stack.service.queue_name)
    assert wait_until(lambda: message_count(stack.amqp_url, queued) == 1, 15)  # published
    # what a gateway killed right after the cancel's commit leaves: cancelled, untold
    platform.sql(
        "UPDATE tasks SET status = 'FAILURE', error_message = %(m)s, end_date = now(),"
        " cancelled_at = now(), publish_at = NULL WHERE task_id = %(t)s",
        {"m": CANCELLED, "t": task_id},
    )
    again = _cancel(stack, task_id)
    assert again.status_code == 200 and _cancelled(again.json()["data"]), again.text
    stack.dispatcher("after-the-repeat")
    assert wait_until(lambda: _in_queue_empty(stack), 15)
    time.sleep(1.0)
    assert calls_of(call_log, task_id) == []


def test_a_cancel_that_waited_for_the_task_s_row_ends_it_when_it_took_effect(
    stack: Stack, platform: Platform
) -> None:
    """Found by a black-box test: under load, a cancelled task's endDate was the moment the
    cancel was decided, before it waited for a database connection and for the task's row
    (held by a result being applied): 1 to 3.4 s before it took effect, before the function's
    call had even begun, which then read as a task that ran after it ended."""
    import psycopg

    from gateway.database_url import libpq

    task_id = stack.submit({"sleep": 0.1})  # no dispatcher runs: PENDING
    answers: list[httpx.Response] = []
    with psycopg.connect(libpq(platform.database_url)) as holder:
        holder.execute("SELECT 1 FROM tasks WHERE task_id = %s FOR UPDATE", (task_id,))
        cancel = threading.Thread(target=lambda: answers.append(_cancel(stack, task_id)))
        cancel.start()
        time.sleep(1.5)  # the cancel waits for the row meanwhile
        assert not answers
        released = datetime.now(UTC)
        holder.commit()
    cancel.join(30)
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    ended = datetime.fromisoformat(answer.json()["data"]["endDate"].replace("Z", "+00:00"))
    assert ended >= released - timedelta(seconds=0.1), (ended, released)
    assert _cancelled(stack.poll(task_id))
