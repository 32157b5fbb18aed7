"""Policies an operator applies to a service's queues under a running gateway (found by a
sweep on a private node).

A `message-ttl` policy on `-in` dead-letters the submissions no dispatcher took in time, with
the reason `expired`, the one their own time to live gives: their tasks failed "stayed PENDING
longer than its time to live" after less than a second, the policy unnamed. On the run's own
RabbitMQ node; the policy is cleared whatever happens.
"""

from __future__ import annotations

import pytest

from conveyor import topology
from tests.support.amqp import queues_of, wait_for_queues, wait_until
from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes
from tests.support.servers import RabbitNode

pytestmark = pytest.mark.timeout(120)


def test_a_message_ttl_policy_on_in_fails_its_tasks_naming_the_queue_not_their_time_to_live(
    procs: Processes, alone: str, private_rabbit: RabbitNode
) -> None:
    amqp_url = private_rabbit.url
    platform = Platform(alone)
    service = platform.service()
    gateway = GatewayProcess(procs, gateway_env(alone, amqp_url), "gateway-policy")
    wait_for_queues(amqp_url, queues_of(service.queue_name), timeout=30)
    policy = f"ttl-{service.queue_name}"
    pattern = f"^{topology.in_queue(service.queue_name)}$"
    private_rabbit.ctl(
        "set_policy", policy, pattern, '{"message-ttl": 200}', "--apply-to", "queues"
    )
    try:
        with gateway.http(service.clients[0]) as http:
            answer = http.post(gateway.tasks_url(service.name), json={"body": {"n": 1}})
            assert answer.status_code == 201, answer.text
            task_url = f"{gateway.tasks_url(service.name)}/{answer.json()['data']['taskId']}"

            def ended() -> dict[str, str] | None:
                data = http.get(task_url).json()["data"]
                return data if data["status"] == "FAILURE" else None

            data = wait_until(ended, 30, what="the task failed")
    finally:
        private_rabbit.ctl("clear_policy", policy)
    message = data["errorMessage"]
    assert "time to live" not in message or "before" in message, message
    assert "message TTL" in message, message
