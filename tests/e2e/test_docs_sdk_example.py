"""The SDK example of docs/api.md ("The Python SDK") runs as written against the real stack:
a new user's first program must not be the first to find that the docs drifted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack
from tests.support.gateway import GatewayProcess, Platform
from tests.support.processes import Processes

DOCS = Path(__file__).parents[2] / "docs" / "api.md"


def _example() -> str:
    section = DOCS.read_text().split("## The Python SDK", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "docs/api.md has no Python example under 'The Python SDK'"
    return found[1]


@pytest.mark.timeout(120)
def test_the_sdk_example_of_the_api_docs_runs_as_written(
    procs: Processes,
    e2e_gateway: GatewayProcess,
    sleeper_url: str,
    amqp_url: str,
    platform: Platform,
) -> None:
    number = {"type": "object", "required": ["sleep"], "properties": {"sleep": {"type": "number"}}}
    service = platform.service(jsonSchema=number, taskTimeout=60, maxAttempts=3)
    stack = Stack(procs, e2e_gateway, sleeper_url, amqp_url, service)
    stack.dispatcher("docs-example")
    client = service.clients[0]
    program = _example().replace('"sleeper"', repr(service.name))
    ran = subprocess.run(
        [sys.executable, "-c", program],
        env={
            **os.environ,
            "CONVEYOR_GATEWAY_URL": e2e_gateway.url,
            "CONVEYOR_CLIENT_ID": client.client_id,
            "CONVEYOR_CLIENT_SECRET": client.secret,
        },
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    lines = ran.stdout.splitlines()
    statuses = [line.split()[0] for line in lines[:-2]]
    assert statuses[-1] == "SUCCESS" and set(statuses) <= {"PENDING", "IN_PROGRESS", "SUCCESS"}
    assert lines[-2].startswith("True ")  # succeeded, its response, no error message
    assert lines[-1].startswith("400 400001 [{'path': 'body/sleep'")
    stack.http.close()
