"""The admin API (SPEC §11.6) on a real gateway: operators only, any client's tasks, cursor
pages, figures from PostgreSQL and the broker."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import aio_pika
import httpx
import pytest

from conveyor import topology
from conveyor.events import EventKind, MessageFormat, TaskEvent, encode_event
from gateway.models import tasks
from gateway.store import iso
from tests.support.amqp import delete_topologies, publish, scratch_database, wait_until
from tests.support.gateway import Client, GatewayProcess, Platform, gateway_env, run_sync
from tests.support.processes import Processes

ADMIN = "/v1/admin"


def _figures(http: httpx.Client, service: str) -> dict[str, Any]:
    answer = http.get(f"{ADMIN}/services")
    assert answer.status_code == 200, answer.text
    found = [s for s in answer.json()["data"]["services"] if s["service"] == service]
    assert len(found) == 1
    return found[0]


def _eventually(check: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def _submit(gateway: GatewayProcess, client: Client, service: str, **extra: Any) -> str:
    with gateway.http(client) as http:
        answer = http.post(gateway.tasks_url(service), json={"body": {"n": 1}, **extra})
    assert answer.status_code == 201, answer.text
    return answer.json()["data"]["taskId"]


@pytest.fixture(scope="module")
def operator(platform: Platform) -> Client:
    return platform.operator()


def test_clients_and_anonymous_get_403001_on_every_admin_route(
    gateway: GatewayProcess, platform: Platform, operator: Client
) -> None:
    svc = platform.service()
    task_id = _submit(gateway, svc.clients[0], svc.name)
    routes = [f"{ADMIN}/services", f"{ADMIN}/services/{svc.name}/tasks", f"{ADMIN}/tasks/{task_id}"]
    wrong = Client(operator.client_id, "not-the-secret")
    for who in (None, svc.clients[0], wrong):
        with gateway.http(who) as http:
            for route in routes:
                answer = http.get(route)
                assert answer.status_code == 403, (who, route, answer.text)
                assert answer.json()["error"]["number"] == 403001
    with gateway.http(operator) as http:
        for route in routes:
            assert http.get(route).status_code == 200, route


def test_an_operator_is_no_client(
    gateway: GatewayProcess, platform: Platform, operator: Client
) -> None:
    svc = platform.service()
    task_id = _submit(gateway, svc.clients[0], svc.name)
    with gateway.http(operator) as http:
        created = http.post(gateway.tasks_url(svc.name), json={"body": {}})
        polled = http.get(f"{gateway.tasks_url(svc.name)}/{task_id}")
    for answer in (created, polled):
        assert answer.status_code == 403
        assert answer.json()["error"]["number"] == 403001


def test_another_clients_task_is_visible_to_operators_only(
    gateway: GatewayProcess, platform: Platform, operator: Client
) -> None:
    svc = platform.service(clients=2)
    owner, other = svc.clients
    task_id = _submit(gateway, owner, svc.name)
    with gateway.http(other) as http:
        assert http.get(f"{gateway.tasks_url(svc.name)}/{task_id}").status_code == 404
    with gateway.http(operator) as http:
        listed = http.get(f"{ADMIN}/services/{svc.name}/tasks").json()["data"]["tasks"]
        detail = http.get(f"{ADMIN}/tasks/{task_id}").json()["data"]
    assert [t["taskId"] for t in listed] == [task_id]
    assert listed[0]["clientId"] == owner.client_id
    assert detail["clientId"] == owner.client_id
    assert detail["service"] == svc.name
    assert detail["request"] == {"n": 1}
    assert detail["status"] == "PENDING"
    assert detail["attempts"] == []


def test_pages_go_newest_first_with_a_cursor_and_a_status_filter(
    gateway: GatewayProcess, platform: Platform, operator: Client
) -> None:
    svc = platform.service()
    made = [_submit(gateway, svc.clients[0], svc.name) for _ in range(5)]
    platform.sql(
        "UPDATE tasks SET status = 'FAILURE', start_date = now(), end_date = now(),"
        " error_message = 'boom' WHERE task_id = %(id)s",
        {"id": made[1]},
    )
    seen: list[str] = []
    cursor = None
    with gateway.http(operator) as http:
        for _ in range(5):
            params: dict[str, Any] = {"limit": 2}
            if cursor:
                params["cursor"] = cursor
            page = http.get(f"{ADMIN}/services/{svc.name}/tasks", params=params).json()["data"]
            seen += [t["taskId"] for t in page["tasks"]]
            cursor = page["nextCursor"]
            if cursor is None:
                break
        failures = http.get(
            f"{ADMIN}/services/{svc.name}/tasks", params={"status": "FAILURE"}
        ).json()["data"]
    assert seen == list(reversed(made))
    assert [t["taskId"] for t in failures["tasks"]] == [made[1]]
    assert failures["tasks"][0]["errorMessage"] == "boom"
    assert failures["nextCursor"] is None


@pytest.mark.parametrize(
    "params",
    [
        {"limit": "0"},
        {"limit": "201"},
        {"limit": "x"},
        {"limit": "\u00b2"},  # a digit to str.isdigit(), not to int(): it was a 500
        {"limit": "\u2460"},
        {"limit": "\u0661\u0660"},  # Arabic-Indic ten: not read as 10
        {"status": "DONE"},
        {"cursor": "bm9wZQ"},
        # Given twice, a filter is ambiguous: neither value is served.
        {"status": ["SUCCESS", "FAILURE"]},
        {"limit": ["1", "2"]},
        {"cursor": ["bm9wZQ", "bm9wZQ"]},
    ],
)
def test_bad_page_parameters_are_400002(
    gateway: GatewayProcess,
    platform: Platform,
    operator: Client,
    params: dict[str, str | list[str]],
) -> None:
    svc = platform.service()
    with gateway.http(operator) as http:
        answer = http.get(f"{ADMIN}/services/{svc.name}/tasks", params=params)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["number"] == 400002


def test_unknown_service_and_task_are_404(gateway: GatewayProcess, operator: Client) -> None:
    with gateway.http(operator) as http:
        service = http.get(f"{ADMIN}/services/no-such-{uuid.uuid4().hex}/tasks")
        nul = http.get(f"{ADMIN}/services/a%00b/tasks")
        task = http.get(f"{ADMIN}/tasks/{uuid.uuid4()}")
        garbage = http.get(f"{ADMIN}/tasks/not-a-uuid")
    assert service.json()["error"]["number"] == 404001
    assert nul.json()["error"]["number"] == 404001
    assert task.json()["error"]["number"] == 404002
    assert garbage.json()["error"]["number"] == 404002


def test_service_figures_count_statuses_queue_depth_and_run_times(
    gateway: GatewayProcess, platform: Platform, operator: Client
) -> None:
    svc = platform.service()
    made = [_submit(gateway, svc.clients[0], svc.name) for _ in range(4)]

    def published() -> dict[str, Any]:
        with gateway.http(operator) as http:
            figures = _figures(http, svc.name)
        assert figures["queues"]["in"] == 4  # every submission published, none consumed
        return figures

    assert _eventually(published)["tasks"]["PENDING"] == 4
    # Ended a second ago, but never before the current 5-minute bucket began (a run just
    # after a bucket's boundary would put them in the previous one), after running 2 s.
    platform.sql(
        "UPDATE tasks SET status = 'SUCCESS', end_date = e.at, start_date = e.at - interval '2 s'"
        "  FROM (SELECT greatest(now() - interval '1 second',"
        "        to_timestamp(floor(extract(epoch FROM now()) / 300) * 300)) AS at) e"
        " WHERE task_id = ANY(%(ids)s)",
        {"ids": made[:2]},
    )
    platform.sql(
        "UPDATE tasks SET status = 'IN_PROGRESS', start_date = now() WHERE task_id = %(id)s",
        {"id": made[2]},
    )

    def settled() -> dict[str, Any]:
        with gateway.http(operator) as http:
            figures = _figures(http, svc.name)
        assert figures["finishedLastHour"]["SUCCESS"] == 2
        return figures

    figures = _eventually(settled)
    assert figures["tasks"] == {"PENDING": 1, "IN_PROGRESS": 1}
    assert figures["finishedLastHour"] == {"SUCCESS": 2, "FAILURE": 0}
    assert figures["queues"]["dlq"] == 0
    assert figures["runTimeSeconds"]["p50"] == pytest.approx(2.0, abs=0.01)
    assert figures["oldestPendingAgeSeconds"] is not None
    assert figures["oldestPendingAgeSeconds"] >= 0
    assert sum(b["SUCCESS"] for b in figures["throughput"]["buckets"]) == 2
    assert figures["throughput"]["buckets"][-1]["SUCCESS"] == 2  # the current bucket is last


def test_a_task_detail_holds_its_callback(
    gateway: GatewayProcess, platform: Platform, operator: Client
) -> None:
    svc = platform.service()
    hook = "http://localhost:9/hook"
    task_id = _submit(gateway, svc.clients[0], svc.name, callback={"type": "http", "url": hook})
    with gateway.http(operator) as http:
        detail = http.get(f"{ADMIN}/tasks/{task_id}").json()["data"]
    assert detail["callback"] == {
        "type": "http",
        "url": hook,
        "status": None,
        "rounds": 0,
        "claimedUntil": None,
    }


# Where each column of `tasks` shows in a task's detail: its camelCase name, unless listed here.
_SHOWN_AS = {
    "id": "rowId",
    "submission_date": "submitionDate",  # the seed's spelling, as in the poll
    "attempts": "deliveries",
    "notification_status": "callback.status",
    "notification_attempts": "callback.rounds",
    "notify_claimed_until": "callback.claimedUntil",
    "request_json": "request",  # the body as accepted (0020); an older row's `request`
}


def _camel(column: str) -> str:
    head, *rest = column.split("_")
    return head + "".join(word.title() for word in rest)


def test_a_task_detail_shows_every_column_of_its_row(
    gateway: GatewayProcess, platform: Platform, operator: Client
) -> None:
    """SPEC §11.6: "everything the row ... holds". A task stuck in PENDING showed neither its
    publish attempts nor its publish error, its expiry nor its last change."""
    svc = platform.service()
    task_id = _submit(
        gateway, svc.clients[0], svc.name, callback={"type": "http", "url": "http://localhost:9/"}
    )
    with gateway.http(operator) as http:
        detail = http.get(f"{ADMIN}/tasks/{task_id}").json()["data"]
    missing = []
    for column in tasks.c.keys():
        where, _, key = _SHOWN_AS.get(column, _camel(column)).rpartition(".")
        if key not in (detail[where] if where else detail):
            missing.append(column)
    assert missing == [], f"columns of the row the detail does not show: {missing}"


def test_a_pending_task_detail_says_why_it_is_not_published(
    gateway: GatewayProcess, platform: Platform, operator: Client
) -> None:
    svc = platform.service()
    task_id = _submit(gateway, svc.clients[0], svc.name)
    # Once the submission's own publish is marked (it would clear what is set below), what a
    # relay leaves on a row the broker keeps refusing; a retry an hour away, so that this
    # gateway's relay leaves it alone meanwhile.
    published = "SELECT publish_at IS NULL FROM tasks WHERE task_id = %(t)s"
    assert wait_until(lambda: platform.sql(published, {"t": task_id})[0][0], 10)
    ((row_id, publish_at, expires_at, updated_at, time_limit, traceparent),) = platform.sql(
        """
        UPDATE tasks SET publish_attempts = 7, publish_error = 'NOT_FOUND - no queue',
               publish_at = now() + interval '1 hour', updated_at = now()
         WHERE task_id = %(t)s
        RETURNING id, publish_at, expires_at, updated_at, time_limit, traceparent
        """,
        {"t": task_id},
    )
    with gateway.http(operator) as http:
        detail = http.get(f"{ADMIN}/tasks/{task_id}").json()["data"]
    assert detail["status"] == "PENDING"
    shown = {
        key: detail.get(key)
        for key in (
            "rowId",
            "publishAttempts",
            "publishError",
            "publishAt",
            "expiresAt",
            "updatedAt",
            "timeLimit",
            "traceparent",
            "attemptId",
        )
    }
    assert shown == {
        "rowId": row_id,
        "publishAttempts": 7,
        "publishError": "NOT_FOUND - no queue",
        "publishAt": iso(publish_at),
        "expiresAt": iso(expires_at),
        "updatedAt": iso(updated_at),
        "timeLimit": time_limit,
        "traceparent": traceparent,
        "attemptId": None,
    }
    assert expires_at is not None and time_limit is not None  # set at submission


class _Refusing(BaseHTTPRequestHandler):
    """A callback endpoint that answers 500 to every POST, and counts them."""

    calls = 0

    def do_POST(self) -> None:
        type(self).calls += 1
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def refusing() -> Iterator[tuple[type[_Refusing], int]]:
    handler = type("Refusing", (_Refusing,), {"calls": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_callback_called_three_times_in_one_round_says_one_round(
    gateway: GatewayProcess,
    platform: Platform,
    operator: Client,
    refusing: tuple[type[_Refusing], int],
) -> None:
    """The callback's count is `notification_attempts`, which counts a notifier's claims, each
    up to CONVEYOR_CALLBACK_ATTEMPTS (3) HTTP calls: it showed `attempts: 1` for a callback
    POSTed 3 times. It is shown for what it is, `rounds`."""
    handler, port = refusing
    hook = f"http://localhost:{port}/hook"
    svc = platform.service()
    task_id = _submit(gateway, svc.clients[0], svc.name, callback={"type": "http", "url": hook})
    platform.sql(
        "UPDATE tasks SET status = 'FAILURE', end_date = now(), error_message = 'boom',"
        " notification_status = 'PENDING', updated_at = now() WHERE task_id = %(t)s",
        {"t": task_id},
    )

    def recorded() -> dict[str, Any]:
        with gateway.http(operator) as http:
            callback = http.get(f"{ADMIN}/tasks/{task_id}").json()["data"]["callback"]
        assert callback["status"] == "FAILURE", callback
        return callback

    callback = _eventually(recorded)
    assert handler.calls == 3
    assert callback == {
        "type": "http",
        "url": hook,
        "status": "FAILURE",
        "rounds": 1,
        "claimedUntil": None,
    }, f"POSTed {handler.calls} times"


def test_the_admin_routes_are_in_the_openapi_document(gateway: GatewayProcess) -> None:
    paths = httpx.get(f"{gateway.url}/openapi.json").json()["paths"]
    assert "get" in paths["/v1/admin/services"]
    assert "get" in paths["/v1/admin/services/{service}/tasks"]
    assert "get" in paths["/v1/admin/tasks/{task_id}"]


def test_the_gauges_show_the_figures(
    gateway: GatewayProcess, platform: Platform, operator: Client
) -> None:
    svc = platform.service()
    _submit(gateway, svc.clients[0], svc.name)
    line = f'conveyor_service_tasks{{service="{svc.name}",status="PENDING"}} 1.0'

    def scraped() -> None:
        with gateway.http(operator) as http:
            http.get(f"{ADMIN}/services")  # a fresh snapshot feeds the gauges too
            assert line in http.get("/metrics").text

    _eventually(scraped)


def test_results_no_process_takes_are_counted_on_out(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    """Found by a black-box sweep: with `--no-background` gateways alone (no process running
    the loops), tasks stayed PENDING while their results piled up on `-out`, and nothing said
    so. The service's figures and `conveyor_service_queue_messages` count `-out` too."""
    with scratch_database(database_url) as url:  # no other gateway takes its results
        platform = Platform(url)
        service = platform.service()
        try:
            run_sync(_declare(amqp_url, service.queue_name))
            env = gateway_env(url, amqp_url, CONVEYOR_STATS_INTERVAL="1")
            gateway = GatewayProcess(procs, env, "gateway-api-only", "--no-background")
            started = [
                encode_event(TaskEvent(EventKind.STARTED, str(uuid.uuid4())), service.name)
                for _ in range(3)
            ]
            publish(amqp_url, topology.out_queue(service.queue_name), started)
            line = f'conveyor_service_queue_messages{{queue="out",service="{service.name}"}} 3.0'

            def counted() -> bool:
                return line in httpx.get(f"{gateway.url}/metrics", timeout=5).text

            wait_until(counted, 20, what="-out counted")
            with gateway.http(platform.operator()) as http:
                assert _figures(http, service.name)["queues"]["out"] == 3
        finally:
            procs.stop_all()
            delete_topologies(amqp_url, [service.queue_name])


async def _declare(amqp_url: str, queue_name: str) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        await topology.declare_service(
            await connection.channel(), queue_name, MessageFormat.CLOUDEVENTS, 5
        )
