"""A gateway whose database is not (or not yet fully) migrated says so and what to run,
instead of answering every request 500; it serves once `conveyor db upgrade` has run.

Real processes on databases of the test's own (never the session's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import partial

import httpx
import pytest

from conveyor import topology
from conveyor.events import EventKind, TaskEvent, encode_event
from gateway.migrate import downgrade, upgrade
from tests.support.amqp import alter_database, publish, remove_service, scratch_database
from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes

UPGRADE = "conveyor db upgrade"


def _error(answer: httpx.Response) -> tuple[int, int]:
    return answer.status_code, answer.json()["error"]["number"]


def _ready_within(http: httpx.Client, seconds: float) -> httpx.Response:
    deadline = time.monotonic() + seconds
    while True:
        answer = http.get("/readyz")
        if answer.status_code == 200 or time.monotonic() > deadline:
            return answer
        time.sleep(0.3)


@pytest.mark.parametrize("revision", [None, "0012"], ids=["empty", "one-behind"])
def test_a_gateway_on_an_unmigrated_database_says_to_upgrade_then_serves(
    database_url: str, amqp_url: str, procs: Processes, revision: str | None
) -> None:
    with scratch_database(database_url, migrate=False) as url:
        if revision is not None:
            upgrade(url, revision)
        svc = Platform(url).service() if revision is not None else None
        gateway = GatewayProcess(procs, gateway_env(url, amqp_url))
        with gateway.http(svc.clients[0] if svc else None) as http:
            ready = http.get("/readyz")
            assert ready.status_code == 503, ready.text
            assert ready.json()["error"]["number"] == 503001  # in SPEC §3's envelope
            assert ready.json()["data"]["checks"]["schema"] is False
            assert UPGRADE in ready.json()["data"]["schema"]
            if revision is not None:
                assert "0012" in ready.json()["data"]["schema"]
            if svc is None:  # no clients table: not a 403
                answer = http.post(gateway.tasks_url("x"), json={"body": {}}, auth=("a", "b"))
            else:  # a column an idempotent submission needs is not there yet
                answer = http.post(
                    gateway.tasks_url(svc.name), json={"body": {}}, headers={"Idempotency-Key": "k"}
                )
            assert _error(answer) == (503, 503001), answer.text
            assert answer.headers["retry-after"] == "1"
            time.sleep(2)  # what the loops would log meanwhile, were they started
        log = gateway.proc.logs()
        assert UPGRADE in log
        assert "Traceback" not in log  # the loops wait for the schema instead of crashing

        upgrade(url)
        svc = svc or Platform(url).service()
        with gateway.http(svc.clients[0]) as http:
            assert _ready_within(http, 20).status_code == 200
            created = http.post(gateway.tasks_url(svc.name), json={"body": {}})
            assert created.status_code == 201, created.text

            downgrade(url, "0012")  # from under the running gateway
            ready = http.get("/readyz")
            assert ready.status_code == 503 and "0012" in ready.json()["data"]["schema"], ready.text


@pytest.mark.timeout(120)
def test_results_wait_for_a_schema_downgraded_under_a_running_gateway(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    """Found by a black-box sweep of a roll-back: `conveyor db downgrade` under a running
    gateway made it set aside every `started` as poison ("database refused it:
    UndefinedColumn"), acked, its task left PENDING while it ran. A statement that meets a
    schema older than the code is the database not ready, as when it is away: the results
    wait in `-out` and are applied once the schema is back."""
    with scratch_database(database_url) as url:
        platform = Platform(url)
        svc = platform.service()
        try:
            gateway = GatewayProcess(procs, gateway_env(url, amqp_url))
            with gateway.http(svc.clients[0]) as http:
                assert _ready_within(http, 20).status_code == 200
                created = http.post(gateway.tasks_url(svc.name), json={"body": {}})
                task_id = created.json()["data"]["taskId"]
                downgrade(url, "0014")  # a column a `started` writes is gone
                started = encode_event(TaskEvent(EventKind.STARTED, task_id), svc.name)
                publish(amqp_url, topology.out_queue(svc.queue_name), [started])
                time.sleep(4)
                assert platform.sql("SELECT count(*) FROM poison_messages") == [(0,)]
                upgrade(url)
                deadline = time.monotonic() + 30
                status = None
                while status != "IN_PROGRESS" and time.monotonic() < deadline:
                    time.sleep(0.3)
                    poll = http.get(f"{gateway.tasks_url(svc.name)}/{task_id}")
                    status = poll.json()["data"]["status"] if poll.status_code == 200 else None
                assert status == "IN_PROGRESS"
            assert platform.sql("SELECT count(*) FROM poison_messages") == [(0,)]
        finally:
            procs.stop_all()
            remove_service(platform, amqp_url, svc)


@pytest.mark.timeout(120)
def test_a_gateway_whose_schema_went_back_takes_no_result_until_it_is_back(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    """Found by a sweep of a roll-back: a gateway whose schema went back under it took the
    results its statements could still apply (the terminal events) while those they could not
    (`started`) went back to the broker, and once it had let them all go it took them again as
    soon as its catalog read answered; the previous release's gateways then dropped the
    `started` read after the end (30 tasks without an attempt). It takes none until its
    schema is back, and then applies them as read in order."""
    with scratch_database(database_url) as url:
        platform = Platform(url)
        svc = platform.service()
        try:
            gateway = GatewayProcess(procs, gateway_env(url, amqp_url))
            out = topology.out_queue(svc.queue_name)
            with gateway.http(svc.clients[0]) as http:
                assert _ready_within(http, 20).status_code == 200
                created = http.post(gateway.tasks_url(svc.name), json={"body": {}})
                task_id = created.json()["data"]["taskId"]
                downgrade(url, "0017")  # a column a `started` reads is gone
                time.sleep(2)  # the next refreshes of the results' subscriptions
                event = partial(TaskEvent, task_id=task_id, host="pod-a", attempt="a")
                ended = event(EventKind.SUCCEEDED, response={"ok": 1})
                for message in (ended, event(EventKind.STARTED)):  # the end read first
                    publish(amqp_url, out, [encode_event(message, svc.name)])
                time.sleep(3)
                poll = http.get(f"{gateway.tasks_url(svc.name)}/{task_id}")
                assert poll.json()["data"]["status"] == "PENDING", poll.text
                upgrade(url)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    poll = http.get(f"{gateway.tasks_url(svc.name)}/{task_id}")
                    if poll.status_code == 200 and poll.json()["data"]["status"] == "SUCCESS":
                        break
                    time.sleep(0.3)
                assert poll.json()["data"]["status"] == "SUCCESS", poll.text
            history = platform.sql(
                "SELECT attempt_id, worker_host, outcome FROM task_attempts WHERE task_id = %(t)s",
                {"t": task_id},
            )
            assert history == [("a", "pod-a", "success")]
        finally:
            procs.stop_all()
            remove_service(platform, amqp_url, svc)


def test_a_search_path_without_conveyors_schema_is_named_and_upgrade_makes_no_second_one(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    """`ALTER ROLE|DATABASE … SET search_path` to a schema without Conveyor's tables (found by
    a sweep): the gateway said to run `conveyor db upgrade`, which printed a traceback of 141
    lines (no schema to create in) or, with CREATE on that schema, made a second, empty
    catalog there that the gateway then served: ready, every client refused, every PENDING
    task out of sight. Both now name the schema holding the tables; the upgrade makes none."""
    with scratch_database(database_url) as url:
        platform = Platform(url)
        platform.sql("CREATE SCHEMA elsewhere")
        alter_database(database_url, url, "SET search_path = 'elsewhere'")
        env = {**os.environ, "CONVEYOR_DATABASE_URL": url}
        ran = subprocess.run(
            [sys.executable, "-m", "conveyor", "db", "upgrade"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ran.returncode == 1, (ran.stdout, ran.stderr)
        lines = ran.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), ran.stderr
        assert "public" in lines[0] and "search_path" in lines[0], lines
        made = platform.sql("SELECT count(*) FROM pg_tables WHERE schemaname = 'elsewhere'")
        assert made[0][0] == 0

        gateway = GatewayProcess(procs, gateway_env(url, amqp_url))
        with gateway.http() as http:
            ready = http.get("/readyz")
            assert ready.status_code == 503, ready.text
            said = ready.json()["data"]["schema"]
            assert "public" in said and "search_path" in said and UPGRADE not in said, said
