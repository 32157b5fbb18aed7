"""conveyor.client and the `conveyor task` CLI against a fake gateway (httpx.MockTransport)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from functools import partial
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from typer.testing import CliRunner

from conveyor.cli import task as task_cli
from conveyor.client import (
    AsyncConveyorClient,
    ConveyorClient,
    ConveyorError,
    Submitted,
    TaskWaitTimeout,
)

BASE = "http://gateway.test"
TASK_ID = "089373b8-1691-4462-8f78-25e3af1a1c6b"
PENDING = {
    "taskId": TASK_ID,
    "status": "PENDING",
    "taskPosition": 12,
    "submitionDate": "2025-04-23T18:25:43.511Z",
    "progress": 0.0,
}
RUNNING = {
    "taskId": TASK_ID,
    "status": "IN_PROGRESS",
    "submitionDate": "2025-04-23T18:25:43.511Z",
    "startDate": "2025-04-23T20:15:11.322Z",
    "progress": 10.0,
}
SUCCESS = {
    **RUNNING,
    "status": "SUCCESS",
    "endDate": "2025-04-23T20:16:12.423Z",
    "progress": 100.0,
    "response": {"hello": "world"},
}
FAILURE = {
    **RUNNING,
    "status": "FAILURE",
    "endDate": "2025-04-23T20:16:12.423Z",
    "progress": 40.0,
    "errorMessage": "Argh!",
}


def error(status: int, number: int, description: str, **extra: Any) -> httpx.Response:
    body = {"status": "error", "error": {"number": number, "description": description, **extra}}
    return httpx.Response(status, json=body)


def success(status: int, data: dict[str, Any]) -> httpx.Response:
    return httpx.Response(status, json={"status": "success", "data": data})


class FakeGateway:
    """Answers like the gateway; `polls` is the sequence of states the task goes through."""

    def __init__(self, polls: list[dict[str, Any]] | None = None, stream: str = "none") -> None:
        """`stream`: "none" answers the event stream like a gateway without one (404000),
        "sse" sends every state as an event, "json" answers it like a poll (a proxy)."""
        self.requests: list[httpx.Request] = []
        self.polls = list(polls or [PENDING])
        self.idempotency: dict[str, str] = {}
        self.stream = stream

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        expected = "Basic " + base64.b64encode(b"demo:demo-secret").decode()
        if request.headers.get("Authorization") != expected:
            return error(403, 403001, "Forbidden.")
        raw_path = request.url.raw_path.decode().partition("?")[0]
        parts = [unquote(part) for part in raw_path.strip("/").split("/")]
        if parts[:2] != ["v1", "services"] or parts[2] not in ("sleeper", "a b?#"):
            return error(404, 404001, "Service not found.")
        if request.method == "POST":
            return self.create(request)
        if parts[4] != TASK_ID:
            return error(404, 404002, "Task not found.")
        if parts[5:] == ["events"] and self.stream == "none":
            return error(404, 404000, "Not found.")
        if parts[5:] == ["events"] and self.stream == "sse":
            events = "".join(
                f"event: task\nid: {i}\ndata: {json.dumps(state)}\n\n"
                for i, state in enumerate(self.polls, 1)
            )
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, content=events.encode()
            )
        return success(200, self.polls.pop(0) if len(self.polls) > 1 else self.polls[0])

    def create(self, request: httpx.Request) -> httpx.Response:
        payload = json.loads(request.content)
        if payload["body"].get("sleep") == "bad":
            errors = [{"path": "sleep", "message": "'bad' is not of type 'number'"}]
            return error(
                400,
                400001,
                "Error validating the body with the target service's json-schema.",
                errors=errors,
            )
        key = request.headers.get("Idempotency-Key")
        if key and key in self.idempotency:
            return success(200, {"taskId": self.idempotency[key], "taskPosition": 3})
        if key:
            self.idempotency[key] = TASK_ID
        return success(201, {"taskId": TASK_ID, "taskPosition": 3})


@pytest.fixture
def gateway() -> FakeGateway:
    return FakeGateway()


@pytest.fixture
def client(gateway: FakeGateway) -> Iterator[ConveyorClient]:
    with ConveyorClient(BASE, "demo", "demo-secret", transport=httpx.MockTransport(gateway)) as c:
        yield c


def test_submit_sends_the_body_callback_and_idempotency_key(
    client: ConveyorClient, gateway: FakeGateway
) -> None:
    first = client.submit(
        "sleeper", {"sleep": 5}, callback_url="https://hook.test/x", idempotency_key="k1"
    )
    again = client.submit("sleeper", {"sleep": 5}, idempotency_key="k1")

    assert first == Submitted(TASK_ID, 3, created=True)
    assert again == Submitted(TASK_ID, 3, created=False)
    sent = gateway.requests[0]
    assert (sent.method, sent.url.path) == ("POST", "/v1/services/sleeper/tasks")
    assert json.loads(sent.content) == {
        "body": {"sleep": 5},
        "callback": {"type": "https", "url": "https://hook.test/x"},
    }
    assert sent.headers["Idempotency-Key"] == "k1"
    assert json.loads(gateway.requests[1].content) == {"body": {"sleep": 5}}


def test_service_names_are_escaped_in_the_path(
    client: ConveyorClient, gateway: FakeGateway
) -> None:
    """Within one segment ('/' is refused: the gateway would route on it, see
    test_client_inputs.py)."""
    client.submit("a b?#", {})

    assert gateway.requests[0].url.raw_path == b"/v1/services/a%20b%3F%23/tasks"


def test_get_parses_each_status() -> None:
    polls = [PENDING, RUNNING, SUCCESS, FAILURE]
    with ConveyorClient(
        BASE, "demo", "demo-secret", transport=httpx.MockTransport(FakeGateway(polls))
    ) as c:
        pending, running, done, failed = (c.get("sleeper", TASK_ID) for _ in range(4))

    assert (pending.status, pending.task_position, pending.progress) == ("PENDING", 12, 0.0)
    assert pending.submition_date == datetime(2025, 4, 23, 18, 25, 43, 511000, tzinfo=UTC)
    assert pending.start_date is None and not pending.done
    assert (running.status, running.progress) == ("IN_PROGRESS", 10.0)
    assert running.start_date == datetime(2025, 4, 23, 20, 15, 11, 322000, tzinfo=UTC)
    assert done.succeeded and done.done and done.response == {"hello": "world"}
    assert done.end_date == datetime(2025, 4, 23, 20, 16, 12, 423000, tzinfo=UTC)
    assert failed.done and not failed.succeeded
    assert (failed.error_message, failed.progress) == ("Argh!", 40.0)
    assert failed.raw == FAILURE


@pytest.mark.parametrize(
    ("call", "status", "number", "description"),
    [
        (lambda c: c.get("nope", TASK_ID), 404, 404001, "Service not found."),
        (lambda c: c.get("sleeper", "other"), 404, 404002, "Task not found."),
        (lambda c: c.submit("nope", {}), 404, 404001, "Service not found."),
    ],
)
def test_error_envelopes_raise_conveyor_error(
    client: ConveyorClient, call: Any, status: int, number: int, description: str
) -> None:
    with pytest.raises(ConveyorError) as raised:
        call(client)

    assert (raised.value.http_status, raised.value.number, raised.value.description) == (
        status,
        number,
        description,
    )
    assert str(raised.value) == f"{number} {description}"


def test_schema_errors_carry_the_errors_list(client: ConveyorClient) -> None:
    with pytest.raises(ConveyorError) as raised:
        client.submit("sleeper", {"sleep": "bad"})

    assert raised.value.number == 400001
    assert raised.value.errors == [{"path": "sleep", "message": "'bad' is not of type 'number'"}]


def test_wrong_secret_is_forbidden(gateway: FakeGateway) -> None:
    with (
        ConveyorClient(BASE, "demo", "wrong", transport=httpx.MockTransport(gateway)) as c,
        pytest.raises(ConveyorError) as raised,
    ):
        c.get("sleeper", TASK_ID)

    assert (raised.value.http_status, raised.value.number) == (403, 403001)


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(502, text="<html>Bad Gateway</html>"),
        httpx.Response(200, json=[1, 2]),
        httpx.Response(200, json={"status": "success"}),
        httpx.Response(500, json={"status": "error", "error": "boom"}),
    ],
)
def test_answers_that_are_not_envelopes_raise_conveyor_error(answer: httpx.Response) -> None:
    with (
        ConveyorClient(BASE, "u", "p", transport=httpx.MockTransport(lambda _: answer)) as c,
        pytest.raises(ConveyorError) as raised,
    ):
        c.get("sleeper", TASK_ID)

    assert raised.value.http_status == answer.status_code
    assert raised.value.number == 0


def test_wait_polls_until_the_task_ends() -> None:
    gateway = FakeGateway([PENDING, RUNNING, RUNNING, SUCCESS])
    with ConveyorClient(BASE, "demo", "demo-secret", transport=httpx.MockTransport(gateway)) as c:
        task = c.wait("sleeper", TASK_ID, interval=0.01)

    assert task.status == "SUCCESS"
    # The stream is tried once (this gateway has none), then four polls.
    assert [r.url.path.endswith("/events") for r in gateway.requests] == [True] + [False] * 4


@pytest.mark.parametrize("stream", ["sse", "json"])
def test_follow_reads_the_stream_or_polls_past_a_proxy(stream: str) -> None:
    gateway = FakeGateway([PENDING, RUNNING, FAILURE], stream=stream)
    with ConveyorClient(BASE, "demo", "demo-secret", transport=httpx.MockTransport(gateway)) as c:
        seen = [t.status for t in c.follow("sleeper", TASK_ID, interval=0.01)]
    # A proxy's JSON answer is read as the first poll: polling goes on from the next state.
    expected = (
        ["PENDING", "IN_PROGRESS", "FAILURE"] if stream == "sse" else ["IN_PROGRESS", "FAILURE"]
    )
    assert seen == expected
    polls = [r for r in gateway.requests if not r.url.path.endswith("/events")]
    assert len(polls) == (0 if stream == "sse" else 2)


def test_follow_yields_every_poll() -> None:
    gateway = FakeGateway([PENDING, RUNNING, FAILURE])
    with ConveyorClient(BASE, "demo", "demo-secret", transport=httpx.MockTransport(gateway)) as c:
        seen = [t.status for t in c.follow("sleeper", TASK_ID, interval=0.01)]

    assert seen == ["PENDING", "IN_PROGRESS", "FAILURE"]


def test_wait_gives_up_after_its_timeout(client: ConveyorClient) -> None:
    with pytest.raises(TaskWaitTimeout) as raised:
        client.wait("sleeper", TASK_ID, timeout=0.1, interval=0.02)

    assert raised.value.task.status == "PENDING"


def test_network_errors_are_httpx_transport_errors() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with (
        ConveyorClient(BASE, "u", "p", transport=httpx.MockTransport(refuse)) as c,
        pytest.raises(httpx.TransportError),
    ):
        c.get("sleeper", TASK_ID)


def test_from_env(monkeypatch: pytest.MonkeyPatch, gateway: FakeGateway) -> None:
    monkeypatch.setenv("CONVEYOR_GATEWAY_URL", "http://gw.example:9000/")
    monkeypatch.setenv("CONVEYOR_CLIENT_ID", "demo")
    monkeypatch.setenv("CONVEYOR_CLIENT_SECRET", "demo-secret")
    with ConveyorClient.from_env(transport=httpx.MockTransport(gateway)) as c:
        c.get("sleeper", TASK_ID)

    assert (
        str(gateway.requests[0].url)
        == f"http://gw.example:9000/v1/services/sleeper/tasks/{TASK_ID}"
    )


def test_from_env_defaults_to_loopback_and_requires_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CONVEYOR_GATEWAY_URL", raising=False)
    monkeypatch.setenv("CONVEYOR_CLIENT_ID", "demo")
    monkeypatch.setenv("CONVEYOR_CLIENT_SECRET", "s")
    with ConveyorClient.from_env() as c:
        assert c.config.base_url == "http://127.0.0.1:8000"

    monkeypatch.delenv("CONVEYOR_CLIENT_SECRET")
    with pytest.raises(ValueError, match="CONVEYOR_CLIENT_SECRET"):
        AsyncConveyorClient.from_env()


async def test_async_client_has_the_same_behaviour() -> None:
    gateway = FakeGateway([PENDING, RUNNING, SUCCESS])
    async with AsyncConveyorClient(
        BASE, "demo", "demo-secret", transport=httpx.MockTransport(gateway)
    ) as c:
        submitted = await c.submit("sleeper", {"sleep": 1}, idempotency_key="k")
        task = await c.wait("sleeper", submitted.task_id, interval=0.01)
        with pytest.raises(ConveyorError) as raised:
            await c.get("nope", TASK_ID)

    assert submitted == Submitted(TASK_ID, 3, created=True)
    assert gateway.requests[0].headers["Idempotency-Key"] == "k"
    assert (task.status, task.response) == ("SUCCESS", {"hello": "world"})
    assert raised.value.number == 404001


async def test_async_wait_timeout() -> None:
    transport = httpx.MockTransport(FakeGateway())
    async with AsyncConveyorClient(BASE, "demo", "demo-secret", transport=transport) as c:
        with pytest.raises(TaskWaitTimeout):
            await c.wait("sleeper", TASK_ID, timeout=0.05, interval=0.01)


# --- the `conveyor task` CLI ---------------------------------------------------------------


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[CliRunner, FakeGateway]]:
    gateway = FakeGateway([PENDING, RUNNING, SUCCESS])
    fake = partial(ConveyorClient, transport=httpx.MockTransport(gateway))
    monkeypatch.setattr(task_cli, "ConveyorClient", fake)
    monkeypatch.setenv("CONVEYOR_CLIENT_ID", "demo")
    monkeypatch.setenv("CONVEYOR_CLIENT_SECRET", "demo-secret")
    monkeypatch.delenv("CONVEYOR_SERVICE", raising=False)
    yield CliRunner(), gateway


def run(runner: CliRunner, *args: str) -> Any:
    return runner.invoke(task_cli.app, list(args))


def test_cli_submit_prints_task_id_and_position(cli: tuple[CliRunner, FakeGateway]) -> None:
    runner, gateway = cli
    result = run(
        runner, "submit", "sleeper", "--body", '{"sleep": 5}', "--callback", "https://h.test/cb"
    )

    assert result.exit_code == 0, result.output
    assert f"taskId: {TASK_ID}" in result.stdout
    assert "taskPosition: 3" in result.stdout
    assert json.loads(gateway.requests[0].content)["callback"]["url"] == "https://h.test/cb"


def test_cli_submit_wait_watches_until_success(cli: tuple[CliRunner, FakeGateway]) -> None:
    runner, _ = cli
    result = run(runner, "submit", "sleeper", "-b", '{"sleep": 1}', "--wait", "--interval", "0.01")

    assert result.exit_code == 0, result.output
    assert "IN_PROGRESS 10.0%" in result.stderr
    assert "SUCCESS" in result.stdout
    assert '"hello": "world"' in result.stdout


def test_cli_rejects_a_body_that_is_not_a_json_object(cli: tuple[CliRunner, FakeGateway]) -> None:
    runner, gateway = cli
    for body in ("[1]", "{nope"):
        result = run(runner, "submit", "sleeper", "--body", body)
        assert result.exit_code == 2
    assert gateway.requests == []


@pytest.mark.parametrize(
    "args",
    [
        ("get", "sleeper", TASK_ID),
        ("get", TASK_ID, "--service", "sleeper"),
        ("get", TASK_ID, "-s", "sleeper"),
    ],
)
def test_cli_get_accepts_both_forms(
    cli: tuple[CliRunner, FakeGateway], args: tuple[str, ...]
) -> None:
    runner, gateway = cli
    result = run(runner, *args)

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == PENDING
    assert gateway.requests[0].url.path == f"/v1/services/sleeper/tasks/{TASK_ID}"


def test_cli_service_from_env(
    cli: tuple[CliRunner, FakeGateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, _ = cli
    monkeypatch.setenv("CONVEYOR_SERVICE", "sleeper")

    assert run(runner, "get", TASK_ID).exit_code == 0


def test_cli_without_a_service_says_so(cli: tuple[CliRunner, FakeGateway]) -> None:
    runner, gateway = cli
    result = run(runner, "watch", TASK_ID)

    assert result.exit_code == 2
    assert "CONVEYOR_SERVICE" in result.stderr
    assert gateway.requests == []


def test_cli_watch_exits_1_on_failure_with_the_error_message(
    monkeypatch: pytest.MonkeyPatch, cli: tuple[CliRunner, FakeGateway]
) -> None:
    runner, _ = cli
    failing = FakeGateway([RUNNING, FAILURE])
    monkeypatch.setattr(
        task_cli, "ConveyorClient", partial(ConveyorClient, transport=httpx.MockTransport(failing))
    )

    result = run(runner, "watch", TASK_ID, "--service", "sleeper", "--interval", "0.01")

    assert result.exit_code == 1
    assert "FAILURE: Argh!" in result.stderr


def test_cli_watch_exits_0_on_success(cli: tuple[CliRunner, FakeGateway]) -> None:
    runner, _ = cli
    result = run(runner, "watch", "sleeper", TASK_ID, "--interval", "0.01")

    assert result.exit_code == 0, result.output
    assert [line.split()[0] for line in result.stderr.splitlines()] == [
        "PENDING",
        "IN_PROGRESS",
        "SUCCESS",
    ]


def test_cli_prints_gateway_errors_without_traceback(cli: tuple[CliRunner, FakeGateway]) -> None:
    runner, _ = cli
    result = run(runner, "submit", "sleeper", "--body", '{"sleep": "bad"}')

    assert result.exit_code == 1
    assert "400001 Error validating the body" in result.stderr
    assert "sleep: 'bad' is not of type 'number'" in result.stderr
    assert "Traceback" not in result.output


def test_cli_connection_errors_exit_1(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    monkeypatch.setattr(
        task_cli, "ConveyorClient", partial(ConveyorClient, transport=httpx.MockTransport(refuse))
    )
    result = CliRunner().invoke(
        task_cli.app,
        [
            "get",
            "sleeper",
            TASK_ID,
            "--client-id",
            "a",
            "--client-secret",
            "b",
            "--gateway",
            "http://gw.test:1",
        ],
    )

    assert result.exit_code == 1
    assert "cannot reach the gateway at http://gw.test:1" in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_cli_requires_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_CLIENT_ID", raising=False)
    monkeypatch.delenv("CONVEYOR_CLIENT_SECRET", raising=False)

    result = CliRunner().invoke(task_cli.app, ["get", "sleeper", TASK_ID])

    assert result.exit_code == 1
    assert "CONVEYOR_CLIENT_ID" in result.stderr


# --- answers the SDK cannot read, control characters, Retry-After -------------------------

DEEP = "[" * 100_000 + "]" * 100_000


def _raw(status: int, text: str, **headers: str) -> httpx.Response:
    return httpx.Response(
        status, headers={"content-type": "application/json", **headers}, text=text
    )


ODD_ANSWERS = {
    "data without taskId": _raw(200, '{"status":"success","data":{"status":"PENDING"}}'),
    "data without status": _raw(201, '{"status":"success","data":{"taskId":"x"}}'),
    "progress a string": _raw(
        200, '{"status":"success","data":{"taskId":"x","status":"PENDING","progress":"lots"}}'
    ),
    "taskId an object": _raw(200, '{"status":"success","data":{"taskId":{},"status":"SUCCESS"}}'),
    "number a string": _raw(
        400, '{"status":"error","error":{"number":"four hundred","description":"bad"}}'
    ),
    "tasks a string": _raw(201, '{"status":"success","data":{"tasks":"x"}}'),
    "tasks of strings": _raw(201, '{"status":"success","data":{"tasks":["x"]}}'),
    "deeply nested": _raw(
        200, '{"status":"success","data":{"taskId":"x","response":' + DEEP + "}}"
    ),
}


# A created task is read for its taskId (and position) only.
READABLE_FOR_SUBMIT = {"data without status", "progress a string"}


@pytest.mark.parametrize(
    ("call", "answer"),
    [
        pytest.param(call, answer, id=f"{call}-{name}")
        for call in ("get", "submit", "submit_batch", "cancel")
        for name, answer in ODD_ANSWERS.items()
        if not (call == "submit" and name in READABLE_FOR_SUBMIT)
    ],
)
def test_answers_the_sdk_cannot_read_raise_conveyor_error(
    call: str, answer: httpx.Response
) -> None:
    calls = {
        "get": lambda c: c.get("sleeper", TASK_ID),
        "submit": lambda c: c.submit("sleeper", {}),
        "submit_batch": lambda c: c.submit_batch("sleeper", [{"body": {}}]),
        "cancel": lambda c: c.cancel("sleeper", TASK_ID),
    }
    with (
        ConveyorClient(BASE, "u", "p", transport=httpx.MockTransport(lambda _: answer)) as c,
        pytest.raises(ConveyorError) as raised,
    ):
        calls[call](c)

    assert raised.value.http_status == answer.status_code
    assert raised.value.number == 0
    assert raised.value.description.startswith("unexpected answer from the gateway: ")


@pytest.mark.parametrize("progress", ["NaN", "Infinity", "-Infinity"])
def test_a_progress_that_is_not_finite_reads_as_zero(progress: str) -> None:
    data = f'"taskId":"{TASK_ID}","status":"PENDING","progress":{progress}'
    body = '{"status":"success","data":{' + data + "}}"
    answer = _raw(200, body)
    with ConveyorClient(BASE, "u", "p", transport=httpx.MockTransport(lambda _: answer)) as c:
        assert c.get("sleeper", TASK_ID).progress == 0.0


@pytest.mark.parametrize(
    ("errors", "kept"),
    [
        ('"oops"', []),
        ('["oops"]', []),
        ('[{"path": "a", "message": "m"}, "oops", 3]', [{"path": "a", "message": "m"}]),
    ],
)
def test_errors_are_kept_only_as_a_list_of_objects(errors: str, kept: list[Any]) -> None:
    body = f'{{"status":"error","error":{{"number":400002,"description":"bad","errors":{errors}}}}}'
    answer = _raw(400, body)
    with (
        ConveyorClient(BASE, "u", "p", transport=httpx.MockTransport(lambda _: answer)) as c,
        pytest.raises(ConveyorError) as raised,
    ):
        c.submit("sleeper", {})

    assert (raised.value.number, raised.value.description) == (400002, "bad")
    assert raised.value.errors == kept


def test_stream_events_the_sdk_cannot_read_are_skipped() -> None:
    bad = {**RUNNING, "progress": "z"}
    events = (
        "event: task\ndata: {not json\n\n"
        "event: task\ndata: [1]\n\n"
        f"event: task\ndata: {json.dumps(bad)}\n\n"
        'event: task\ndata: {"status": "SUCCESS"}\n\n'
        f"event: task\ndata: {'[' * 100_000}\n\n"
        f"event: task\ndata: {json.dumps(SUCCESS)}\n\n"
    )
    answer = httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=events.encode()
    )
    with ConveyorClient(BASE, "u", "p", transport=httpx.MockTransport(lambda _: answer)) as c:
        seen = [t.status for t in c.follow("sleeper", TASK_ID, interval=0.01)]

    assert seen == ["SUCCESS"]


@pytest.mark.parametrize(
    ("header", "expected"),
    [({"Retry-After": "1"}, 1.0), ({"Retry-After": "2.5"}, 2.5), ({}, None)]
    + [
        ({"Retry-After": bad}, None)
        for bad in ("soon", "nan", "-3", "Wed, 21 Oct 2015 07:28:00 GMT")
    ],
)
def test_conveyor_error_carries_retry_after(header: dict[str, str], expected: float | None) -> None:
    answers = [
        httpx.Response(
            503,
            headers=header,
            json={"status": "error", "error": {"number": 503001, "description": "down"}},
        ),
        httpx.Response(502, headers=header, text="<html>Bad Gateway</html>"),
    ]
    for answer in answers:
        transport = httpx.MockTransport(lambda _, a=answer: a)
        with ConveyorClient(BASE, "u", "p", transport=transport) as c:
            with pytest.raises(ConveyorError) as raised:
                c.get("sleeper", TASK_ID)
        assert raised.value.retry_after == expected


def _cli_against(monkeypatch: pytest.MonkeyPatch, answer: httpx.Response) -> None:
    transport = httpx.MockTransport(lambda _: answer)
    monkeypatch.setattr(task_cli, "ConveyorClient", partial(ConveyorClient, transport=transport))


CLI_COMMANDS = {
    "get": ["get", "sleeper", TASK_ID],
    "submit": ["submit", "sleeper", "-b", "{}"],
    "watch": ["watch", "sleeper", TASK_ID, "--timeout", "0.5", "--interval", "0.01"],
    "cancel": ["cancel", "sleeper", TASK_ID],
}

HOSTILE_ANSWERS = {
    **ODD_ANSWERS,
    "progress NaN": _raw(
        200, '{"status":"success","data":{"taskId":"x","status":"PENDING","progress":NaN}}'
    ),
    "errors a string": _raw(
        400, '{"status":"error","error":{"number":400002,"description":"bad","errors":"oops"}}'
    ),
    "errors of strings": _raw(
        400, '{"status":"error","error":{"number":400002,"description":"bad","errors":["oops"]}}'
    ),
    "sse progress a string": httpx.Response(
        200,
        headers={"content-type": "text/event-stream"},
        content=b'event: task\ndata: {"taskId":"x","status":"SUCCESS","progress":"z"}\n\n',
    ),
}


@pytest.mark.parametrize("answer", HOSTILE_ANSWERS.values(), ids=HOSTILE_ANSWERS.keys())
@pytest.mark.parametrize("command", CLI_COMMANDS.values(), ids=CLI_COMMANDS.keys())
def test_cli_prints_no_traceback_for_any_answer(
    cli: tuple[CliRunner, FakeGateway],
    monkeypatch: pytest.MonkeyPatch,
    answer: httpx.Response,
    command: list[str],
) -> None:
    runner, _ = cli
    _cli_against(monkeypatch, answer)
    result = run(runner, *command)

    # Readable enough for this command (submit reads only the taskId): 0; otherwise 1.
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code in (0, 1), result.output
    assert "Traceback" not in result.output


def test_cli_strips_control_characters_from_the_gateways_text(
    cli: tuple[CliRunner, FakeGateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, _ = cli
    description = "bad\x1b[2J\x07 \x9b31m news\r\nline\ttab"
    errors = [{"path": "a\x1b[1A", "message": "m\x9d\x00"}]
    _cli_against(monkeypatch, error(400, 400002, description, errors=errors))
    result = run(runner, "submit", "sleeper", "-b", "{}")

    assert result.exit_code == 1
    assert "bad[2J 31m news\nline" in result.stderr  # rich expands the tab
    assert "a[1A: m" in result.stderr
    assert not any(ch in result.stderr for ch in "\x1b\x07\x9b\x9d\x00\r")


def test_cli_strips_control_characters_from_tasks(
    cli: tuple[CliRunner, FakeGateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, _ = cli
    failed = {**FAILURE, "taskId": TASK_ID, "errorMessage": "Argh\x1b[2J\x9b!"}
    _cli_against(monkeypatch, success(200, failed))
    watched = run(runner, "watch", "sleeper", TASK_ID, "--interval", "0.01")
    got = run(runner, "get", "sleeper", TASK_ID)

    assert "FAILURE: Argh[2J!" in watched.stderr
    assert json.loads(got.stdout) == failed  # the JSON is the same, its characters escaped
    for result in (watched, got):
        assert not any(ch in result.output for ch in "\x1b\x07\x9b"), repr(result.output)


def test_cli_error_line_mentions_retry_after(
    cli: tuple[CliRunner, FakeGateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, _ = cli
    answer = httpx.Response(
        503,
        headers={"Retry-After": "1"},
        json={"status": "error", "error": {"number": 503001, "description": "down"}},
    )
    _cli_against(monkeypatch, answer)
    result = run(runner, "get", "sleeper", TASK_ID)

    assert result.exit_code == 1
    assert "503001 down (HTTP 503, retry after 1 s)" in result.stderr
