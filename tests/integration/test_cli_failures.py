"""A command that meets a database it cannot use says so in one line, exit 1, and prints
nothing else (no library's start-up chatter): not reachable, not migrated, a revision this
version does not know. Real `conveyor` processes, a real
PostgreSQL (a database of the test's own, or a port nothing listens on)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.amqp import scratch_database
from tests.support.processes import REPO, free_port


def conveyor(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", *args],
        cwd=REPO,
        env={**os.environ, "CONVEYOR_DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.strip() == "", done.stdout[-3000:]  # nothing besides that line
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("command", [["db", "upgrade"], ["admin", "list"], ["purge"]])
def test_a_database_nobody_listens_for_is_one_line(command: list[str]) -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/conveyor"
    assert "cannot use the database" in one_error_line(conveyor(url, *command))


@pytest.mark.parametrize(
    "command", [["admin", "list"], ["admin", "client", "create", "someone"], ["purge"]]
)
def test_a_database_not_migrated_says_what_to_run(database_url: str, command: list[str]) -> None:
    with scratch_database(database_url, migrate=False) as url:
        assert "conveyor db upgrade" in one_error_line(conveyor(url, *command))


def test_a_revision_this_version_does_not_know_is_one_line(database_url: str) -> None:
    with scratch_database(database_url) as url:
        line = one_error_line(conveyor(url, "db", "upgrade", "nosuchrev"))
        assert "nosuchrev" in line
