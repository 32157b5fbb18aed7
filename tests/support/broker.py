"""Restarting the real RabbitMQ, for the tests whose point is a broker restart.

Only possible when the broker is the local one managed by `rabbitmqctl`; tests
skip with that reason otherwise (e.g. CONVEYOR_AMQP_URL pointing elsewhere).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest


def require_local_broker() -> None:
    if os.environ.get("CONVEYOR_AMQP_URL"):
        pytest.skip("CONVEYOR_AMQP_URL points at a broker this test cannot restart")
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed: cannot restart the broker")


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def restart_rabbitmq(down_for: float = 2.0) -> None:
    """stop_app / start_app: every connection drops, durable queues and messages survive."""
    subprocess.run(["rabbitmqctl", "stop_app"], check=True, capture_output=True, timeout=60)
    time.sleep(down_for)
    subprocess.run(["rabbitmqctl", "start_app"], check=True, capture_output=True, timeout=120)
    subprocess.run(["rabbitmqctl", "await_startup"], check=False, capture_output=True, timeout=120)
    deadline = time.monotonic() + 60
    while not _port_open(5672):
        if time.monotonic() > deadline:
            raise TimeoutError("RabbitMQ did not come back")
        time.sleep(0.2)
