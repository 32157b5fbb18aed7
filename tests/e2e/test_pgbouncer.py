"""The gateway behind PgBouncer (found by a sweep of a DBA's ordinary operations).

Session mode serves as a direct connection does. Transaction mode cannot serve it: each
statement may run on another server session, so a LISTEN hears nothing and psycopg's prepared
statements go missing. The gateway said ready, the event streams went quiet, a revoked grant
was honoured on, and results failed as "could not be stored". It now finds that what NOTIFY
sends does not reach its LISTEN connection, and says so in `/readyz` (503, `notifications`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import Stack
from tests.support.amqp import own_gateway, remove_service, scratch_database, wait_until
from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes
from tests.support.servers import PgBouncer


@pytest.fixture
def bouncer(request: pytest.FixtureRequest, database_url: str) -> Iterator[PgBouncer]:
    made = PgBouncer(database_url, request.param)
    yield made
    made.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bouncer", ["session"], indirect=True)
def test_behind_pgbouncer_in_session_mode_tasks_run(
    database_url: str, amqp_url: str, procs: Processes, sleeper_url: str, bouncer: PgBouncer
) -> None:
    with own_gateway(database_url, amqp_url, procs, database_via=bouncer.url) as (gw, svc, _):
        stack = Stack(procs, gw, sleeper_url, amqp_url, svc)
        ready = stack.http.get("/readyz").json()["data"]
        assert ready["checks"]["notifications"] is True, ready
        task_id = stack.submit({"sleep": 0})
        stack.dispatcher("pod-a")
        assert stack.finish(task_id, timeout=30)["status"] == "SUCCESS"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bouncer", ["transaction"], indirect=True)
def test_behind_pgbouncer_in_transaction_mode_the_gateway_is_not_ready_and_says_why(
    database_url: str, amqp_url: str, procs: Processes, bouncer: PgBouncer
) -> None:
    with scratch_database(database_url) as url:
        platform = Platform(url)
        svc = platform.service()
        try:
            gateway = GatewayProcess(procs, gateway_env(bouncer.url(url), amqp_url))
            with gateway.http() as http:
                said = wait_until(
                    lambda: http.get("/readyz").json()["data"].get("notifications"),
                    30,
                    what="named",
                )
                ready = http.get("/readyz")
                assert ready.status_code == 503, ready.text
                assert ready.json()["data"]["checks"]["notifications"] is False, ready.text
                assert "transaction" in said and "session mode" in said, said
        finally:
            procs.stop_all()
            remove_service(platform, amqp_url, svc)
