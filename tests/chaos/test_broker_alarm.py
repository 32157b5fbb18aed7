"""A RabbitMQ memory alarm (the node blocks every publishing connection) while tasks are
submitted: answered at once, stored, and published once the alarm ends.

Found by a black-box test: every submission waited out CONVEYOR_PUBLISH_TIMEOUT for its
fast-path publish, which the blocked connection never confirmed, for as long as the alarm
lasted. A fast-path publish that times out now leaves the next ones to the relay for a while.
On the run's own RabbitMQ node; the alarm is lifted whatever happens.
"""

from __future__ import annotations

import time

import pytest

from conveyor import topology
from tests.support.amqp import message_count, queues_of, wait_for_queues
from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes
from tests.support.servers import RabbitNode

pytestmark = pytest.mark.timeout(180)

PUBLISH_TIMEOUT = 1.5


def test_submissions_during_a_memory_alarm_are_answered_and_published_after(
    procs: Processes, alone: str, private_rabbit: RabbitNode
) -> None:
    amqp_url = private_rabbit.url
    platform = Platform(alone)
    service = platform.service()
    env = gateway_env(alone, amqp_url, CONVEYOR_PUBLISH_TIMEOUT=str(PUBLISH_TIMEOUT))
    gateway = GatewayProcess(procs, env, "gateway-alarm")
    wait_for_queues(amqp_url, queues_of(service.queue_name), timeout=30)
    tasks_url = gateway.tasks_url(service.name)
    private_rabbit.ctl("set_vm_memory_high_watermark", "absolute", "1")
    try:
        time.sleep(2)  # the alarm reaches the connections
        waited = []
        with gateway.http(service.clients[0]) as http:
            for n in range(6):
                started = time.monotonic()
                answer = http.post(tasks_url, json={"body": {"n": n}}, timeout=30)
                waited.append(time.monotonic() - started)
                assert answer.status_code == 201, answer.text
        # The first one finds the broker blocked; the next ones do not wait for it.
        assert sum(w >= PUBLISH_TIMEOUT for w in waited) <= 1, waited
    finally:
        private_rabbit.ctl("set_vm_memory_high_watermark", "0.4")
    deadline = time.monotonic() + 60
    in_queue = topology.in_queue(service.queue_name)
    while (message_count(amqp_url, in_queue) or 0) < 6 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (message_count(amqp_url, in_queue) or 0) >= 6  # all published once it ended
    unpublished = platform.sql("SELECT count(*) FROM tasks WHERE publish_at IS NOT NULL")
    deadline = time.monotonic() + 30
    while unpublished != [(0,)] and time.monotonic() < deadline:
        time.sleep(0.5)
        unpublished = platform.sql("SELECT count(*) FROM tasks WHERE publish_at IS NOT NULL")
    assert unpublished == [(0,)]
