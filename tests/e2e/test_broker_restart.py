"""A RabbitMQ restart in the middle of 200 tasks loses none of them."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from tests.e2e.conftest import Stack
from tests.support.broker import require_local_broker, restart_rabbitmq


@pytest.mark.timeout(300)
def test_rabbitmq_restart_during_200_tasks_loses_none(stack: Stack) -> None:
    require_local_broker()
    stack.dispatcher("pod-a", CONCURRENCY="8")
    stack.dispatcher("pod-b", CONCURRENCY="8")
    task_ids = [stack.submit({"sleep": 0.05}) for _ in range(100)]
    restarter = threading.Thread(target=restart_rabbitmq)
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
    assert statuses == Counter({"SUCCESS": 200})
