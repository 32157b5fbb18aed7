"""What the CLI reads from a file or stdin is bounded (conveyor/cli/input_files.py): an input
that never ends is one line and an exit, never a MemoryError after all memory is taken."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from tests.support.processes import REPO

# Far below what an unbounded read of /dev/zero asks for, well above what the CLI needs.
ADDRESS_SPACE = 1536 * 2**20


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(["task", "submit", "svc", "--body", "@/dev/zero"], id="task --body @file"),
        pytest.param(["task", "submit", "svc", "--body", "-"], id="task --body stdin"),
        pytest.param(["admin", "apply", "-f", "/dev/zero"], id="admin apply"),
        pytest.param(["admin", "service", "create", "s", "--schema", "/dev/zero"], id="--schema"),
        pytest.param(["inject", "-f", "-"], id="inject stdin"),
    ],
)
def test_an_endless_input_is_one_line_and_an_exit(command: list[str]) -> None:
    """Found by a black-box sweep: `--body @/dev/zero` (and `admin apply -f /dev/zero`) read
    until memory ran out, then printed a MemoryError's traceback."""
    env = {
        **os.environ,
        "CONVEYOR_GATEWAY_URL": "http://127.0.0.1:9",
        "CONVEYOR_CLIENT_ID": "u",
        "CONVEYOR_CLIENT_SECRET": "p",
        "CONVEYOR_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:9/none",
        "CONVEYOR_AMQP_URL": "amqp://guest:guest@127.0.0.1:9/",
    }
    with open("/dev/zero", "rb") as zeros:
        done = subprocess.run(
            [sys.executable, "-m", "conveyor", *command],
            cwd=REPO,
            env=env,
            stdin=zeros,
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=_limited,
            check=False,
        )
    assert done.returncode in (1, 2), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr, done.stderr[-2000:]
    assert "characters" in done.stderr, done.stderr[-2000:]
