"""No task body, callback URL or Idempotency-Key reaches a log line or `/readyz` through a
database error: PostgreSQL's DETAIL quotes the row it refused ("Failing row contains (…)"),
and psycopg's exception text carries it. Found by a black-box test, which saw whole task rows
in the gateway's log (twice per refused submission: its handler and uvicorn's) and in the
unauthenticated `/readyz`.

The refusals are made by a CHECK constraint on the test's own database (NOT VALID: only new
row versions are checked), standing for any constraint, trigger or value the database refuses.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import psycopg
import pytest

from conveyor import logs
from gateway.database_url import libpq
from gateway.supervisor import Supervisor
from tests.support.amqp import scratch_database
from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes

MARK = "BODYMARK" + uuid.uuid4().hex[:8]


def _refuse_marked_rows(url: str, rule: str) -> None:
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute(f"ALTER TABLE tasks ADD CONSTRAINT refuses CHECK ({rule}) NOT VALID")


def _submit(gateway: GatewayProcess, svc: object, key: str) -> tuple[int, dict]:
    with gateway.http(svc.clients[0]) as http:  # type: ignore[attr-defined]
        answer = http.post(
            gateway.tasks_url(svc.name),  # type: ignore[attr-defined]
            json={
                "body": {"tag": MARK},
                "callback": {"url": f"http://localhost:9/cb?m={MARK}", "type": "http"},
            },
            headers={"Idempotency-Key": f"{MARK}-{key}"},
        )
        return answer.status_code, answer.json()


def test_a_refused_submission_logs_no_task_data(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    with scratch_database(database_url) as url:
        svc = Platform(url).service()
        _refuse_marked_rows(url, f"request::text NOT LIKE '%{MARK}%'")
        gateway = GatewayProcess(procs, gateway_env(url, amqp_url))
        status, answer = _submit(gateway, svc, "one")
        assert (status, answer["error"]["number"]) == (500, 500001), answer
        time.sleep(0.5)
        log = gateway.proc.logs()
        assert "violates check constraint" in log  # the error is still said
        assert MARK not in log


def test_a_reaper_failing_every_pass_is_named_in_readyz_and_logs_no_task_data(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    with scratch_database(database_url) as url:
        svc = Platform(url).service()
        gateway = GatewayProcess(procs, gateway_env(url, amqp_url, CONVEYOR_REAPER_INTERVAL="0.3"))
        status, answer = _submit(gateway, svc, "two")
        assert status == 201, answer
        # The reaper's pass fails on this task: it may not leave PENDING, and it expired.
        _refuse_marked_rows(url, f"request::text NOT LIKE '%{MARK}%' OR status = 'PENDING'")
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute("UPDATE tasks SET expires_at = now() - interval '1 hour'")
        deadline = time.monotonic() + 20
        while "reaper pass failed" not in gateway.proc.logs() and time.monotonic() < deadline:
            time.sleep(0.3)
        log = gateway.proc.logs()
        assert "reaper pass failed" in log
        assert "violates check constraint" in log
        assert MARK not in log

        # Found by the same test: a loop failing every pass was invisible. It is named under
        # `failing` now, and counted, without turning /readyz 503 (the API still serves).
        with gateway.http() as http:
            ready = http.get("/readyz")
            assert ready.status_code == 200, ready.text
            assert "violates check constraint" in ready.json()["data"]["failing"]["reaper"]
            assert MARK not in ready.text
            assert (
                'conveyor_gateway_loop_failures_total{loop="reaper"}' in http.get("/metrics").text
            )
            with psycopg.connect(libpq(url), autocommit=True) as conn:
                conn.execute("ALTER TABLE tasks DROP CONSTRAINT refuses")
            deadline = time.monotonic() + 20
            while "failing" in http.get("/readyz").json()["data"] and time.monotonic() < deadline:
                time.sleep(0.3)
            assert "failing" not in http.get("/readyz").json()["data"]
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            (status,) = conn.execute("SELECT status FROM tasks").fetchone()  # type: ignore[misc]
        assert status == "FAILURE"  # expired, once the pass could write it


def test_a_crashed_loop_names_its_error_without_task_data(database_url: str) -> None:
    """`/readyz` serves what the supervisor keeps of a crashed loop's error; the log line
    carries its traceback."""
    with scratch_database(database_url) as url:
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute("CREATE TABLE probe (a int CHECK (a > 0), b text)")

        async def loop() -> None:
            async with await psycopg.AsyncConnection.connect(libpq(url)) as conn:
                await conn.execute("INSERT INTO probe VALUES (-1, %s)", (MARK,))

        async def crash_once() -> dict[str, str]:
            supervisor = Supervisor(backoff=5, backoff_max=5)
            supervisor.spawn("probe", loop)
            for _ in range(100):
                await asyncio.sleep(0.05)
                if supervisor.down():
                    break
            down = supervisor.down()
            await supervisor.stop()
            return down

        down = asyncio.run(crash_once())
        assert "violates check constraint" in down["probe"], down
        assert MARK not in down["probe"]


def test_a_logged_database_error_says_its_primary_message_only(database_url: str) -> None:
    """The formatter's traceback and `describe`, for an error alone, in a chain, in a group."""
    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE t (a int CHECK (a > 0), b text)")
        with pytest.raises(psycopg.Error) as refused:
            conn.execute("INSERT INTO t VALUES (-1, %s)", (MARK,))
        with pytest.raises(psycopg.Error) as unreadable:
            conn.execute("SELECT %s::uuid", (MARK,))
    error = refused.value
    try:  # one exception at two places of a chain: a group's member and its cause
        raise ExceptionGroup("g", [error]) from error
    except ExceptionGroup as group:
        text = logs.format_exception((type(group), group, group.__traceback__))
    assert text.count("violates check constraint") == 2 and MARK not in text, text
    for error in (refused.value, unreadable.value):
        assert MARK in str(error)  # what psycopg says, and what must not be written
        assert MARK not in logs.describe(error)
        try:
            raise ExceptionGroup("loop", [RuntimeError("wrapped")]) from error
        except ExceptionGroup as group:
            text = logs.format_exception((type(group), group, group.__traceback__))
            described = logs.describe(ExceptionGroup("g", [error]))
        assert type(error).__name__ in text and MARK not in text, text
        assert type(error).__name__ in described and MARK not in described
        assert MARK not in logs.reason(error)
