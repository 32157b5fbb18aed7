"""conveyor.function: the optional helper for Python function authors."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest

from conveyor.function import TaskContext, areport_progress, report_progress
from tests.functions.conftest import ProgressSink
from tests.support.processes import free_port

HEADERS = {
    "Ce-Id": "5f0c2a8e-task",
    "X-Conveyor-Task-Id": "5f0c2a8e-task",
    "X-CONVEYOR-ATTEMPT": "2",
    "x-conveyor-deadline": "2025-04-23T18:25:43.511Z",
    "X-Conveyor-Progress-Url": "http://127.0.0.1:8081/v1/tasks/5f0c2a8e-task/progress",
}


def test_context_reads_headers_in_any_case() -> None:
    ctx = TaskContext.from_headers(HEADERS)

    assert ctx.task_id == "5f0c2a8e-task"
    assert ctx.attempt == 2
    assert ctx.deadline == datetime(2025, 4, 23, 18, 25, 43, 511000, tzinfo=UTC)
    assert ctx.progress_url == HEADERS["X-Conveyor-Progress-Url"]


def test_context_accepts_httpx_headers_and_falls_back_on_defaults() -> None:
    ctx = TaskContext.from_headers(httpx.Headers({"x-conveyor-task-id": "t1"}))

    assert ctx == TaskContext(task_id="t1", attempt=1, deadline=None, progress_url=None)
    assert ctx.seconds_left() is None


def test_context_tolerates_garbage() -> None:
    ctx = TaskContext.from_headers({"X-Conveyor-Attempt": "two", "X-Conveyor-Deadline": "soon"})

    assert (ctx.attempt, ctx.deadline) == (1, None)


def test_seconds_left() -> None:
    deadline = datetime(2030, 1, 1, tzinfo=UTC)
    ctx = TaskContext.from_headers({"X-Conveyor-Deadline": deadline.isoformat()})

    assert ctx.seconds_left(deadline - timedelta(seconds=90)) == 90
    assert ctx.seconds_left(deadline + timedelta(seconds=5)) == -5


def test_report_progress_posts_to_the_url_and_clamps(progress_sink: ProgressSink) -> None:
    assert report_progress(progress_sink.url, 42.5) is True
    assert report_progress({"x-conveyor-progress-url": progress_sink.url}, 150) is True
    assert report_progress(TaskContext("t", 1, None, progress_sink.url), -3) is True

    assert progress_sink.values == [42.5, 100.0, 0.0]


def test_report_progress_without_a_url_or_dispatcher_is_a_quiet_no() -> None:
    assert report_progress({}, 10) is False
    assert report_progress(None, 10) is False
    assert report_progress(f"http://127.0.0.1:{free_port()}/p", 10, timeout=1) is False


async def test_areport_progress(progress_sink: ProgressSink) -> None:
    assert await areport_progress(progress_sink.url, 10) is True
    async with httpx.AsyncClient(trust_env=False) as client:
        assert await areport_progress(
            HEADERS | {"X-Conveyor-Progress-Url": progress_sink.url}, 20, client=client
        )
    assert await areport_progress({}, 30) is False
    assert await areport_progress(f"http://127.0.0.1:{free_port()}/p", 40) is False

    assert progress_sink.values == [10, 20]


@pytest.mark.parametrize("value", [0, 99.9])
def test_values_inside_the_range_are_sent_unchanged(
    progress_sink: ProgressSink, value: float
) -> None:
    report_progress(progress_sink.url, value)

    assert progress_sink.values == [value]
