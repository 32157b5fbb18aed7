"""A RabbitMQ restart, clean or a crash, in the middle of 200 tasks loses none of them.

On a private node (the machine's shared broker is never touched): the gateway and
the dispatchers of this test talk to it only, on a database of their own. Gateways that
share a database must share a broker: the session's gateway (on the shared broker) would
otherwise declare this test's queues on its own broker and relay this test's unpublished
tasks there, where no dispatcher takes them.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest

from tests.e2e.conftest import Stack
from tests.support.amqp import scratch_database
from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes
from tests.support.servers import RabbitNode


def _crash(node: RabbitNode) -> None:
    node.kill()
    time.sleep(1.0)
    node.start()


FAULTS: dict[str, Callable[[RabbitNode], None]] = {
    "clean restart": lambda node: node.restart(down_for=2.0),
    "crash (SIGKILL)": _crash,
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_rabbitmq_restart_during_200_tasks_loses_none(
    fault: str,
    procs: Processes,
    database_url: str,
    sleeper_url: str,
    private_rabbit: RabbitNode,
) -> None:
    with scratch_database(database_url) as url:
        try:
            _restart_during_200_tasks(fault, procs, Platform(url), url, sleeper_url, private_rabbit)
        finally:
            procs.stop_all()  # before the database goes


def _restart_during_200_tasks(
    fault: str,
    procs: Processes,
    platform: Platform,
    database_url: str,
    sleeper_url: str,
    private_rabbit: RabbitNode,
) -> None:
    env = gateway_env(
        database_url, private_rabbit.url, CONVEYOR_OUTBOX_KEEP_CONFIRMED="5"
    )  # a crashed node may lose what it confirmed in its last seconds
    gateway = GatewayProcess(procs, env, f"gateway-{fault.split()[0]}")
    service = platform.service(
        jsonSchema={"type": "object", "required": ["sleep"]}, taskTimeout=60, maxAttempts=3
    )
    stack = Stack(procs, gateway, sleeper_url, private_rabbit.url, service)
    stack.dispatcher("pod-a", CONCURRENCY="8")
    stack.dispatcher("pod-b", CONCURRENCY="8")
    # A quorum queue declared moments before a node crash can come back unusable (seen with
    # RabbitMQ 3.10 on one node); a deployment's queues are older than that.
    time.sleep(6)
    task_ids = [stack.submit({"sleep": 0.05}) for _ in range(100)]
    restarter = threading.Thread(target=FAULTS[fault], args=(private_rabbit,))
    restarter.start()
    # Submissions keep arriving while the broker is away: the outbox holds them.
    while restarter.is_alive() and len(task_ids) < 200:
        task_ids.append(stack.submit({"sleep": 0.05}))
        time.sleep(0.01)
    restarter.join()
    while len(task_ids) < 200:
        task_ids.append(stack.submit({"sleep": 0.05}))
    deadline = time.monotonic() + 120
    statuses: Counter = Counter()
    while time.monotonic() < deadline:
        statuses = Counter(stack.poll(t)["status"] for t in task_ids)
        if statuses["SUCCESS"] == len(task_ids):
            break
        time.sleep(1)
    stack.http.close()
    assert statuses == Counter({"SUCCESS": 200})
