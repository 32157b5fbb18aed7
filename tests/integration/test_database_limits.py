"""Limits the database puts on the gateway's statements, by an operator or by a full disk
(found by a sweep on a private PostgreSQL: a tmpfs data directory filled up, `ALTER DATABASE
… SET lock_timeout`).

A full disk refuses a submission's insert, which extends the table, with `DiskFull`, while
the readiness write, which rewrites a page that exists, goes through: /readyz said 200 for the
whole outage while every submission was answered 503. Here the refusal is PostgreSQL's own
error, raised by a trigger on the test's scratch database as the server raises it when it
cannot extend a file (a full disk cannot be made without root and a mount).
"""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from gateway.database_url import libpq
from tests.support.amqp import alter_database, own_gateway, wait_until
from tests.support.processes import Processes


@pytest.mark.timeout(120)
def test_a_lock_timeout_the_operator_set_on_the_database_cuts_no_submission(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    """The gateway waits for a lock as long as its statement may last (`DB_TIMEOUT`), whatever
    the database's default: with 10 ms, each submission meeting a lock (a `CREATE INDEX`'s
    SHARE lock here) was answered 503 503001, also long after the setting was reset."""
    with own_gateway(database_url, amqp_url, procs) as (gw, svc, platform):
        alter_database(database_url, platform.database_url, "SET lock_timeout = '10ms'")
        with gw.http(svc.clients[0]) as http:
            wait_until(lambda: http.get("/readyz").status_code == 200, 20, what="ready again")
            locked, release = threading.Event(), threading.Event()

            def hold_a_share_lock() -> None:
                with psycopg.connect(libpq(platform.database_url)) as conn:
                    conn.execute("LOCK TABLE tasks IN SHARE MODE")
                    locked.set()
                    release.wait(10)
                    time.sleep(0.5)

            holder = threading.Thread(target=hold_a_share_lock)
            holder.start()
            try:
                assert locked.wait(10)
                release.set()  # let go 0.5 s from now: the submission waits for it
                answer = http.post(gw.tasks_url(svc.name), json={"body": {"n": 1}})
            finally:
                release.set()
                holder.join()
            assert answer.status_code == 201, answer.text


@pytest.mark.timeout(120)
def test_a_database_out_of_room_makes_the_gateway_unready_until_it_writes_again(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    with own_gateway(database_url, amqp_url, procs) as (gw, svc, platform):
        platform.sql(
            "CREATE FUNCTION no_room() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " RAISE EXCEPTION 'could not extend file: No space left on device'"
            " USING ERRCODE = 'disk_full'; END $$"
        )
        platform.sql(
            "CREATE TRIGGER no_room BEFORE INSERT ON tasks FOR EACH ROW EXECUTE FUNCTION no_room()"
        )
        with gw.http(svc.clients[0]) as http:
            refused = http.post(gw.tasks_url(svc.name), json={"body": {"n": 1}})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["number"] == 503001, refused.text
            ready = http.get("/readyz")
            assert ready.status_code == 503, ready.text
            assert ready.json()["data"]["checks"]["database"] is False, ready.text

            platform.sql("DROP TRIGGER no_room ON tasks")
            wait_until(lambda: http.get("/readyz").status_code == 200, 15, what="ready again")
            answer = http.post(gw.tasks_url(svc.name), json={"body": {"n": 2}})
            assert answer.status_code == 201, answer.text
