"""Every row of SPEC §3's error tables, against a real gateway, PostgreSQL and RabbitMQ."""

from __future__ import annotations

import base64
import json
import re
import socket
import uuid

import httpx
import psycopg
import pytest

from gateway.database_url import libpq
from tests.support.amqp import scratch_database, wait_until
from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes

DATE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
SCHEMA = {
    "type": "object",
    "required": ["sleep"],
    "properties": {"sleep": {"type": "number"}},
}


def error_of(answer: httpx.Response) -> tuple[int, int]:
    payload = answer.json()
    assert payload["status"] == "error", payload
    return answer.status_code, payload["error"]["number"]


@pytest.fixture(scope="module")
def svc(platform: Platform):
    return platform.service(clients=2, jsonSchema=SCHEMA)


def test_create_returns_task_id_and_position(gateway: GatewayProcess, svc) -> None:
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(gateway.tasks_url(svc.name), json={"body": {"sleep": 1}})
        assert answer.status_code == 201, answer.text
        data = answer.json()["data"]
        assert answer.json()["status"] == "success"
        uuid.UUID(data["taskId"])
        assert isinstance(data["taskPosition"], int) and data["taskPosition"] >= 1
        polled = http.get(answer.headers["location"])  # where the task is, as 201 says
        assert polled.status_code == 200 and polled.json()["data"]["taskId"] == data["taskId"]
        second = http.post(gateway.tasks_url(svc.name) + "/", json={"body": {"sleep": 1}})
        assert second.status_code == 201  # the trailing-slash spelling of the seed
        assert second.json()["data"]["taskPosition"] == data["taskPosition"] + 1


def test_every_task_route_answers_with_a_trailing_slash_too(gateway: GatewayProcess, svc) -> None:
    """As the create route does (SPEC §3.1): a client that adds a `/` gets the answer, not a
    307 that httpx, curl and most SDKs do not follow on their own."""
    with gateway.http(svc.clients[0]) as http:
        tasks = gateway.tasks_url(svc.name)
        batch = http.post(f"{tasks}/batch/", json={"tasks": [{"body": {"sleep": 1}}]})
        assert batch.status_code == 201, batch.text
        task_id = batch.json()["data"]["tasks"][0]["taskId"]
        poll = http.get(f"{tasks}/{task_id}/")
        assert poll.status_code == 200, poll.text
        assert poll.json()["data"]["status"] == "PENDING"
        cancel = http.post(f"{tasks}/{task_id}/cancel/")
        assert cancel.status_code == 200, cancel.text
        assert cancel.json()["data"]["status"] == "FAILURE"
        with http.stream("GET", f"{tasks}/{task_id}/events/") as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            assert '"FAILURE"' in stream.read().decode()
        other = gateway.http(svc.clients[1])
        with other:
            assert error_of(other.get(f"{tasks}/{task_id}/")) == (404, 404002)


def test_poll_pending_task_shape(gateway: GatewayProcess, svc) -> None:
    with gateway.http(svc.clients[0]) as http:
        task_id = http.post(gateway.tasks_url(svc.name), json={"body": {"sleep": 1}}).json()[
            "data"
        ]["taskId"]
        answer = http.get(f"{gateway.tasks_url(svc.name)}/{task_id}")
    assert answer.status_code == 200
    data = answer.json()["data"]
    assert data["status"] == "PENDING"
    assert data["taskId"] == task_id
    assert DATE.match(data["submitionDate"])
    assert data["progress"] == 0.0
    assert data["taskPosition"] >= 1
    assert "startDate" not in data and "endDate" not in data


@pytest.mark.parametrize(
    "auth",
    [
        None,
        "Bearer abc",
        "Basic !!!notbase64",
        "Basic " + base64.b64encode(b"no-colon").decode(),
        "Basic " + base64.b64encode(b"unknown-client:whatever").decode(),
    ],
)
def test_bad_credentials_are_403001(gateway: GatewayProcess, svc, auth: str | None) -> None:
    headers = {"Authorization": auth} if auth else {}
    with gateway.http() as http:
        answer = http.post(
            gateway.tasks_url(svc.name), json={"body": {"sleep": 1}}, headers=headers
        )
    assert error_of(answer) == (403, 403001)
    assert answer.json()["error"]["description"] == "Forbidden."
    assert answer.headers["www-authenticate"] == 'Basic realm="conveyor"'


def test_wrong_secret_and_unknown_client_look_identical(gateway: GatewayProcess, svc) -> None:
    client = svc.clients[0]
    with gateway.http() as http:
        wrong = http.post(
            gateway.tasks_url(svc.name), json={"body": {}}, auth=(client.client_id, "nope")
        )
        unknown = http.post(gateway.tasks_url(svc.name), json={"body": {}}, auth=("ghost", "nope"))
    assert wrong.status_code == unknown.status_code == 403
    assert wrong.content == unknown.content
    assert wrong.headers.get("www-authenticate") == unknown.headers.get("www-authenticate")


def test_client_without_grant_is_403001(gateway: GatewayProcess, svc, platform: Platform) -> None:
    other = platform.service()
    with gateway.http(other.clients[0]) as http:
        answer = http.post(gateway.tasks_url(svc.name), json={"body": {"sleep": 1}})
    assert error_of(answer) == (403, 403001)


def test_poll_without_grant_is_403001(gateway: GatewayProcess, svc, platform: Platform) -> None:
    """As for create: an authenticated client without a grant on the service is refused,
    whether or not the task exists."""
    with gateway.http(svc.clients[0]) as http:
        created = http.post(gateway.tasks_url(svc.name), json={"body": {"sleep": 1}})
    task_id = created.json()["data"]["taskId"]
    other = platform.service()
    with gateway.http(other.clients[0]) as http:
        theirs = http.get(f"{gateway.tasks_url(svc.name)}/{task_id}")
        missing = http.get(f"{gateway.tasks_url(svc.name)}/{uuid.uuid4()}")
        not_uuid = http.get(f"{gateway.tasks_url(svc.name)}/not-a-uuid")
        unknown = http.get(f"{gateway.tasks_url(svc.name)}/{task_id}", auth=("ghost", "nope"))
    assert error_of(theirs) == (403, 403001)
    assert theirs.content == missing.content == not_uuid.content == unknown.content


def test_unknown_service_is_404001(gateway: GatewayProcess, svc) -> None:
    with gateway.http(svc.clients[0]) as http:
        created = http.post("/v1/services/no-such-service/tasks", json={"body": {}})
        polled = http.get(f"/v1/services/no-such-service/tasks/{uuid.uuid4()}")
        unicode = http.post("/v1/services/s%C3%A9rvice-%E2%98%83/tasks", json={"body": {}})
    assert error_of(created) == (404, 404001)
    assert created.json()["error"]["description"] == "Service not found."
    assert error_of(polled) == (404, 404001)
    assert error_of(unicode) == (404, 404001)


def test_schema_failure_is_400001_with_errors(gateway: GatewayProcess, svc) -> None:
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(gateway.tasks_url(svc.name), json={"body": {"sleep": "long"}})
    assert error_of(answer) == (400, 400001)
    error = answer.json()["error"]
    assert (
        error["description"] == "Error validating the body with the target service's json-schema."
    )
    assert error["errors"] == [{"path": "body/sleep", "message": "'long' is not of type 'number'"}]


def test_the_schema_is_checked_before_the_callback_and_the_time(
    gateway: GatewayProcess, svc
) -> None:
    """SPEC §3.1's order: 400001 before 400002 (a bad callback, an unknown field), for a body
    both refuse."""
    bad_body = {"sleep": "long"}
    with gateway.http(svc.clients[0]) as http:
        for extra in (
            {"callback": {"type": "ftp", "url": "ftp://x"}},
            {"foo": 1},
            {"delaySeconds": -1},
            {"notBefore": "tomorrow"},
        ):
            answer = http.post(gateway.tasks_url(svc.name), json={"body": bad_body, **extra})
            assert error_of(answer) == (400, 400001), extra
            batch = http.post(
                gateway.tasks_url(svc.name) + "/batch",
                json={"tasks": [{"body": bad_body, **extra}]},
            )
            assert error_of(batch) == (400, 400001), extra


@pytest.mark.parametrize(
    ("content", "field"),
    [
        (b"{not json", ""),
        (b"[1, 2]", ""),
        (b'{"callback": null}', "body"),
        (b'{"body": [1]}', "body"),
        (b'{"body": "text"}', "body"),
        (b'{"body": {"sleep": 1}, "extra": 1}', "extra"),
        (b'{"body": {"sleep": NaN}}', ""),
        (b'{"body": {"sleep": 1}, "callback": {"type": "https"}}', "callback/url"),
        (b"\xff\xfe{}", ""),
    ],
)
def test_malformed_requests_are_400002(
    gateway: GatewayProcess, svc, content: bytes, field: str
) -> None:
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(
            gateway.tasks_url(svc.name),
            content=content,
            headers={"Content-Type": "application/json"},
        )
    assert error_of(answer) == (400, 400002), answer.text
    error = answer.json()["error"]
    assert error["description"] == "Invalid request."
    assert error["errors"][0]["path"] == field


CALLBACK_FIELDS = [
    ({"type": "ftp", "url": "https://h.example"}, "callback/type"),
    ({"url": "https://h.example"}, "callback/type"),
    ("https://h.example", "callback"),
    (["https://h.example"], "callback"),
    ({"type": "https", "url": "https://h.example", "secret": 1}, "callback/secret"),
    ({"type": "https"}, "callback/url"),
    ({"type": "https", "url": "nope"}, "callback/url"),
]


@pytest.mark.parametrize(("callback", "field"), CALLBACK_FIELDS)
def test_callback_errors_name_the_field_that_is_wrong(
    gateway: GatewayProcess, svc, callback: object, field: str
) -> None:
    with gateway.http(svc.clients[0]) as http:
        single = http.post(
            gateway.tasks_url(svc.name), json={"body": {"sleep": 1}, "callback": callback}
        )
        batch = http.post(
            gateway.tasks_url(svc.name) + "/batch",
            json={"tasks": [{"body": {"sleep": 1}}, {"body": {"sleep": 1}, "callback": callback}]},
        )
    assert (error_of(single), error_of(batch)) == ((400, 400002), (400, 400002))
    assert single.json()["error"]["errors"][0]["path"] == field
    assert batch.json()["error"]["errors"][0]["path"] == f"tasks/1/{field}"


def test_callback_to_private_address_is_refused(gateway: GatewayProcess, svc) -> None:
    with gateway.http(svc.clients[0]) as http:
        for url in ("http://127.0.0.1:9/hook", "http://169.254.169.254/latest", "http://10.0.0.1/"):
            answer = http.post(
                gateway.tasks_url(svc.name),
                json={"body": {"sleep": 1}, "callback": {"type": "http", "url": url}},
            )
            assert error_of(answer) == (400, 400002), url
            assert answer.json()["error"]["errors"][0]["path"] == "callback/url"


def test_too_large_is_413001(gateway: GatewayProcess, svc) -> None:
    big = b'{"body": {"sleep": 1, "pad": "' + b"x" * (1024 * 1024 + 10) + b'"}}'
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(
            gateway.tasks_url(svc.name), content=big, headers={"Content-Type": "application/json"}
        )
    assert error_of(answer) == (413, 413001)
    assert answer.json()["error"]["description"] == "Request too large."


def test_service_capacity_is_429001(gateway: GatewayProcess, platform: Platform) -> None:
    svc = platform.service(capacity=2)
    with gateway.http(svc.clients[0]) as http:
        codes = [
            http.post(gateway.tasks_url(svc.name), json={"body": {}}).status_code for _ in range(3)
        ]
        answer = http.post(gateway.tasks_url(svc.name), json={"body": {}})
    assert codes == [201, 201, 429]
    assert error_of(answer) == (429, 429001)
    assert answer.json()["error"]["description"] == "Too many service requests"
    assert answer.headers["retry-after"] == "1"  # when to try again, as a 503 says


def test_client_capacity_is_429002(gateway: GatewayProcess, platform: Platform) -> None:
    svc = platform.service(clients=2, client_capacity=1)
    first, second = svc.clients
    with gateway.http(first) as http:
        assert http.post(gateway.tasks_url(svc.name), json={"body": {}}).status_code == 201
        answer = http.post(gateway.tasks_url(svc.name), json={"body": {}})
    assert error_of(answer) == (429, 429002)
    assert answer.json()["error"]["description"] == "Too many service requests for the clientId."
    assert answer.headers["retry-after"] == "1"
    with gateway.http(second) as http:  # the other client's own capacity is untouched
        assert http.post(gateway.tasks_url(svc.name), json={"body": {}}).status_code == 201


def test_unknown_task_is_404002(gateway: GatewayProcess, svc) -> None:
    with gateway.http(svc.clients[0]) as http:
        unknown = http.get(f"{gateway.tasks_url(svc.name)}/{uuid.uuid4()}")
        not_uuid = http.get(f"{gateway.tasks_url(svc.name)}/not-a-uuid")
    assert error_of(unknown) == (404, 404002)
    assert unknown.json()["error"]["description"] == "Task not found."
    assert error_of(not_uuid) == (404, 404002)


def test_tenant_isolation(gateway: GatewayProcess, svc, platform: Platform) -> None:
    """Client B can neither read A's task nor tell it apart from a task that doesn't exist."""
    a, b = svc.clients
    with gateway.http(a) as http:
        task_id = http.post(gateway.tasks_url(svc.name), json={"body": {"sleep": 1}}).json()[
            "data"
        ]["taskId"]
    with gateway.http(b) as http:
        theirs = http.get(f"{gateway.tasks_url(svc.name)}/{task_id}")
        missing = http.get(f"{gateway.tasks_url(svc.name)}/{uuid.uuid4()}")
    assert error_of(theirs) == (404, 404002)
    assert theirs.content == missing.content
    # Nor through another service the task does not belong to.
    other = platform.service()
    with gateway.http(other.clients[0]) as http:
        assert error_of(http.get(f"{gateway.tasks_url(other.name)}/{task_id}")) == (404, 404002)


def test_idempotency_key_returns_the_same_task(gateway: GatewayProcess, svc) -> None:
    key = uuid.uuid4().hex
    with gateway.http(svc.clients[0]) as http:
        first = http.post(
            gateway.tasks_url(svc.name),
            json={"body": {"sleep": 1}},
            headers={"Idempotency-Key": key},
        )
        repeat = http.post(
            gateway.tasks_url(svc.name),
            json={"body": {"sleep": 1}},
            headers={"Idempotency-Key": key},
        )
    assert first.status_code == 201
    assert repeat.status_code == 200
    assert repeat.json()["data"]["taskId"] == first.json()["data"]["taskId"]
    # The same key from another client is another task.
    with gateway.http(svc.clients[1]) as http:
        other = http.post(
            gateway.tasks_url(svc.name),
            json={"body": {"sleep": 1}},
            headers={"Idempotency-Key": key},
        )
    assert other.status_code == 201
    assert other.json()["data"]["taskId"] != first.json()["data"]["taskId"]


def test_operations_endpoints(gateway: GatewayProcess) -> None:
    with gateway.http() as http:
        alive = http.get("/healthz")
        assert alive.status_code == 200 and alive.json()["status"] == "success"  # SPEC §3
        assert alive.json()["data"]["alive"] is True
        ready = http.get("/readyz")
        assert ready.json()["status"] == "success"
        assert ready.status_code == 200 and ready.json()["data"]["checks"] == {
            "database": True,
            "schema": True,
            "broker": True,
            "loops": True,
            "notifications": True,
        }
        assert "conveyor_gateway_requests_total" in http.get("/metrics").text
        spec = http.get("/openapi.json").json()
        post = spec["paths"]["/v1/services/{service}/tasks"]["post"]
        assert {"201", "400", "403", "404", "413", "429"} <= set(post["responses"])
        poll = spec["paths"]["/v1/services/{service}/tasks/{task_id}"]["get"]
        assert {"200", "403", "404"} <= set(poll["responses"])
        assert http.get("/docs").status_code == 200
        assert error_of(http.get("/nope")) == (404, 404000)


def test_the_docs_page_loads_its_files_from_where_it_was_served(gateway: GatewayProcess) -> None:
    """Found by a sweep: /docs wrote its script's and style sheet's absolute URLs from the
    request's Host header (`http://attacker.example/docs/swagger-ui-bundle.js`), so a cache
    keyed without the Host could serve a page running someone else's script on the gateway's
    origin, where Swagger UI keeps the credentials typed in; behind TLS, the `http://` URLs
    were blocked as mixed content. They are paths now, and the page says where scripts come
    from (Content-Security-Policy)."""
    with gateway.http() as http:
        page = http.get("/docs", headers={"Host": "attacker.example"})
        assert page.status_code == 200
        assert "attacker.example" not in page.text
        sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert sources and all(s.startswith("/docs/") for s in sources), sources
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for source in sources:
            assert http.get(source).status_code == 200, source


def test_a_schema_referring_to_a_server_fetches_nothing(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """A schema that `apply` would refuse, written by plain SQL, refers to a server that takes
    connections and never answers: the gateway fetched it on its event loop, without a
    timeout, and every request of every service waited behind it. The body is refused now
    (400001, saying why), and the server hears nothing."""
    svc = platform.service(jsonSchema={"type": "object"})
    with socket.create_server(("127.0.0.1", 0)) as silent:
        silent.setblocking(False)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/h.json"
        platform.sql(
            "UPDATE services SET json_schema = %(s)s::jsonb, updated_at = now() WHERE name = %(n)s",
            {
                "s": json.dumps({"type": "object", "properties": {"x": {"$ref": url}}}),
                "n": svc.name,
            },
        )
        answers: list[httpx.Response] = []
        with gateway.http(svc.clients[0]) as http:

            def refused() -> bool:
                answers.append(http.post(gateway.tasks_url(svc.name), json={"body": {"x": 5}}))
                return answers[-1].status_code == 400

            wait_until(refused, 20, what="the stored schema in force")
        with pytest.raises(BlockingIOError):
            silent.accept()
    assert error_of(answers[-1]) == (400, 400001)
    assert answers[-1].json()["error"]["errors"] == [
        {
            "path": "body",
            "message": f"the service's JSON Schema cannot be applied: Unresolvable: {url}",
        }
    ]


def test_a_pattern_that_backtracks_without_end_holds_the_gateway_for_its_budget_only(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """`^(a+)+$` takes twice as long with each character: a body of 40 was hours of the
    gateway's event loop, every service waiting (found by a black-box test: 27 characters held
    /healthz 3 s). A body's check has CHECK_BUDGET (2 s); past it the body is refused."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}
    svc = platform.service(jsonSchema=schema)
    with gateway.http(svc.clients[0]) as http:
        refused = http.post(gateway.tasks_url(svc.name), json={"body": {"a": "a" * 40 + "!"}})
        healthy = http.get("/healthz")
        fine = http.post(gateway.tasks_url(svc.name), json={"body": {"a": "aaaa"}})
    assert error_of(refused) == (400, 400001)
    assert refused.json()["error"]["errors"] == [
        {"path": "body", "message": "not checked against the service's JSON Schema within 2 s"}
    ]
    assert healthy.status_code == 200
    assert fine.status_code == 201, fine.text


def test_a_database_that_takes_no_writes_answers_503(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    """Found by a black-box sweep: a database made read-only (as a standby not promoted yet
    is) answered a submission 500 500001 with a ReadOnlySqlTransaction traceback, while
    /readyz said 503. It is the database unavailable for writes: 503 503001, Retry-After."""
    with scratch_database(database_url) as url:
        platform = Platform(url)
        service = platform.service()
        gateway = GatewayProcess(procs, gateway_env(url, amqp_url), "gateway-read-only-db")
        with psycopg.connect(libpq(url), autocommit=True) as admin:
            name = admin.info.dbname
            admin.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            with gateway.http(service.clients[0]) as http:
                answers = [
                    http.post(gateway.tasks_url(service.name), json={"body": {}})
                    for _ in range(3)  # the first may meet a connection the server ended
                ]
            admin.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
        procs.stop_all()
        assert [a.status_code for a in answers] == [503] * 3, answers[-1].text
        assert {a.json()["error"]["number"] for a in answers} == {503001}
        assert "Traceback" not in gateway.proc.logs()
