"""A test's cleanup must not break the gateway the next test uses.

CI once failed `test_operations_endpoints` with /readyz at 503, `broker: false`: the test
before it had removed its service while the shared gateway was declaring that service's
quorum queues. RabbitMQ 3.10 answers a queue deleted during its declaration by crashing the
declaring channel, which closes the gateway's whole connection (INTERNAL_ERROR) for the 5 s
before it reconnects. `remove_service` now leaves the queues `REMOVAL_GRACE` seconds more.
"""

from __future__ import annotations

import random
import time

import httpx

from tests.support.amqp import REMOVAL_GRACE, remove_due_topologies, remove_service
from tests.support.gateway import GatewayProcess, Platform


def test_removing_services_while_the_gateway_declares_them_keeps_it_connected(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    rng = random.Random(12)
    disconnected = []
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        for cycle in range(10):
            services = [platform.service() for _ in range(8)]
            # The gateway's refresh (every 0.3 s in tests) declares new services one after the
            # other; removing eight one after the other overlaps some of those declarations.
            time.sleep(rng.uniform(0.0, 0.35))
            for service in services:
                remove_service(platform, amqp_url, service)
            if not http.get("/readyz").json()["data"]["checks"]["broker"]:
                disconnected.append(cycle)
    time.sleep(REMOVAL_GRACE)
    remove_due_topologies()  # eighty services' queues: gone now, not at some later removal
    assert disconnected == [], f"the gateway lost its broker connection after cycles {disconnected}"
