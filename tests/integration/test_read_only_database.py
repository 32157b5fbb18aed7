"""A database that takes no writes: a failover target still a standby, a primary demoted
under the gateway's connections, `default_transaction_read_only` (found by a sweep).

PostgreSQL refuses each write with `ReadOnlySqlTransaction`, an error psycopg does not class
as a lost connection: results were taken for messages the database refused, set aside and
their tasks failed (11 that had succeeded in four runs of read-only flips), every batch was
retried at once with a 70-line traceback (~750 per gateway in 25 s), and the notifier's loop
crashed, so callbacks already sent went out again when their lease ended. A read-only
database is an outage: waited out, as one that is down.
"""

from __future__ import annotations

import time
import uuid

import pytest

from conveyor import topology
from conveyor.events import EventKind, TaskEvent, encode_event
from tests.support.amqp import alter_database, own_gateway, publish, wait_until
from tests.support.processes import Processes


@pytest.mark.timeout(120)
def test_a_read_only_database_is_waited_out_as_an_outage(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    with own_gateway(database_url, amqp_url, procs) as (gw, svc, platform):
        status_url = f"{gw.tasks_url(svc.name)}/{{}}"
        with gw.http(svc.clients[0]) as http:
            answer = http.post(gw.tasks_url(svc.name), json={"body": {"n": 1}})
            assert answer.status_code == 201, answer.text
            task_id = answer.json()["data"]["taskId"]

            alter_database(
                database_url, platform.database_url, "SET default_transaction_read_only = on"
            )
            attempt = str(uuid.uuid4())
            for event in (
                TaskEvent(EventKind.STARTED, task_id, host="pod-a", attempt=attempt),
                TaskEvent(EventKind.SUCCEEDED, task_id, response={"ok": 1}, attempt=attempt),
            ):
                out = topology.out_queue(svc.queue_name)
                publish(amqp_url, out, [encode_event(event, svc.name)])
            time.sleep(4)
            during = gw.proc.logs()
            refused = http.post(gw.tasks_url(svc.name), json={"body": {"n": 2}})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["number"] == 503001, refused.text
            assert http.get("/readyz").status_code == 503

            alter_database(
                database_url, platform.database_url, "RESET default_transaction_read_only"
            )

            def status() -> str:
                # The sessions the test just ended may still answer one request 503 503001
                # (their goodbye not read yet when it was lent one): an outage, as it is.
                answer = http.get(status_url.format(task_id))
                if answer.status_code == 503:
                    assert answer.json()["error"]["number"] == 503001, answer.text
                    return "unavailable"
                return answer.json()["data"]["status"]

            wait_until(lambda: status() in ("SUCCESS", "FAILURE"), 20, what="the task ended")
            assert status() == "SUCCESS"
        assert platform.sql("SELECT count(*) FROM poison_messages") == [(0,)]
        assert during.count("Traceback") <= 3, during[-3000:]
        assert during.count("batch not applied") <= 3, during[-3000:]
        for loop in ("notifier", "relay", "results"):
            assert gw.metric(f'conveyor_gateway_loop_restarts_total{{loop="{loop}"}}') == 0
