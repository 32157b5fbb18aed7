"""Session settings an operator gives the database or the gateway's role (`ALTER DATABASE|ROLE
… SET`), which every connection opened afterwards takes on (found by a sweep of a DBA's
ordinary operations).

- `DateStyle = 'SQL, DMY'`: psycopg reads dates in ISO only, so every submission and poll was
  answered 500 500001 and results were no longer applied, with `/readyz` at 200; the gateway
  stayed so after the setting was reset, until restarted.
- `default_transaction_isolation = 'serializable'`: two thirds of concurrent submissions were
  answered 503 503001 (serialization failures of the gateway's own transactions).
- `client_encoding = 'LATIN1'`: a body out of Latin-1 was answered 500, and one in it, once
  stored, came back in Latin-1 where JSON is read as UTF-8: the admin view answered 500, and
  the outbox relay stopped at that row, with every task behind it (a run-later task's too).

The gateway's sessions now set what its reading depends on, whatever the defaults."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import Stack
from tests.support.amqp import alter_database, own_gateway, wait_until
from tests.support.gateway import GatewayProcess, Service
from tests.support.processes import Processes

TEXT = "façade ☃ 日本語 €"
SERIALIZABLE = "default_transaction_isolation = 'serializable'"


def submitted(gw: GatewayProcess, svc: Service, n: int) -> int:
    with gw.http(svc.clients[0]) as http:
        return http.post(gw.tasks_url(svc.name), json={"body": {"sleep": 0, "n": n}}).status_code


@pytest.mark.timeout(150)
def test_tasks_end_whatever_the_databases_date_style_and_client_encoding(
    database_url: str, amqp_url: str, procs: Processes, sleeper_url: str
) -> None:
    with own_gateway(database_url, amqp_url, procs) as (gw, svc, platform):
        settings = ("DateStyle = 'SQL, DMY'", "client_encoding = 'LATIN1'", SERIALIZABLE)
        for setting in settings:
            alter_database(database_url, platform.database_url, f"SET {setting}")
        stack = Stack(procs, gw, sleeper_url, amqp_url, svc)
        wait_until(lambda: stack.http.get("/readyz").status_code == 200, 20, what="ready")
        tasks_url = gw.tasks_url(svc.name)
        later = stack.http.post(
            tasks_url, json={"body": {"sleep": 0, "n": "façade"}, "delaySeconds": 1}
        )
        assert later.status_code == 201, later.text
        now = stack.submit({"sleep": 0, "n": TEXT})
        stack.dispatcher("pod-a")

        with ThreadPoolExecutor(8) as pool:  # each its own connection: serializable ones clash
            burst = list(pool.map(lambda n: submitted(gw, svc, n), range(40)))
        assert burst == [201] * 40, burst

        for task_id in (later.json()["data"]["taskId"], now):
            final = stack.finish(task_id, timeout=30)
            assert final["status"] == "SUCCESS", (task_id, final)
            assert final["startDate"] <= final["endDate"], final
        with gw.http(platform.operator()) as admin:
            view = admin.get(f"/v1/admin/tasks/{now}")
            assert view.status_code == 200, view.text
            assert TEXT in json.dumps(view.json()["data"], ensure_ascii=False), view.text
