"""What the SDK refuses before any request: a pause or deadline that is not a number of seconds,
a body that is not JSON (NaN, Infinity), an Idempotency-Key the gateway would not take, and a
task id or service name that is not one path segment. And a short deadline against a healthy
gateway ends in TaskWaitTimeout, sync and async alike."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from conveyor.client import AsyncConveyorClient, ConveyorClient, ConveyorError, TaskWaitTimeout
from tests.unit.test_client_following import PENDING, TASK_ID, Gateway, Handler, event

BASE = "http://gateway.test"


class Recorder:
    """Answers every request like a gateway where the task stays PENDING; keeps the requests."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        data = {"taskId": TASK_ID, "taskPosition": 1} if request.method == "POST" else PENDING
        if request.url.path.endswith("/batch"):
            data = {"tasks": [{"taskId": TASK_ID, "taskPosition": 1}]}
        return httpx.Response(201, json={"status": "success", "data": data})


def call(
    flavour: str, method: str, *args: Any, recorder: Recorder | None = None, **kwargs: Any
) -> tuple[Any, Recorder]:
    """`method` of a client of either flavour, against a Recorder; its result and the Recorder
    (a follow's tasks are listed)."""
    recorder = recorder or Recorder()
    if flavour == "sync":
        with ConveyorClient(BASE, "u", "p", transport=httpx.MockTransport(recorder)) as client:
            result = getattr(client, method)(*args, **kwargs)
            return (list(result) if method == "follow" else result), recorder

    async def run() -> Any:
        transport = httpx.MockTransport(recorder)
        async with AsyncConveyorClient(BASE, "u", "p", transport=transport) as client:
            if method == "follow":
                return [t async for t in client.follow(*args, **kwargs)]
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(run()), recorder


def refused(flavour: str, method: str, *args: Any, **kwargs: Any) -> str:
    """The ValueError's message; fails the test if a request was made."""
    recorder = Recorder()
    with pytest.raises(ValueError) as raised:
        call(flavour, method, *args, recorder=recorder, **kwargs)
    assert recorder.requests == []
    return str(raised.value)


FLAVOURS = pytest.mark.parametrize("flavour", ["sync", "async"])


# --- 1. interval and timeout ----------------------------------------------------------------


@FLAVOURS
@pytest.mark.parametrize("method", ["wait", "follow"])
@pytest.mark.parametrize("interval", [-1.0, -0.001, math.nan, math.inf])
def test_an_interval_that_is_not_seconds_is_refused_at_the_call(
    flavour: str, method: str, interval: float
) -> None:
    message = refused(flavour, method, "sleeper", TASK_ID, timeout=5, interval=interval)
    assert "interval" in message


@FLAVOURS
@pytest.mark.parametrize("method", ["wait", "follow"])
@pytest.mark.parametrize("timeout", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_a_timeout_that_is_not_positive_seconds_is_refused_at_the_call(
    flavour: str, method: str, timeout: float
) -> None:
    message = refused(flavour, method, "sleeper", TASK_ID, timeout=timeout)
    assert "timeout" in message


def test_the_sync_follow_refuses_before_it_is_iterated() -> None:
    with ConveyorClient(BASE, "u", "p", transport=httpx.MockTransport(Recorder())) as client:
        with pytest.raises(ValueError, match="interval"):
            client.follow("sleeper", TASK_ID, interval=-1)


@FLAVOURS
def test_an_interval_of_zero_is_fine(flavour: str) -> None:
    with pytest.raises(TaskWaitTimeout):
        call(flavour, "wait", "sleeper", TASK_ID, timeout=0.2, interval=0)


# --- 2. NaN and Infinity are not JSON -----------------------------------------------------


@FLAVOURS
@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
def test_a_body_with_nan_or_infinity_is_refused(flavour: str, number: float) -> None:
    message = refused(flavour, "submit", "sleeper", {"a": [1, {"x": number}]})
    assert "NaN" in message and "Infinity" in message
    assert "a/1/x" in message


@FLAVOURS
def test_a_batch_with_nan_is_refused(flavour: str) -> None:
    tasks = [{"body": {}}, {"body": {"sleep": math.nan}}]
    message = refused(flavour, "submit_batch", "sleeper", tasks)
    assert "tasks/1/body/sleep" in message


# --- 3. Idempotency-Key -----------------------------------------------------------------


@FLAVOURS
@pytest.mark.parametrize("method", ["submit", "submit_batch"])
@pytest.mark.parametrize(
    "key", ["ключ", "a\nb", "a\tb", "", " lead", "trail ", "k" * 201], ids=lambda k: repr(k[:8])
)
def test_an_idempotency_key_the_gateway_would_not_take_is_refused(
    flavour: str, method: str, key: str
) -> None:
    payload: Any = {} if method == "submit" else [{"body": {}}]
    message = refused(flavour, method, "sleeper", payload, idempotency_key=key)
    assert "Idempotency-Key" in message


@pytest.mark.parametrize("key", ["k" * 200, "order 42/x~!"], ids=["200", "spaced"])
def test_an_idempotency_key_of_visible_ascii_is_sent(key: str) -> None:
    _, recorder = call("sync", "submit", "sleeper", {}, idempotency_key=key)
    assert recorder.requests[0].headers["Idempotency-Key"] == key


# --- 7. one path segment ----------------------------------------------------------------

NOT_A_SEGMENT = ["", ".", "..", "/", f"{TASK_ID}/events", "a\nb", "a\x00b", "a\x7fb"]


@FLAVOURS
@pytest.mark.parametrize("method", ["get", "cancel", "wait"])
@pytest.mark.parametrize("task_id", NOT_A_SEGMENT, ids=repr)
def test_a_task_id_that_is_not_one_path_segment_is_refused(
    flavour: str, method: str, task_id: str
) -> None:
    message = refused(flavour, method, "sleeper", task_id)
    assert "task id" in message


@FLAVOURS
@pytest.mark.parametrize("service", NOT_A_SEGMENT, ids=repr)
def test_a_service_name_that_is_not_one_path_segment_is_refused(flavour: str, service: str) -> None:
    assert "service" in refused(flavour, "get", service, TASK_ID)
    assert "service" in refused(flavour, "submit", service, {})


@FLAVOURS
@pytest.mark.parametrize("method", ["get", "cancel", "submit"])
def test_an_id_too_long_for_a_url_is_a_value_error(flavour: str, method: str) -> None:
    """Found by a black-box sweep: 70,000 characters raised httpx.InvalidURL, which no caller
    of the SDK expects (the CLI printed its traceback)."""
    long = "a" * 70_000
    args = (long, {}) if method == "submit" else ("sleeper", long)
    assert "URL" in refused(flavour, method, *args)


@pytest.mark.parametrize("task_id", ["not-a-uuid", "a b", "%2F", "...", "ключ"])
def test_an_id_the_gateway_never_issued_still_goes_to_the_gateway(task_id: str) -> None:
    """The gateway answers 404002 for those: refusing them is its call, not the SDK's."""

    def unknown(request: httpx.Request) -> httpx.Response:
        error = {"number": 404002, "description": "Task not found."}
        return httpx.Response(404, json={"status": "error", "error": error})

    with ConveyorClient(BASE, "u", "p", transport=httpx.MockTransport(unknown)) as client:
        with pytest.raises(ConveyorError) as raised:
            client.get("sleeper", task_id)
    assert raised.value.number == 404002


# --- 5. a short deadline against a healthy gateway ------------------------------------------


@pytest.fixture
def healthy() -> Iterator[Gateway]:
    """The task stays PENDING: the stream sends it, then only heartbeats; polls answer it."""

    def script(h: Handler) -> None:
        if h.path.endswith("/events"):
            h.stream([event(PENDING), 5.0, ": ping\n\n"])
        else:
            h.envelope(200, {"status": "success", "data": PENDING})

    server = Gateway(script)
    yield server
    server.released.set()
    server.shutdown()
    server.server_close()


def wait_on(flavour: str, url: str, **kwargs: Any) -> Any:
    if flavour == "sync":
        with ConveyorClient(url, "u", "p") as client:
            return client.wait("sleeper", TASK_ID, **kwargs)

    async def run() -> Any:
        async with AsyncConveyorClient(url, "u", "p") as client:
            return await client.wait("sleeper", TASK_ID, **kwargs)

    return asyncio.run(run())


@FLAVOURS
@pytest.mark.parametrize("timeout", [1e-9, 0.001, 0.05, 0.3])
def test_a_short_timeout_against_a_healthy_gateway_gives_up_waiting(
    healthy: Gateway, flavour: str, timeout: float
) -> None:
    for _ in range(5):
        with pytest.raises(TaskWaitTimeout) as raised:
            wait_on(flavour, healthy.url, timeout=timeout, interval=0.01)
        assert raised.value.task.status == "PENDING"


# --- 6. a body nested too deep for JSON -------------------------------------------------------


def nested(levels: int) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for _ in range(levels):
        body = {"a": body}
    return body


@FLAVOURS
@pytest.mark.parametrize("levels", [3_000, 100_000])
def test_a_body_nested_too_deep_is_refused(flavour: str, levels: int) -> None:
    """It was a RecursionError out of json.dumps, not the ValueError documented."""
    message = refused(flavour, "submit", "sleeper", nested(levels))
    assert "nested too deep" in message


@FLAVOURS
def test_a_batch_nested_too_deep_is_refused(flavour: str) -> None:
    message = refused(flavour, "submit_batch", "sleeper", [{"body": nested(3_000)}])
    assert "nested too deep" in message


@FLAVOURS
def test_a_body_that_holds_itself_is_refused(flavour: str) -> None:
    """Found by a review: json.dumps refuses it ("Circular reference detected"), and the
    search for the NaN it was taken for went round the loop for ever."""
    body: dict[str, Any] = {}
    body["self"] = body
    message = refused(flavour, "submit", "sleeper", body)
    assert "Circular reference" in message


@FLAVOURS
@pytest.mark.parametrize(
    ("body", "where"),
    [({"a": [1, {"x": "half \ud800 a pair"}]}, "a/1/x"), ({"k\udc00": 1}, "a key")],
    ids=["value", "key"],
)
def test_a_body_with_a_lone_surrogate_is_refused_saying_where(
    flavour: str, body: dict[str, Any], where: str
) -> None:
    """Half a UTF-16 pair (`"\\ud800"` escaped in JSON the SDK was given) is no Unicode text:
    the request could not be encoded, and the error was only "'utf-8' codec can't encode
    character '\\ud800' in position 14: surrogates not allowed"."""
    message = refused(flavour, "submit", "sleeper", body)
    assert "lone surrogate" in message and where in message, message
