"""`conveyor gateway --port` outside 1..65535 is refused at start, exit 2, in one line naming
the option: `--port 85143` started and listened on 85143 - 65536 = 19607, somewhere nobody
looks. A real `conveyor` process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.gateway import gateway_env
from tests.support.processes import REPO


@pytest.mark.parametrize("port", ["85143", "65536", "0", "-1"])
def test_a_port_outside_1_to_65535_is_refused_in_one_line(
    database_url: str, amqp_url: str, port: str
) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "conveyor", "gateway", "--port", port],
        cwd=REPO,
        env={**os.environ, **gateway_env(database_url, amqp_url)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"--port {port} was not refused: it started\n{stderr[-2000:]}"
        ) from None
    assert process.returncode == 2, stderr[-2000:]
    assert stdout == ""
    assert stderr.strip().splitlines() == [f"error: --port must be from 1 to 65535, not {port}"]
