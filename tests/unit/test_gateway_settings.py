"""The gateway's settings refuse values it cannot run with, at start, in one line.

Found by a black-box test: most numeric CONVEYOR_* settings took 0, negative or NaN values
and the gateway started and misbehaved quietly: RELAY_INTERVAL=0 spun a core with nothing
to do, PENDING_TTL=nan made every submission 500, PENDING_TTL=0 accepted tasks that never
ran. The values that were refused came out as a 44-line traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from conveyor.settings import GatewaySettings
from tests.support.processes import REPO

HOSTILE = [
    ("RELAY_INTERVAL", "0"),
    ("RELAY_INTERVAL", "-1"),
    ("REAPER_INTERVAL", "0"),
    ("SERVICE_REFRESH_INTERVAL", "0"),
    ("PENDING_TTL", "nan"),
    ("PENDING_TTL", "0"),
    ("PUBLISH_TIMEOUT", "nan"),
    ("DB_TIMEOUT", "inf"),
    ("CALLBACK_LEASE", "nan"),
    ("CALLBACK_CONCURRENCY", "0"),
    ("CALLBACK_ATTEMPTS", "0"),
    ("CALLBACK_TIMEOUT", "-1"),
    ("DELIVERY_LIMIT", "-1"),
    ("DB_POOL_SIZE", "0"),
    ("MAX_BODY_BYTES", "0"),
    ("MAX_BATCH_ITEMS", "0"),
    ("PURGE_BATCH_SIZE", "0"),
    ("RESULTS_MEMORY", "0"),
    ("SILENCE_MARGIN", "-5"),
    ("PENDING_TTL", "1e300"),
    ("AMQP_HEARTBEAT", "65536"),  # AMQP carries a heartbeat in 16 bits
    ("DATABASE_URL", "garbage"),  # libpq reads neither a URL nor a conninfo in it
    ("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/"),  # no database named
    ("DATABASE_URL", "host=127.0.0.1 user=postgres"),
    # Found by a sweep of the configuration: each started a gateway that then failed for ever
    ("LOG_LEVEL", "garbage"),  # a 46-line traceback from logging
    ("LOG_LEVEL", ""),
    ("DB_TIMEOUT", "2592000"),  # 30 days: PostgreSQL's statement_timeout is an int of ms
    ("DELIVERY_LIMIT", "99999999999999999999"),  # no header holds it: nothing published
    ("AMQP_URL", ""),  # retried for ever, /readyz 503, where the dispatcher refused it
    ("AMQP_URL", "garbage"),
    ("AMQP_URL", " ; "),
    ("AMQP_URL", "http://127.0.0.1:5672/"),  # used as AMQP, silently
    ("AMQP_URL", "amqp://127.0.0.1:5672/;http://127.0.0.1:5673/"),
    ("AMQP_URL", "amqp:///vhost"),  # no host
    ("AMQP_URL", "amqp://127.0.0.1:99999/"),
    ("DATABASE_URL", "mysql://root@127.0.0.1/conveyor"),  # used as PostgreSQL, silently
    ("RELAY_INTERVAL", "0.000000001"),  # half a core idle, thousands of transactions a second
    ("QUEUE_CHECK_INTERVAL", "1e-9"),
    ("SERVICE_REFRESH_INTERVAL", "1e-9"),
]

ACCEPTED = [
    ("LOG_LEVEL", " debug "),
    ("LOG_LEVEL", "warn"),
    ("DB_TIMEOUT", "2147483"),
    ("DELIVERY_LIMIT", str(2**31 - 1)),
    ("AMQP_URL", "amqps://u:p@rabbit-0.rabbit:5671/v; amqp://rabbit-1;"),
    ("DATABASE_URL", "postgres://postgres@127.0.0.1/conveyor"),
    ("DATABASE_URL", "postgresql+psycopg://postgres@a,b/conveyor?target_session_attrs=read-write"),
    ("DATABASE_URL", "host=127.0.0.1 user=postgres dbname=conveyor"),
    # a value of a conninfo string holding `://` is no URL scheme (a sweep: refused)
    ("DATABASE_URL", "host=127.0.0.1 user=postgres password=ab://cd dbname=conveyor"),
    ("LOG_LEVEL", "Fatal"),
    ("RELAY_INTERVAL", "0.01"),
]


@pytest.mark.parametrize(("name", "value"), HOSTILE)
def test_values_the_gateway_cannot_run_with_are_refused(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(f"CONVEYOR_{name}", value)
    with pytest.raises(ValidationError):
        GatewaySettings()


def test_the_defaults_are_accepted() -> None:
    GatewaySettings()


@pytest.mark.parametrize(("name", "value"), ACCEPTED)
def test_the_spellings_and_limits_that_work_are_accepted(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(f"CONVEYOR_{name}", value)
    GatewaySettings()


def test_a_refused_setting_is_one_line_naming_it() -> None:
    env = {
        **os.environ,
        "CONVEYOR_RELAY_INTERVAL": "0",
        "CONVEYOR_PENDING_TTL": "nan",
        "CONVEYOR_LOG_LEVEL": "verbose",
    }
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "gateway", "--port", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 3, done.stderr[-2000:]
    assert any("CONVEYOR_RELAY_INTERVAL" in line for line in lines), lines
    assert any("CONVEYOR_PENDING_TTL" in line for line in lines), lines
    assert any("CONVEYOR_LOG_LEVEL" in line for line in lines), lines
