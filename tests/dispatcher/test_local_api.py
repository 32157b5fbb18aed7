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
        assert (await http.get(f"{dispatcher.base}/healthz")).json() == {"status": "ok"}

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
