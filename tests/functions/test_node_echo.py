"""The Node echo function: the contract works from another language, with no SDK."""

from __future__ import annotations

import shutil
import signal

import httpx
import pytest

from tests.functions.conftest import ProgressSink, RunningFunction, StartFunction

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(
    NODE is None, reason="`node` is not on PATH (make test installs it)"
)


@pytest.fixture
def echo(start_function: StartFunction) -> RunningFunction:
    assert NODE is not None
    return start_function("node-echo", [NODE, "functions/node-echo/server.js"])


def test_echoes_body_task_id_and_attempt_and_reports_progress(
    echo: RunningFunction, progress_sink: ProgressSink
) -> None:
    headers = {
        "ce-id": "node-task-1",
        "ce-specversion": "1.0",
        "X-Conveyor-Attempt": "3",
        "X-Conveyor-Progress-Url": progress_sink.url,
    }
    with httpx.Client(trust_env=False, timeout=10) as http:
        answer = http.post(f"{echo.url}/", json={"a": [1, 2], "b": None}, headers=headers)

    assert answer.status_code == 200
    assert answer.json() == {
        "echo": {"a": [1, 2], "b": None},
        "taskId": "node-task-1",
        "attempt": 3,
    }
    assert progress_sink.wait_for(1) == [50]


def test_invalid_json_is_a_400(echo: RunningFunction) -> None:
    with httpx.Client(trust_env=False, timeout=10) as http:
        answer = http.post(f"{echo.url}/", content=b"{oops", headers={"ce-id": "x"})

    assert answer.status_code == 400
    assert answer.json() == {"errorMessage": "invalid JSON"}


def test_exits_zero_on_sigterm(echo: RunningFunction) -> None:
    echo.proc.signal(signal.SIGTERM)

    assert echo.proc.wait(timeout=10) == 0
