"""A service's `-in` deleted under a running platform (by an operator, or lost with a node).

Found by a black-box tester: the gateway declared a service's queues only when it subscribed
the service, so once `-in` was gone every publish to it was returned unroutable, the relay
stalled for ever (`RelayStalled`) and each new task stayed PENDING until its time to live; the
tasks whose messages went down with the queue were never published again either. And while the
relay was stalled, `/readyz` cleared `outbox-relay` from `failing` at every pass that found
nothing due (the failed rows waiting out their backoff), so the failure flickered.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aio_pika
import httpx
import pytest

from conveyor import topology
from conveyor.events import MessageFormat
from conveyor.settings import GatewaySettings
from tests.e2e.conftest import Stack
from tests.support.amqp import (
    delete_queues,
    message_count,
    queues_of,
    remove_service,
    scratch_database,
    wait_for_queues,
    wait_until,
)
from tests.support.gateway import GatewayProcess, Platform, gateway_env, run_sync
from tests.support.processes import Processes

pytestmark = pytest.mark.timeout(120)


def _unpublished(platform: Platform, service: str) -> int:
    rows = platform.sql(
        "SELECT count(*) FROM tasks WHERE service = %(s)s AND publish_at IS NOT NULL",
        {"s": service},
    )
    return int(rows[0][0])


def _queued_then_lost(stack: Stack, platform: Platform) -> list[str]:
    """Three tasks published into `-in` (no dispatcher yet) and marked so, then `-in` deleted
    with their messages; their ids."""
    in_queue = topology.in_queue(stack.service.queue_name)
    queued = [stack.submit({"sleep": 0}) for _ in range(3)]
    wait_until(lambda: message_count(stack.amqp_url, in_queue) == 3, what="tasks published")
    wait_until(lambda: _unpublished(platform, stack.service.name) == 0, what="marked published")
    delete_queues(stack.amqp_url, [in_queue])
    return queued


@contextmanager
def _lost_under_a_first_gateway(
    database_url: str, amqp_url: str, procs: Processes, sleeper_url: str
) -> Iterator[tuple[str, Stack, list[str]]]:
    """A database of its own (no other gateway of the suite subscribes its service), one
    gateway, and three tasks lost with `-in` (`_queued_then_lost`): the database's url, the
    stack and the tasks' ids. The queue check on no gateway: nothing else finds the loss."""
    with scratch_database(database_url) as url:
        platform = Platform(url)
        svc = platform.service()
        try:
            first = GatewayProcess(procs, gateway_env(url, amqp_url), "gateway-first")
            wait_for_queues(amqp_url, queues_of(svc.queue_name))
            stack = Stack(procs, first, sleeper_url, amqp_url, svc)
            yield url, stack, _queued_then_lost(stack, platform)
        finally:
            procs.stop_all()
            remove_service(platform, amqp_url, svc)


def test_a_new_task_runs_after_in_was_deleted_under_a_running_dispatcher(stack: Stack) -> None:
    """The next submission right after the deletion: a queue declared again within ~20 ms
    kept the dispatcher's consumer attached to it, delivered to in the broker's eyes and
    hearing nothing (RabbitMQ 3.10, quorum queues): this failed whenever it ran alone."""
    in_queue = topology.in_queue(stack.service.queue_name)
    wait_for_queues(stack.amqp_url, queues_of(stack.service.queue_name))
    stack.dispatcher("pod-a")
    assert stack.finish(stack.submit({"sleep": 0}), timeout=30)["status"] == "SUCCESS"

    delete_queues(stack.amqp_url, [in_queue])
    assert message_count(stack.amqp_url, in_queue) is None

    task_id = stack.submit({"sleep": 0})
    final = stack.finish(task_id, timeout=20)
    assert final["status"] == "SUCCESS", final


def test_tasks_lost_with_a_deleted_in_are_published_again(stack: Stack, platform: Platform) -> None:
    """Published and confirmed (its row marked so), its message then deleted with `-in`: once
    the gateway finds the queue missing and declares it again, the task is published again."""
    in_queue = topology.in_queue(stack.service.queue_name)
    wait_for_queues(stack.amqp_url, queues_of(stack.service.queue_name))
    queued = stack.submit({"sleep": 0})  # no dispatcher yet: it waits in -in
    wait_until(lambda: message_count(stack.amqp_url, in_queue) == 1, what="queued task published")
    wait_until(lambda: _unpublished(platform, stack.service.name) == 0, what="marked published")

    delete_queues(stack.amqp_url, [in_queue])  # the queued task's message goes with it
    later = stack.submit({"sleep": 0})  # the gateway finds -in missing
    stack.dispatcher("pod-a")

    for task_id in (later, queued):
        final = stack.finish(task_id, timeout=30)
        assert final["status"] == "SUCCESS", (task_id, final)


@pytest.mark.timeout(150)
def test_tasks_lost_with_a_deleted_in_are_published_again_when_another_gateway_declares_it(
    database_url: str, amqp_url: str, procs: Processes, sleeper_url: str
) -> None:
    """A gateway that subscribes the service after `-in` was deleted (started then, or
    reconnected, or a replica that had not seen the service yet) declared `-in` again at
    once: the next publish and every queue check then found it there, and the tasks whose
    messages went with it stayed PENDING until their time to live. Found by CI, where every
    gateway of the suite shares one database and subscribes every test's services. Nothing
    is submitted after the deletion."""
    with _lost_under_a_first_gateway(database_url, amqp_url, procs, sleeper_url) as lost:
        url, stack, queued = lost
        in_queue = topology.in_queue(stack.service.queue_name)
        GatewayProcess(procs, gateway_env(url, amqp_url), "gateway-second")
        wait_until(lambda: message_count(amqp_url, in_queue) is not None, what="declared")
        stack.dispatcher("pod-a")

        for task_id in queued:
            final = stack.finish(task_id, timeout=30)
            assert final["status"] == "SUCCESS", (task_id, final)


async def _replace_by_a_classic_queue(url: str, name: str) -> None:
    """The queue replaced by one declared by other hands (a classic queue): declaring it as
    the gateway would is refused, PRECONDITION_FAILED."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(name)
        await channel.declare_queue(name, durable=True)


@pytest.mark.timeout(150)
def test_tasks_lost_with_a_deleted_in_are_published_again_when_declaring_it_again_fails(
    database_url: str, amqp_url: str, procs: Processes, sleeper_url: str
) -> None:
    """The gateway's declaration of a lost `-in` made `-in` (the service's queues are declared
    one by one), then was refused on the next queue: the restore counted as failed and gave
    no task back, and the queue now there hid the loss from everything else. Whatever the
    declaration's outcome, a lost queue's tasks are given back to the relay now."""
    with _lost_under_a_first_gateway(database_url, amqp_url, procs, sleeper_url) as lost:
        url, stack, _ = lost
        queue_name = stack.service.queue_name
        run_sync(_replace_by_a_classic_queue(amqp_url, topology.out_queue(queue_name)))
        GatewayProcess(procs, gateway_env(url, amqp_url), "gateway-second")
        in_queue = topology.in_queue(queue_name)
        wait_until(lambda: message_count(amqp_url, in_queue) == 3, 30, what="published again")


@pytest.mark.timeout(150)
def test_tasks_lost_with_a_deleted_in_are_published_again_without_another_submission(
    database_url: str, amqp_url: str, procs: Processes, sleeper_url: str
) -> None:
    """Nothing else submitted to the service, so no publish finds `-in` missing: the gateway
    looks for the `-in` of every service with PENDING tasks (`QUEUE_CHECK_INTERVAL`). This
    waited until its time to live (24 h) before. Another service whose queue cannot be looked
    at (an exclusive `-in` someone else holds: the broker answers RESOURCE_LOCKED), checked
    first, is named in `/readyz` and holds up nobody (it stopped the whole pass before).

    A database of its own: the suite's other gateways, which share one, leave the check off
    (`gateway_env`), and this gateway sees no other test's services."""
    with scratch_database(database_url) as url, _exclusive_holder(amqp_url) as hold:
        platform = Platform(url)
        services = [platform.service() for _ in range(2)]
        try:
            env = gateway_env(url, amqp_url, CONVEYOR_QUEUE_CHECK_INTERVAL="1")
            gw = GatewayProcess(procs, env, "gateway-checking")
            for svc in services:
                wait_for_queues(amqp_url, queues_of(svc.queue_name))
            # checked in the order of their queue names: the locked one first
            locked, lost = sorted(services, key=lambda svc: svc.queue_name)
            hold(topology.in_queue(locked.queue_name))
            Stack(procs, gw, sleeper_url, amqp_url, locked).submit({"sleep": 0})
            stack = Stack(procs, gw, sleeper_url, amqp_url, lost)
            queued = _queued_then_lost(stack, platform)
            stack.dispatcher("pod-a")  # waits for the gateway to declare -in again

            for task_id in queued:
                final = stack.finish(task_id, timeout=30)
                assert final["status"] == "SUCCESS", (task_id, final)
            failing = wait_until(lambda: _failing(gw).get("queue-check"), what="named")
            assert topology.in_queue(locked.queue_name) in failing, failing
        finally:
            procs.stop_all()
            for svc in services:
                remove_service(platform, amqp_url, svc)


@contextmanager
def _exclusive_holder(url: str) -> Iterator[Callable[[str], None]]:
    """`hold(name)` replaces the queue by an exclusive one this connection holds until the
    block ends (its own event loop in a thread, as the queue lives as long as the connection)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    connection = asyncio.run_coroutine_threadsafe(aio_pika.connect(url), loop).result(10)

    async def on_loop(name: str) -> None:
        channel = await connection.channel()
        await channel.queue_delete(name)
        await channel.declare_queue(name, exclusive=True)

    def hold(name: str) -> None:
        asyncio.run_coroutine_threadsafe(on_loop(name), loop).result(10)

    try:
        yield hold
    finally:
        asyncio.run_coroutine_threadsafe(connection.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


async def _refusing_in_queue(url: str, name: str) -> None:
    """`-in` replaced by a queue that refuses (nacks) every publish: it exists, so nothing
    declares it again, and the relay fails every pass."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(name)
        await channel.declare_queue(
            name, durable=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
        )


def _failing(gw: GatewayProcess) -> dict[str, str]:
    """The loops /readyz names under `failing`, with why (absent when none is)."""
    with gw.http() as http:
        data: dict[str, Any] = http.get("/readyz").json()["data"]
    return dict(data.get("failing", {}))


def _ready(gw: GatewayProcess) -> bool:
    with gw.http() as http:
        return http.get("/readyz").status_code == 200


@pytest.mark.timeout(150)
def test_a_stalled_relay_stays_failing_in_readyz_until_it_publishes(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    # A database of its own: no other gateway's relay takes (or fails) this test's rows.
    with scratch_database(database_url) as url:
        platform = Platform(url)
        svc = platform.service()
        try:
            gw = GatewayProcess(procs, gateway_env(url, amqp_url))
            wait_for_queues(amqp_url, queues_of(svc.queue_name))
            wait_until(lambda: _ready(gw), what="gateway ready")
            in_queue = topology.in_queue(svc.queue_name)
            run_sync(_refusing_in_queue(amqp_url, in_queue))
            with gw.http(svc.clients[0]) as http:
                answer = http.post(gw.tasks_url(svc.name), json={"body": {"n": 1}})
                assert answer.status_code == 201, answer.text

            wait_until(lambda: "outbox-relay" in _failing(gw), 20, what="relay named failing")
            samples = []
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:
                samples.append(_failing(gw))
                time.sleep(0.3)
            cleared = [n for n, failing in enumerate(samples) if "outbox-relay" not in failing]
            assert not cleared, f"outbox-relay cleared in samples {cleared} of {len(samples)}"

            # The queue deleted: the gateway declares it as it should be and publishes the
            # task; the relay's pass succeeds, and it is no longer named.
            delete_queues(amqp_url, [in_queue])
            wait_until(lambda: message_count(amqp_url, in_queue) == 1, 20, what="task published")
            wait_until(lambda: "outbox-relay" not in _failing(gw), 20, what="relay recovered")
        finally:
            procs.stop_all()
            remove_service(platform, amqp_url, svc)


async def _replace_at_once(url: str, queue_name: str) -> None:
    """`-in` deleted and declared again with the gateway's own arguments in one breath, as an
    operator's script (or a deploy tool) would: no gap for anyone to notice."""
    spec = next(
        s
        for s in topology.service_queues(
            queue_name, MessageFormat.CLOUDEVENTS, GatewaySettings().delivery_limit
        )
        if s.name == topology.in_queue(queue_name)
    )
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(spec.name)
        await channel.declare_queue(spec.name, durable=True, arguments=spec.arguments)


def _replaced(stack: Stack, name: str) -> float:
    metrics = httpx.get(f"http://127.0.0.1:{stack.dispatcher_ports[name]}/metrics", timeout=5)
    for line in metrics.text.splitlines():
        if line.startswith("conveyor_dispatcher_consumers_replaced_total "):
            return float(line.split()[1])
    raise AssertionError("no conveyor_dispatcher_consumers_replaced_total in /metrics")


def test_a_dispatcher_hears_an_in_deleted_and_declared_again_at_once(stack: Stack) -> None:
    """RabbitMQ 3.10 sends no cancel to the consumers of a quorum queue deleted and declared
    again at once: it counts them on the new queue and hands them its messages, which their
    channel never passes on. The dispatcher was deaf until restarted; idle for
    RECONSUME_IDLE_SECONDS (5 min by default), it now consumes again on a fresh channel."""
    wait_for_queues(stack.amqp_url, queues_of(stack.service.queue_name))
    stack.dispatcher("pod-a", RECONSUME_IDLE_SECONDS="3")
    assert stack.finish(stack.submit({"sleep": 0}), timeout=30)["status"] == "SUCCESS"

    run_sync(_replace_at_once(stack.amqp_url, stack.service.queue_name))
    task_id = stack.submit({"sleep": 0})
    final = stack.finish(task_id, timeout=30)
    assert final["status"] == "SUCCESS", final


def test_a_backlog_behind_a_deaf_consumer_is_heard_within_seconds(stack: Stack) -> None:
    """The same deaf consumer with more tasks than its prefetch: those beyond it wait ready in
    `-in`, which an idle dispatcher asks about every READY_CHECK_INTERVAL (10 s): it consumes
    again then, not after RECONSUME_IDLE_SECONDS (5 min). Idle with nothing waiting, it
    replaces nothing before that period (each replacement leaves ~4 KB on the connection)."""
    wait_for_queues(stack.amqp_url, queues_of(stack.service.queue_name))
    stack.dispatcher("pod-a")  # CONCURRENCY 4: the broker hands a deaf consumer 4 at most
    assert stack.finish(stack.submit({"sleep": 0}), timeout=30)["status"] == "SUCCESS"

    run_sync(_replace_at_once(stack.amqp_url, stack.service.queue_name))
    task_ids = [stack.submit({"sleep": 0}) for _ in range(7)]
    for task_id in task_ids:
        final = stack.finish(task_id, timeout=45)
        assert final["status"] == "SUCCESS", final
    assert _replaced(stack, "pod-a") == 1

    time.sleep(12)  # one check at least, idle, nothing waiting
    assert _replaced(stack, "pod-a") == 1


def test_idle_replacements_that_bring_nothing_come_ever_more_rarely(stack: Stack) -> None:
    """Each replacement leaves ~4 KB on the connection (aio-pika 10.2.1): an idle sidecar
    replaced its consumer every RECONSUME_IDLE_SECONDS for as long as it stayed idle (288 a
    day, ~1.3 MB). One that no delivery follows now doubles the wait for the next; a delivery
    starts again from the setting."""
    wait_for_queues(stack.amqp_url, queues_of(stack.service.queue_name))
    stack.dispatcher("pod-a", RECONSUME_IDLE_SECONDS="1")
    assert stack.finish(stack.submit({"sleep": 0}), timeout=30)["status"] == "SUCCESS"
    start = _replaced(stack, "pod-a")

    time.sleep(20)  # at 1, 3, 7 and 15 s idle: 4 (every second before: about 20)
    idle = _replaced(stack, "pod-a") - start
    assert 2 <= idle <= 5, idle

    assert stack.finish(stack.submit({"sleep": 0}), timeout=30)["status"] == "SUCCESS"
    after_work = _replaced(stack, "pod-a")
    wait_until(lambda: _replaced(stack, "pod-a") > after_work, timeout=6, what="a replacement")
