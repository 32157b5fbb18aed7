"""Found by the chaos run: after a RabbitMQ restart the gateway stopped consuming `-out`.

The result consumer took `-out` and `-dlq` with `get_queue(ensure=False)`: a
queue object the robust channel does not register, so aio-pika's reconnection
restored the channel but not its consumers, and `refresh()` saw an open
channel and a service it believed subscribed. Every event of every task then
stayed on `-out` (17,000 messages, 0 consumers, 8,255 tasks PENDING or
IN_PROGRESS at the end of a 10,000-task run) until the gateway was restarted.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Callable

import aio_pika
import httpx
import pytest

from bench.chaos.infra import queue_state
from conveyor import topology
from conveyor.events import EventKind, TaskEvent, encode_event
from tests.support.amqp import delete_queues, queues_of
from tests.support.gateway import GatewayProcess, Platform, Service, gateway_env
from tests.support.processes import Processes
from tests.support.servers import RabbitNode

pytestmark = pytest.mark.timeout(180)


def _eventually(
    check: Callable[[], bool], timeout: float, what: str, seen: Callable[[], object] = str
) -> None:
    """`seen()`: what the failure message shows of the state last found."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout}s: {seen()}")
        time.sleep(0.2)


def _consumers(amqp_url: str, queue: str) -> int | None:
    state = queue_state(amqp_url, queue)
    return None if state is None else state.consumers


async def _publish_result(amqp_url: str, service: str, queue: str, task_id: str) -> None:
    event = TaskEvent(EventKind.SUCCEEDED, task_id, response={"after": "restart"})
    await _publish(amqp_url, service, topology.out_queue(queue), event)


def test_results_are_consumed_again_after_a_broker_restart(
    procs: Processes,
    platform: Platform,
    database_url: str,
    private_rabbit: RabbitNode,
) -> None:
    amqp_url = private_rabbit.url
    service = platform.service()
    # A refresh period longer than aio-pika's channel restoration (the default is 5 s):
    # the channel is restored before the next refresh can notice it was closed.
    env = gateway_env(database_url, amqp_url, CONVEYOR_SERVICE_REFRESH_INTERVAL="2")
    gateway = GatewayProcess(procs, env)
    out, dlq = (
        topology.out_queue(service.queue_name),
        topology.dead_letter_queue(service.queue_name),
    )
    _eventually(lambda: _consumers(amqp_url, out) == 1, 20, "consuming -out")

    private_rabbit.restart(down_for=1.0)
    # Several refresh periods after the reconnection: whatever the race, it has settled.
    _eventually(lambda: _consumers(amqp_url, out) is not None, 60, "broker back")
    time.sleep(8)

    _result_applied(gateway, amqp_url, service, service.queue_name)
    assert _consumers(amqp_url, out) == 1
    assert _consumers(amqp_url, dlq) == 1


def test_queues_a_service_left_are_consumed_again_after_a_broker_restart(
    procs: Processes,
    platform: Platform,
    database_url: str,
    private_rabbit: RabbitNode,
) -> None:
    """A service moved to another queueName: the result queues it left are consumed without
    aio-pika's restoration (which would declare them again once the operator deleted them),
    so a reconnection drops their consumers, and the refresh makes them again."""
    amqp_url = private_rabbit.url
    service = platform.service()
    env = gateway_env(database_url, amqp_url, CONVEYOR_SERVICE_REFRESH_INTERVAL="2")
    gateway = GatewayProcess(procs, env)
    left = topology.out_queue(service.queue_name)
    _eventually(lambda: _consumers(amqp_url, left) == 1, 20, "consuming -out")
    moved = _move(platform, service)
    _eventually(lambda: _consumers(amqp_url, topology.out_queue(moved)) == 1, 20, "the new -out")
    # The move gives the consumer a fresh channel: the queue left behind is consumed on it a
    # moment after the new one (results wait there meanwhile; in CI the check fell in between).
    _eventually(lambda: _consumers(amqp_url, left) == 1, 20, "consuming the -out it left")

    private_rabbit.restart(down_for=1.0)
    _eventually(lambda: _consumers(amqp_url, left) == 1, 60, "consuming the old -out again")

    _result_applied(gateway, amqp_url, service, service.queue_name)
    _result_applied(gateway, amqp_url, service, moved)
    assert _consumers(amqp_url, left) == 1
    assert _consumers(amqp_url, topology.dead_letter_queue(service.queue_name)) == 1


def test_a_gateway_started_after_a_move_consumes_the_queue_the_service_left(
    procs: Processes,
    platform: Platform,
    database_url: str,
    private_rabbit: RabbitNode,
) -> None:
    """A service moved to another queueName while no gateway ran, or before one restarted:
    the old queue's dispatchers still report on the old `-out`. Only a gateway that saw the
    move used to consume it, so after a restart (a deploy) those results waited there and
    their tasks stayed IN_PROGRESS until the watchdog failed them. The move is recorded by
    the database, so a gateway started later knows it too, until the operator deletes the
    queues."""
    amqp_url = private_rabbit.url
    service = platform.service()
    env = gateway_env(database_url, amqp_url, CONVEYOR_SERVICE_REFRESH_INTERVAL="0.3")
    gateway = GatewayProcess(procs, env)
    left = topology.out_queue(service.queue_name)
    _eventually(lambda: _consumers(amqp_url, left) == 1, 20, "consuming -out")
    gateway.proc.stop()

    moved = _move(platform, service)
    gateway = GatewayProcess(procs, env, "gateway-restarted")
    _eventually(lambda: _consumers(amqp_url, topology.out_queue(moved)) == 1, 20, "the new -out")
    _result_applied(gateway, amqp_url, service, service.queue_name)
    assert _consumers(amqp_url, left) == 1
    assert _consumers(amqp_url, topology.dead_letter_queue(service.queue_name)) == 1

    # Once the operator deleted them, the queues are forgotten: not declared again, even by
    # a gateway started after that.
    delete_queues(amqp_url, queues_of(service.queue_name))
    time.sleep(1.5)
    gateway.proc.stop()
    gateway = GatewayProcess(procs, env, "gateway-after-the-delete")
    _result_applied(gateway, amqp_url, service, moved)
    assert _consumers(amqp_url, left) is None
    rows = platform.sql(
        "SELECT count(*) FROM moved_queues WHERE queue_name = %(q)s", {"q": service.queue_name}
    )
    assert rows == [(0,)]


def _move(platform: Platform, service: Service) -> str:
    """`admin apply` gives `service` another queueName; the new one, swept at the run's end."""
    moved = f"{service.queue_name}-moved"
    platform.apply({"services": [{"name": service.name, "queueName": moved}]})
    Platform.queue_names.add(moved)
    return moved


def _result_applied(gateway: GatewayProcess, amqp_url: str, service: Service, queue: str) -> None:
    """A new task of `service` ends SUCCESS from a result published on `queue`'s `-out`."""
    with gateway.http(service.clients[0]) as http:
        answer = http.post(gateway.tasks_url(service.name), json={"body": {"sleep": 0}})
        assert answer.status_code == 201, answer.text
        task_id = answer.json()["data"]["taskId"]
        asyncio.run(_publish_result(amqp_url, service.name, queue, task_id))

        def finished() -> bool:
            url = f"{gateway.tasks_url(service.name)}/{task_id}"
            return http.get(url).json()["data"]["status"] == "SUCCESS"

        _eventually(finished, 20, f"SUCCESS applied from {topology.out_queue(queue)}")


def _status(platform: Platform, task_id: str) -> str:
    return str(platform.sql("SELECT status FROM tasks WHERE task_id = %(t)s", {"t": task_id})[0][0])


def test_the_watchdog_waits_while_results_cannot_be_heard(
    procs: Processes,
    platform: Platform,
    database_url: str,
    private_rabbit: RabbitNode,
) -> None:
    """Found by a sweep: with the broker away for longer than a task's time limit, the
    watchdog failed the tasks in flight ("No result from the worker") although their
    dispatchers held the results, unable to publish them; the results were then ignored.
    While results cannot be heard (the broker connection down, or the database refusing
    their writes), silence proves nothing: it counts again once they can (gateway/hearing.py)."""
    amqp_url = private_rabbit.url
    # Silent for 12 + 1 s: abandoned. Not less: `rabbitmqctl stop_app` below takes seconds on
    # a busy machine (in CI under load the connections dropped 9 s after the task started,
    # past a 6 + 1 s limit), and the task must still be within its limit when they have.
    service = platform.service(taskTimeout=12, maxAttempts=1)
    gateway, out, task_id = _a_task_in_progress(procs, platform, database_url, amqp_url, service)

    private_rabbit.ctl("stop_app")  # every connection drops
    try:
        time.sleep(28)  # over twice the task's limit and margin
        assert _status(platform, task_id) == "IN_PROGRESS"
    finally:
        private_rabbit.ctl("start_app")
    consumers = lambda: f"{_consumers(amqp_url, out)} consumers on {out}"  # noqa: E731
    _eventually(lambda: _consumers(amqp_url, out) == 1, 60, "consuming -out again", consumers)
    done = TaskEvent(EventKind.SUCCEEDED, task_id, response={"held": "through the outage"})
    asyncio.run(_publish(amqp_url, service.name, out, done))
    _eventually(lambda: _status(platform, task_id) != "IN_PROGRESS", 20, "finished")
    assert _status(platform, task_id) == "SUCCESS"
    # Silence still ends a task once results can be heard: the watchdog is not off for good.
    with gateway.http(service.clients[0]) as http:
        answer = http.post(gateway.tasks_url(service.name), json={"body": {}})
    silent = answer.json()["data"]["taskId"]
    asyncio.run(_publish(amqp_url, service.name, out, TaskEvent(EventKind.STARTED, silent)))
    _eventually(lambda: _status(platform, silent) == "FAILURE", 40, "abandoned")


def test_the_watchdog_waits_while_a_resource_alarm_blocks_the_results(
    procs: Processes,
    platform: Platform,
    database_url: str,
    private_rabbit: RabbitNode,
) -> None:
    """Found by a sweep: a memory or disk alarm blocks every publishing connection while
    leaving it up, so the gateway went on hearing (connected) while no dispatcher could
    publish its result: past the limit the watchdog failed tasks whose functions had
    succeeded, 6 of 6, and their results were ignored once the alarm cleared. A pass now
    first asks whether the broker confirms a publish; while it does not, silence counts not."""
    amqp_url = private_rabbit.url
    # a limit of 13 s: `rabbitmqctl` takes seconds to set the alarm (CI under load: over the
    # 3 s a 2 s limit gave, and the watchdog rightly failed the task before the alarm; another
    # rabbitmqctl, stop_app, took 9 s in one loaded run)
    service = platform.service(taskTimeout=12, maxAttempts=1)
    _, out, task_id = _a_task_in_progress(procs, platform, database_url, amqp_url, service)

    private_rabbit.ctl("set_vm_memory_high_watermark", "0.0001")  # every publisher blocked
    try:
        time.sleep(28)  # over twice the task's limit and margin
        assert _status(platform, task_id) == "IN_PROGRESS"
    finally:
        private_rabbit.ctl("set_vm_memory_high_watermark", "0.4")
    done = TaskEvent(EventKind.SUCCEEDED, task_id, response={"held": "through the alarm"})
    asyncio.run(_publish(amqp_url, service.name, out, done))
    _eventually(lambda: _status(platform, task_id) != "IN_PROGRESS", 20, "finished")
    assert _status(platform, task_id) == "SUCCESS"


def _a_task_in_progress(
    procs: Processes, platform: Platform, database_url: str, amqp_url: str, service: Service
) -> tuple[GatewayProcess, str, str]:
    """A gateway whose watchdog looks every 0.3 s with a margin of 1 s, and a task of
    `service` its worker said `started` for (and nothing more): the gateway, the service's
    `-out` and the task's id."""
    env = gateway_env(
        database_url, amqp_url, CONVEYOR_SILENCE_MARGIN="1", CONVEYOR_REAPER_INTERVAL="0.3"
    )
    gateway = GatewayProcess(procs, env)
    out = topology.out_queue(service.queue_name)
    _eventually(lambda: _consumers(amqp_url, out) == 1, 20, "consuming -out")
    with gateway.http(service.clients[0]) as http:
        answer = http.post(gateway.tasks_url(service.name), json={"body": {}})
    assert answer.status_code == 201, answer.text
    task_id = answer.json()["data"]["taskId"]
    asyncio.run(_publish(amqp_url, service.name, out, TaskEvent(EventKind.STARTED, task_id)))
    _eventually(lambda: _status(platform, task_id) == "IN_PROGRESS", 10, "started")
    return gateway, out, task_id


async def _publish(amqp_url: str, service: str, queue: str, event: TaskEvent) -> None:
    wire = encode_event(event, service)
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.default_exchange.publish(
            aio_pika.Message(wire.body, headers=wire.headers, content_type=wire.content_type),
            routing_key=queue,
        )


def _close_connections_of(node: RabbitNode, user: str) -> int:
    """Every connection `user` has on the node closed by the broker, as a restart drops it."""
    lines = node.ctl("list_connections", "-q", "--no-table-headers", "pid", "user").splitlines()
    pids = [line.split()[0] for line in lines if line.split()[1:] == [user]]
    for pid in pids:
        node.ctl("close_connection", pid, "a test's reconnection")
    return len(pids)


def test_a_permission_narrowed_on_one_service_stalls_no_other_at_a_reconnection(
    procs: Processes,
    platform: Platform,
    database_url: str,
    private_rabbit: RabbitNode,
) -> None:
    """Found by a RabbitMQ sweep: a user's read permission narrowed to leave out one service's
    `-dlq` stalled every service of the gateway at its next reconnection. aio-pika restores a
    channel with every consumer or none, and a refused one made the whole connection's restore
    fail, again every second: no result of any service applied, no submission published. Now
    that service alone waits (named in /readyz), and is consumed again once it may be."""
    node, admin_url = private_rabbit, private_rabbit.url
    user, password = f"gw-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    node.ctl("add_user", user, password)
    node.ctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
    url = admin_url.replace("guest:guest", f"{user}:{password}")
    refused, other = platform.service(), platform.service()
    env = gateway_env(database_url, url, CONVEYOR_SERVICE_REFRESH_INTERVAL="1")
    gateway = GatewayProcess(procs, env)
    queues = [topology.out_queue(s.queue_name) for s in (refused, other)]
    for queue in queues:
        _eventually(lambda q=queue: _consumers(admin_url, q) == 1, 30, f"consuming {queue}")

    dlq = topology.dead_letter_queue(refused.queue_name)
    node.ctl("set_permissions", "-p", "/", user, ".*", ".*", f"^(?!{re.escape(dlq)}$).*")
    try:
        assert _close_connections_of(node, user) >= 1
        _eventually(lambda: _consumers(admin_url, queues[1]) == 1, 30, "the other consumed")
        _result_applied(gateway, admin_url, other, other.queue_name)

        def reported() -> str:
            services = httpx.get(f"{gateway.url}/readyz").json()["data"].get("services", {})
            return str(services.get(refused.name, ""))

        _eventually(lambda: "ACCESS_REFUSED" in reported(), 20, "the refusal reported", reported)
    finally:
        node.ctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
    _eventually(lambda: _consumers(admin_url, dlq) == 1, 30, "the -dlq consumed again")
    _result_applied(gateway, admin_url, refused, refused.queue_name)
    _eventually(lambda: reported() == "", 20, "the refusal no longer reported", reported)
