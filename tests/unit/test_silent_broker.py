"""A broker that accepts connections but never answers ends a test run at once, with the reason.

Found in CI: the machine's RabbitMQ held ~350 leftover queues of earlier runs, spent its file
handle budget and from then on left every new connection waiting in the handshake. Each test
then waited for its own timeout, and the run was cut off after 80 minutes without a word on
why. A listener that accepts and stays silent behaves the same way.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.support.processes import REPO

NEEDS_THE_BROKER = "tests/integration/test_admin_cli.py::test_unknown_key_is_refused_by_name"


@pytest.fixture
def silent_port() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(server.accept()[0])  # kept open, never written to
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for conn in accepted:
        conn.close()


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_silent_broker_ends_the_run_with_its_reason(silent_port: int, workers: list[str]) -> None:
    env = {**os.environ, "CONVEYOR_AMQP_URL": f"amqp://guest:guest@127.0.0.1:{silent_port}/"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *workers,
            NEEDS_THE_BROKER,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,  # the guard answers within ~15 s; without it this waits for test timeouts
    )
    output = done.stdout + done.stderr
    assert done.returncode == 3, output[-3000:]
    assert "does not complete a connection handshake" in output, output[-3000:]
    assert f"127.0.0.1:{silent_port}" in output
    assert "guest:guest" not in output  # the URL's password stays out of the message
