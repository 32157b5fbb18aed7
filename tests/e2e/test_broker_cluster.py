"""A 3-node RabbitMQ cluster of the test's own (SPEC §11.7), quick pass: a node killed, a
node frozen, the node of the results queue down, with Conveyor given the node list or one
address in front of the cluster (a TCP proxy standing in for a Kubernetes Service).

Every accepted task must end SUCCESS with the function's answer, though the delivery limit
is 1: a node loss is not the task's failure. The stalls are printed (the full runs and their
figures are `make chaos`'s).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest

from conveyor import topology
from tests.e2e.conftest import Stack
from tests.support.amqp import scratch_database
from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes
from tests.support.servers import RabbitCluster, RabbitNode, rabbitmq_available
from tests.support.tcpproxy import TcpProxy

HEARTBEAT = "5"


@pytest.fixture(scope="module")
def cluster() -> Iterator[RabbitCluster]:
    if not rabbitmq_available():
        pytest.skip("rabbitmq-server is not installed here: no private cluster to break")
    made = RabbitCluster(3).start()
    yield made
    made.stop()


@pytest.fixture(scope="module")
def database_url(database_url: str) -> Iterator[str]:
    """A database of this module's own: gateways that share a database must share a broker,
    and the session's gateway (on the shared broker) would otherwise declare these services'
    queues on its broker and relay their unpublished tasks there, where nobody takes them."""
    with scratch_database(database_url) as url:
        yield url


@pytest.fixture(scope="module")
def platform(database_url: str) -> Platform:
    return Platform(database_url)


@pytest.fixture(scope="module")
def service_address(cluster: RabbitCluster) -> Iterator[str]:
    """One address in front of the three nodes."""
    first, *others = cluster.nodes
    proxy = TcpProxy("127.0.0.1", first.port, [("127.0.0.1", n.port) for n in others])
    yield f"amqp://guest:guest@127.0.0.1:{proxy.port}/"
    proxy.close()


def _stack(
    procs: Processes,
    platform: Platform,
    database_url: str,
    sleeper_url: str,
    amqp_url: str,
    name: str,
) -> Stack:
    env = gateway_env(
        database_url,
        amqp_url,
        CONVEYOR_AMQP_HEARTBEAT=HEARTBEAT,
        CONVEYOR_OUTBOX_KEEP_CONFIRMED="5",
        # One return more than this and the broker dead-letters a submission: every node
        # loss spends one on the messages its consumers held, a crash would spend one too.
        # Tasks must still end SUCCESS (returns without a started attempt are given back).
        CONVEYOR_DELIVERY_LIMIT="1",
    )
    gateway = GatewayProcess(procs, env, f"gateway-{name}")
    service = platform.service(
        jsonSchema={"type": "object", "required": ["sleep"]}, taskTimeout=60, maxAttempts=3
    )
    stack = Stack(procs, gateway, sleeper_url, amqp_url, service)
    for pod in ("pod-a", "pod-b"):
        stack.dispatcher(f"{name}-{pod}", CONCURRENCY="8", AMQP_HEARTBEAT=HEARTBEAT)
    time.sleep(3)  # the queues' replicas settle before a node goes
    return stack


def _all_succeed(stack: Stack, task_ids: list[str], timeout: float) -> Counter[str]:
    deadline = time.monotonic() + timeout
    statuses: Counter[str] = Counter()
    while time.monotonic() < deadline:
        polled = [stack.poll(t) for t in task_ids]
        statuses = Counter(p["status"] for p in polled)
        if statuses["SUCCESS"] == len(task_ids):
            assert all(p["response"] == {"hello": "world"} for p in polled)
            break
        time.sleep(0.5)
    return statuses


def _leader(cluster: RabbitCluster, queue: str) -> RabbitNode:
    deadline = time.monotonic() + 30
    while True:
        try:
            return cluster.leader(queue)
        except LookupError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("address", ["node list", "one address"])
def test_the_task_queue_leader_killed_loses_nothing(
    address: str,
    procs: Processes,
    platform: Platform,
    database_url: str,
    sleeper_url: str,
    cluster: RabbitCluster,
    service_address: str,
) -> None:
    url = cluster.urls if address == "node list" else service_address
    stack = _stack(procs, platform, database_url, sleeper_url, url, address.split()[0])
    task_ids = [stack.submit({"sleep": 0.05}) for _ in range(40)]
    leader = _leader(cluster, topology.in_queue(stack.service.queue_name))
    leader.kill()
    try:
        task_ids += [stack.submit({"sleep": 0.05}) for _ in range(40)]  # while it is down
    finally:
        leader.start()
        cluster.wait_healthy()
    task_ids += [stack.submit({"sleep": 0.05}) for _ in range(20)]
    assert _all_succeed(stack, task_ids, 120) == Counter({"SUCCESS": 100})
    stack.http.close()


@pytest.mark.timeout(300)
def test_the_results_queue_node_down_stalls_nothing(
    procs: Processes,
    platform: Platform,
    database_url: str,
    sleeper_url: str,
    cluster: RabbitCluster,
) -> None:
    stack = _stack(procs, platform, database_url, sleeper_url, cluster.urls, "results")
    down = _leader(cluster, topology.out_queue(stack.service.queue_name))
    down.kill()
    try:
        started = time.monotonic()
        task_ids = [stack.submit({"sleep": 0.05}) for _ in range(30)]
        statuses = _all_succeed(stack, task_ids, 30)
        print(f"results node down: 30 tasks done {time.monotonic() - started:.1f} s after")
        assert statuses == Counter({"SUCCESS": 30})  # while that node is still down
    finally:
        down.start()
        cluster.wait_healthy()
    stack.http.close()


@pytest.mark.timeout(300)
def test_a_frozen_node_stalls_tasks_for_less_than_45_seconds(
    procs: Processes,
    platform: Platform,
    database_url: str,
    sleeper_url: str,
    cluster: RabbitCluster,
) -> None:
    stack = _stack(procs, platform, database_url, sleeper_url, cluster.urls, "frozen")
    frozen = _leader(cluster, topology.in_queue(stack.service.queue_name))
    frozen.freeze()  # no socket closes: only heartbeats and net_ticktime tell
    try:
        started = time.monotonic()
        task_ids = [stack.submit({"sleep": 0.05}) for _ in range(30)]
        statuses = _all_succeed(stack, task_ids, 45)
        print(f"frozen node: 30 tasks done {time.monotonic() - started:.1f} s after the freeze")
        assert statuses == Counter({"SUCCESS": 30})  # all of it while the node is still frozen
    finally:
        # Back from a freeze the node is partitioned from the others until autoheal restarts
        # it (about a minute): this test comes last and the module's cluster is then discarded.
        frozen.thaw()
    stack.http.close()
