"""The sleeper function, run as a real process and called the way the dispatcher calls it."""

from __future__ import annotations

import signal
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.functions.conftest import ProgressSink, RunningFunction, StartFunction
from tests.support.processes import PYTHON, free_port

SLEEPER = [PYTHON, "functions/sleeper/main.py"]


def call(
    fn: RunningFunction,
    body: dict[str, Any] | str,
    task_id: str = "task-1",
    attempt: int = 1,
    progress_url: str | None = None,
    timeout: float = 15.0,
) -> httpx.Response:
    headers = {
        "ce-id": task_id,
        "ce-type": "io.conveyor.task.submitted",
        "ce-source": "/v1/services/sleeper",
        "ce-subject": task_id,
        "ce-specversion": "1.0",
        "X-Conveyor-Task-Id": task_id,
        "X-Conveyor-Attempt": str(attempt),
        "Content-Type": "application/json",
    }
    if progress_url:
        headers["X-Conveyor-Progress-Url"] = progress_url
    content = body if isinstance(body, str) else None
    payload = None if isinstance(body, str) else body
    with httpx.Client(trust_env=False, timeout=timeout) as http:
        return http.post(f"{fn.url}/", json=payload, content=content, headers=headers)


def log_lines(path: Path, count: int, timeout: float = 5.0) -> list[list[str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return [line.split("\t") for line in lines]
        time.sleep(0.05)
    return [line.split("\t") for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def call_log(tmp_path: Path) -> Path:
    return tmp_path / "calls.tsv"


@pytest.fixture
def sleeper(start_function: StartFunction, call_log: Path) -> RunningFunction:
    return start_function("sleeper", SLEEPER, {"CALL_LOG": str(call_log)})


def test_succeeds_with_hello_world_and_logs_the_call(
    sleeper: RunningFunction, call_log: Path
) -> None:
    answer = call(sleeper, {"sleep": 0}, task_id="t-ok", attempt=2)

    assert answer.status_code == 200
    assert answer.json() == {"hello": "world"}
    assert answer.http_version == "HTTP/1.1"
    assert log_lines(call_log, 1) == [["t-ok", "2", "success"]]
    assert "call ce-id=t-ok attempt=2" in sleeper.proc.logs()


def test_reports_progress_each_second(
    sleeper: RunningFunction, progress_sink: ProgressSink
) -> None:
    started = time.monotonic()
    answer = call(sleeper, {"sleep": 2.5}, progress_url=progress_sink.url)
    elapsed = time.monotonic() - started

    assert answer.status_code == 200
    assert 2.4 <= elapsed < 5.0
    assert progress_sink.wait_for(2) == [40.0, 80.0]
    assert progress_sink.headers[0]["Content-Type"] == "application/json"


def test_unreachable_progress_url_does_not_fail_the_task(sleeper: RunningFunction) -> None:
    dead = f"http://127.0.0.1:{free_port()}/progress"
    answer = call(sleeper, {"sleep": 1.2}, progress_url=dead)

    assert answer.status_code == 200
    assert answer.json() == {"hello": "world"}


def test_must_succeed_false_is_a_4xx_failure_not_retried(
    sleeper: RunningFunction, call_log: Path
) -> None:
    started = time.monotonic()
    answer = call(sleeper, {"sleep": 5, "mustSucceed": False}, task_id="t-argh")

    assert time.monotonic() - started < 2.0, "the seed fails at once, without sleeping"
    assert 400 <= answer.status_code < 500 and answer.status_code not in (408, 429)
    assert answer.json() == {"errorMessage": "Argh!"}
    assert log_lines(call_log, 1) == [["t-argh", "1", "failure"]]


@pytest.mark.parametrize(
    "body",
    [
        "{not json",
        "[1, 2]",
        '{"sleep": "five"}',
        '{"sleep": true}',
        '{"sleep": -1}',
        '{"mustSucceed": true}',
        '{"sleep": 0, "mustSucceed": "no"}',
        '{"sleep": 0, "failRate": 2}',
    ],
)
def test_rejects_invalid_bodies_with_400(sleeper: RunningFunction, body: str) -> None:
    answer = call(sleeper, body)

    assert answer.status_code == 400
    assert answer.json()["errorMessage"]


def test_fail_rate_is_decided_by_the_task_id(sleeper: RunningFunction) -> None:
    ids = [f"task-{n}" for n in range(30)]
    first = {i: call(sleeper, {"sleep": 0, "failRate": 0.5}, task_id=i).status_code for i in ids}
    again = {i: call(sleeper, {"sleep": 0, "failRate": 0.5}, task_id=i).status_code for i in ids}

    assert first == again, "every attempt of a task must decide the same way"
    assert set(first.values()) == {200, 422}
    assert call(sleeper, {"sleep": 0, "failRate": 1}, task_id="any").json() == {
        "errorMessage": "Argh!"
    }
    assert call(sleeper, {"sleep": 0, "failRate": 0}, task_id="task-0").status_code == 200


def test_fail_first_n_calls_per_task_answers_503_then_succeeds(
    start_function: StartFunction, call_log: Path
) -> None:
    fn = start_function(
        "sleeper-flaky", SLEEPER, {"CALL_LOG": str(call_log), "FAIL_FIRST_N_CALLS_PER_TASK": "2"}
    )

    codes = [call(fn, {"sleep": 0}, task_id="a", attempt=n).status_code for n in (1, 2, 3)]
    other = call(fn, {"sleep": 0}, task_id="b").status_code

    assert codes == [503, 503, 200]
    assert other == 503, "the count is per task"
    assert log_lines(call_log, 4) == [
        ["a", "1", "unavailable"],
        ["a", "2", "unavailable"],
        ["a", "3", "success"],
        ["b", "1", "unavailable"],
    ]


def test_handles_calls_concurrently(sleeper: RunningFunction) -> None:
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(
            pool.map(lambda n: call(sleeper, {"sleep": 1}, task_id=f"c{n}").status_code, range(6))
        )

    assert answers == [200] * 6
    assert time.monotonic() - started < 3.0, "six 1 s calls must overlap"


def raw_call(fn: RunningFunction, task_id: str, body: bytes) -> tuple[tuple[str, int], bytes]:
    """The address and bytes of a call, for a caller that hangs up at a moment of its choice."""
    host, port = fn.url.removeprefix("http://").split(":")
    request = (
        f"POST / HTTP/1.1\r\nHost: {host}\r\nce-id: {task_id}\r\nX-Conveyor-Attempt: 1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    return (host, int(port)), request


def test_stops_working_when_the_caller_hangs_up(sleeper: RunningFunction, call_log: Path) -> None:
    address, request = raw_call(sleeper, "t-gone", b'{"sleep": 30}')
    with socket.create_connection(address) as conn:
        conn.sendall(request)
        time.sleep(0.3)

    assert log_lines(call_log, 1, timeout=5.0) == [["t-gone", "1", "aborted"]]


def test_a_caller_that_hangs_up_before_the_answer_leaves_no_traceback(
    sleeper: RunningFunction, call_log: Path
) -> None:
    """Found by a sweep: an answer written to a caller that had gone (a dispatcher's call
    cut at its deadline) printed a BrokenPipeError traceback for every such call."""
    calls = 20
    for n in range(calls):
        address, request = raw_call(sleeper, f"t-{n}", b'{"sleep": 0}')
        with socket.create_connection(address) as conn:
            conn.sendall(request)
            conn.shutdown(socket.SHUT_RD)
            # Closed with a reset: the answer's first write fails, not only a later one.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert len(log_lines(call_log, calls, timeout=10.0)) == calls
    time.sleep(0.5)
    assert sleeper.proc.alive()
    assert "Traceback" not in sleeper.proc.logs(), sleeper.proc.logs()[-2000:]
    assert call(sleeper, {"sleep": 0}).status_code == 200


def test_exits_zero_on_sigterm_and_sigint(start_function: StartFunction) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        fn = start_function(f"sleeper-{signum}", SLEEPER)
        fn.proc.signal(signum)
        assert fn.proc.wait(timeout=5) == 0


def test_healthz_and_unknown_paths(sleeper: RunningFunction) -> None:
    with httpx.Client(trust_env=False) as http:
        assert http.get(f"{sleeper.url}/healthz").status_code == 200
        assert http.get(f"{sleeper.url}/nope").status_code == 404
