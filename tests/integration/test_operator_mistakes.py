"""Operator mistakes are refused clearly, before they can do harm: no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.gateway import gateway_env
from tests.support.processes import REPO


def _conveyor(
    *args: str, env: dict[str, str], stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conveyor", *args],
        cwd=REPO,
        env={**os.environ, **env},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_gateway_will_not_start_without_a_signing_secret(
    database_url: str, amqp_url: str
) -> None:
    for secret in ("", "change-me", "short"):
        env = {**gateway_env(database_url, amqp_url), "CONVEYOR_CALLBACK_SIGNING_SECRET": secret}
        done = _conveyor("gateway", "--port", "1", env=env)
        assert done.returncode == 2, done.stderr
        assert "CONVEYOR_CALLBACK_SIGNING_SECRET" in done.stderr
        assert "Traceback" not in done.stderr
    env = {
        **gateway_env(database_url, amqp_url),
        "CONVEYOR_CALLBACK_PREVIOUS_SIGNING_SECRET": "short",
    }
    done = _conveyor("gateway", "--port", "1", env=env)
    assert done.returncode == 2, done.stderr
    assert "CONVEYOR_CALLBACK_PREVIOUS_SIGNING_SECRET" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_secret_bcrypt_cannot_hold_is_refused_by_apply(database_url: str, tmp_path: Path) -> None:
    platform = tmp_path / "platform.yaml"
    platform.write_text("clients:\n  - id: too-long\n    secret: " + "s" * 100 + "\n")
    done = _conveyor(
        "admin",
        "apply",
        "-f",
        str(platform),
        "--no-declare",
        env={"CONVEYOR_DATABASE_URL": database_url},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "72 bytes" in done.stderr and "clients" in done.stderr
    assert "Traceback" not in done.stderr
