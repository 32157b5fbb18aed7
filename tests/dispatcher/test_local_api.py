"""The dispatcher's local API (dispatcher/api.py) against what a confused or hostile caller
sends it: every answer is the SPEC's, the sidecar keeps running, and a task in flight still
takes its progress afterwards."""

from __future__ import annotations

import socket
import uuid

import httpx
import pytest

from conveyor.events import EventKind
from tests.dispatcher.conftest import FakeFunction, Launch, Rabbit, eventually

pytestmark = pytest.mark.timeout(60)


def _number(answer: httpx.Response) -> int:
    return int(answer.json()["error"]["number"])


async def test_hostile_requests_get_the_specs_answers_and_break_nothing(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"sleep": 3})
    await function.wait_calls(task_id)
    progress = f"{dispatcher.base}/tasks/{task_id}/progress"

    async with httpx.AsyncClient(timeout=10) as http:
        too_big = await http.post(progress, content=b"{" + b" " * (64 * 1024 + 1) + b"}")
        assert (too_big.status_code, _number(too_big)) == (413, 413001)
        for body in (b"not json", b'{"progress": NaN}', b'{"progress": 1e999}', b"[1]", b"\x00"):
            refused = await http.post(progress, content=body)
            assert (refused.status_code, _number(refused)) == (400, 400002), body
        undershoot = await http.post(progress, json={"progress": -0.4})  # clamped to 0
        assert undershoot.status_code == 204
        unknown = await http.post(f"{dispatcher.base}/tasks/{uuid.uuid4()}/progress", json={})
        assert (unknown.status_code, _number(unknown)) == (404, 404002)
        not_a_task = await http.post(f"{dispatcher.base}/tasks/%00/progress", json={})
        assert (not_a_task.status_code, _number(not_a_task)) == (404, 404002)
        assert (await http.get(progress)).status_code == 405
        assert (await http.get(f"{dispatcher.base}/nowhere")).status_code == 404
        metrics = await http.get(f"{dispatcher.base}/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
        assert "conveyor_dispatcher_tasks_in_flight" in metrics.text
        assert (await http.get(f"{dispatcher.base}/healthz")).json() == {
            "status": "success",
            "data": {"alive": True},
        }

    # Bytes that are not HTTP at all, then a connection left half-sent.
    with socket.create_connection(("127.0.0.1", dispatcher.port), timeout=5) as raw:
        raw.sendall(b"\x16\x03\x01 not http\r\n\r\n")
        assert raw.recv(64).split(b"\r\n")[0].endswith(b" 400 Bad Request")
    half = socket.create_connection(("127.0.0.1", dispatcher.port), timeout=5)
    half.sendall(b"POST /tasks/x/progress HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")

    async with httpx.AsyncClient(timeout=10) as http:
        taken = await http.post(progress, json={"progress": 42})
        assert taken.status_code == 204
        assert (await http.get(f"{dispatcher.base}/readyz")).status_code == 200
    half.close()
    done = await rabbit.wait_terminal(task_id)
    assert done.kind is EventKind.SUCCEEDED
    await eventually(
        lambda: 42.0 in [e.progress for e in rabbit.of(task_id) if e.kind is EventKind.PROGRESS],
        10,
        "the progress taken after the hostile requests",
    )


async def test_a_refusal_before_the_body_came_says_it_closes_the_connection(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """Found by CI: a refused report whose body had not all arrived was answered keep-alive,
    then its connection closed (the unread body is not drained); the client's next request,
    sent on that connection at once, failed with httpx.ReadError. The answer now says so."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    with socket.create_connection(("127.0.0.1", dispatcher.port), timeout=5) as raw:
        head = f"POST /tasks/{uuid.uuid4()}/progress HTTP/1.1\r\nHost: x\r\n"
        raw.sendall(f"{head}Content-Length: 20\r\n\r\n{{".encode())  # 19 bytes to come
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += raw.recv(4096)
        lines = answer.split(b"\r\n\r\n")[0].lower().split(b"\r\n")
        assert lines[0].endswith(b" 404 not found"), lines
        assert b"connection: close" in lines, lines
    # A refusal of a body that came whole (sent in one piece) keeps the connection.
    with socket.create_connection(("127.0.0.1", dispatcher.port), timeout=5) as raw:
        pending = b""
        for _ in range(3):
            raw.sendall(f"{head}Content-Length: 2\r\n\r\n{{}}".encode())
            while b"\r\n\r\n" not in pending:
                pending += raw.recv(4096)
            header, _, pending = pending.partition(b"\r\n\r\n")
            lines = header.lower().split(b"\r\n")
            assert lines[0] == b"http/1.1 404 not found", lines
            assert b"connection: close" not in lines, lines
            length = int(
                next(v for k, _, v in (x.partition(b": ") for x in lines) if k == b"content-length")
            )
            while len(pending) < length:
                pending += raw.recv(4096)
            pending = pending[length:]


async def test_an_integer_too_big_for_a_float_is_clamped_not_a_500(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """`{"progress": <400 digits>}` is valid JSON that float() cannot hold (OverflowError):
    it answered 500. It is clamped like 1e308 is."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"sleep": 2})
    await function.wait_calls(task_id)
    progress = f"{dispatcher.base}/tasks/{task_id}/progress"

    async with httpx.AsyncClient(timeout=10) as http:
        below = await http.post(progress, content=b'{"progress": -' + b"9" * 400 + b"}")
        above = await http.post(progress, content=b'{"progress": ' + b"9" * 400 + b"}")

    assert (below.status_code, above.status_code) == (204, 204)
    await eventually(
        lambda: 100.0 in [e.progress for e in rabbit.of(task_id) if e.kind is EventKind.PROGRESS],
        10,
        "the clamped progress",
    )
    assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED


async def test_a_client_gone_mid_body_or_sending_bad_http_is_no_error_in_the_log(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """A progress report cut mid-body, or HTTP the server cannot parse, was logged as ERROR
    "Error handling request" with a traceback (and a bad chunked body answered 500): the
    client's doing, not the dispatcher's, like a client gone mid-body at the gateway."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"sleep": 3})
    await function.wait_calls(task_id)
    path = f"/tasks/{task_id}/progress".encode()

    with socket.create_connection(("127.0.0.1", dispatcher.port), timeout=5) as cut:
        cut.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    for bad in (
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ):
        with socket.create_connection(("127.0.0.1", dispatcher.port), timeout=5) as raw:
            raw.sendall(bad)
            assert raw.recv(64).split(b"\r\n")[0].endswith(b" 400 Bad Request"), bad
    await eventually(
        lambda: any(
            r.get("message") == "progress report not received whole"
            for r in dispatcher.log_records()
        ),
        10,
        "the cut report's line",
    )

    async with httpx.AsyncClient(timeout=10) as http:
        taken = await http.post(f"{dispatcher.base}/tasks/{task_id}/progress", json={"progress": 7})
        assert taken.status_code == 204
    logs = dispatcher.proc.logs()
    assert "Error handling request" not in logs
    assert "Traceback" not in logs
    assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED
