"""A dispatcher process between a real broker and a real function: the task paths."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

import pytest

from conveyor.events import EventKind, MessageFormat
from tests.dispatcher.conftest import FakeFunction, Launch, Rabbit, eventually, start_function
from tests.support.processes import free_port

pytestmark = pytest.mark.timeout(60)


async def stop_and_count(dispatcher, rabbit: Rabbit) -> int:  # type: ignore[no-untyped-def]
    """Stops the dispatcher (unacked messages return) and counts what `-in` holds."""
    dispatcher.signal()
    assert await dispatcher.exit_code(10) == 0
    return await rabbit.depth(rabbit.in_q)


async def test_success_started_progress_succeeded_then_acked(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit(
        {"progress": [10, 20, 55.5], "progressPause": 0.1, "response": {"hello": "world"}},
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )

    done = await rabbit.wait_terminal(task_id)

    assert done.kind is EventKind.SUCCEEDED
    assert done.response == {"hello": "world"}
    kinds = rabbit.kinds(task_id)
    assert kinds[0] is EventKind.STARTED and kinds[-1] is EventKind.SUCCEEDED
    started = rabbit.of(task_id)[0]
    assert started.host == "pod-1"
    assert started.attempt  # a fresh attempt id per delivery ...
    assert {e.attempt for e in rabbit.of(task_id)} == {started.attempt}  # ... on every event
    progress = [e.progress for e in rabbit.of(task_id) if e.kind is EventKind.PROGRESS]
    assert progress and progress == sorted(progress) and progress[-1] == 55.5

    [call] = function.calls(task_id)
    headers = call["headers"]
    assert headers["ce-id"] == headers["ce-subject"] == headers["x-conveyor-task-id"] == task_id
    assert headers["ce-type"] == "io.conveyor.task.submitted"
    assert headers["ce-source"] == f"/v1/services/{rabbit.queue}"
    assert headers["ce-specversion"] == "1.0" and headers["ce-time"]
    assert headers["content-type"] == "application/json"
    assert headers["x-conveyor-attempt"] == "1"
    assert headers["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c")
    deadline = datetime.fromisoformat(headers["x-conveyor-deadline"].replace("Z", "+00:00"))
    assert 200 < (deadline - datetime.now(UTC)).total_seconds() <= 300
    assert re.fullmatch(  # on loopback, and the attempt's own (its token)
        rf"http://127\.0\.0\.1:{dispatcher.port}/tasks/{task_id}/progress/[-\w]{{16}}",
        headers["x-conveyor-progress-url"],
    )
    assert call["body"]["response"] == {"hello": "world"}  # the task's body, as plain JSON
    [end] = function.calls(task_id, "end")
    assert end["progress"] == [204, 204, 204]

    assert await stop_and_count(dispatcher, rabbit) == 0  # acked: nothing came back


async def test_4xx_fails_at_once_with_the_error_message(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit(
        {"statuses": [422], "error": {"errorMessage": "bad image"}}, max_attempts=5
    )
    plain = await rabbit.submit({"statuses": [400], "error": "x" * 10_000})

    failed = await rabbit.wait_terminal(task_id)
    assert failed.kind is EventKind.FAILED
    assert failed.error_message == "bad image"
    assert len(function.calls(task_id)) == 1  # no retry
    long_error = (await rabbit.wait_terminal(plain)).error_message
    assert long_error == "x" * 4096
    assert await stop_and_count(dispatcher, rabbit) == 0


async def test_5xx_then_2xx_succeeds_after_retry_honouring_retry_after(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"statuses": [503, 200], "retryAfter": "1"})
    no_luck = await rabbit.submit({"statuses": [500], "error": {"detail": "boom"}}, max_attempts=3)

    done = await rabbit.wait_terminal(task_id)
    assert done.kind is EventKind.SUCCEEDED
    first, second = function.calls(task_id)
    assert second["time"] - first["time"] >= 1.0  # Retry-After: 1, backoff 0.05
    assert first["headers"]["x-conveyor-attempt"] == second["headers"]["x-conveyor-attempt"] == "1"
    assert second["headers"]["x-conveyor-retry"] == "1"

    failed = await rabbit.wait_terminal(no_luck)
    assert failed.kind is EventKind.FAILED
    assert "boom" in (failed.error_message or "") and "503" not in (failed.error_message or "")
    assert len(function.calls(no_luck)) == 3  # maxAttempts from the submission
    # The retries are logged, but not the function's answers: they may echo the task.
    assert "HTTP 500" in dispatcher.proc.logs() and "boom" not in dispatcher.proc.logs()
    assert await stop_and_count(dispatcher, rabbit) == 0


async def test_task_timeout_fails_the_task(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"sleep": 5}, timeout=1)
    began = time.monotonic()
    failed = await rabbit.wait_terminal(task_id)
    assert failed.kind is EventKind.FAILED and "timeout" in (failed.error_message or "")
    assert time.monotonic() - began < 4
    assert await stop_and_count(dispatcher, rabbit) == 0


async def test_non_json_and_empty_2xx_bodies(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    text = await rabbit.submit({"rawResponse": "plain text"})
    empty = await rabbit.submit({"rawResponse": ""})
    assert (await rabbit.wait_terminal(text)).response == "plain text"
    assert (await rabbit.wait_terminal(empty)).response is None
    await stop_and_count(dispatcher, rabbit)


@pytest.mark.topology(fmt=MessageFormat.LEGACY)
async def test_legacy_submission_gets_legacy_events(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"response": {"ok": 1}})
    done = await rabbit.wait_terminal(task_id)
    assert done.kind is EventKind.SUCCEEDED and done.response == {"ok": 1}
    assert rabbit.of(task_id)[0].host == "pod-1"
    [call] = function.calls(task_id)
    assert call["headers"]["ce-id"] == task_id and call["body"] == {"response": {"ok": 1}}
    assert await stop_and_count(dispatcher, rabbit) == 0


async def test_one_shot_handles_one_task_then_exits_via_the_cli(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    first = await rabbit.submit({})
    second = await rabbit.submit({})
    dispatcher = launch(function.url, cli=True, one_shot=1, idle_exit_seconds=30)

    assert await dispatcher.exit_code(15) == 0
    assert (await rabbit.wait_terminal(first)).kind is EventKind.SUCCEEDED
    assert rabbit.of(second) == [] and function.calls(second) == []
    assert await rabbit.depth(rabbit.in_q) == 1


async def test_one_shot_with_an_empty_queue_exits_after_idle_seconds(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url, one_shot=1, idle_exit_seconds=1)
    began = time.monotonic()
    assert await dispatcher.exit_code(15) == 0
    assert 1 <= time.monotonic() - began < 10


async def test_one_shot_exits_0_after_idle_seconds_while_the_broker_is_unreachable(
    function: FakeFunction, launch: Launch
) -> None:
    """Found by a sweep: a Job whose broker was down never exited (the idle clock only started
    once consuming). Now it counts from the start: no message within it, exit 0."""
    nobody = f"amqp://guest:guest@127.0.0.1:{free_port()}/"
    dispatcher = launch(function.url, amqp=nobody, one_shot=1, idle_exit_seconds=2)
    began = time.monotonic()
    assert await dispatcher.exit_code(20) == 0
    assert 2 <= time.monotonic() - began < 15


async def test_one_shot_exits_0_after_idle_seconds_while_its_queue_is_not_declared(
    function: FakeFunction, launch: Launch
) -> None:
    """Found by a sweep: a Job whose queue did not exist waited for it forever. Now it exits 0
    once IDLE_EXIT_SECONDS have passed since its start without a message."""
    dispatcher = launch(function.url, one_shot=1, idle_exit_seconds=2)
    began = time.monotonic()
    assert await dispatcher.exit_code(20) == 0
    assert 2 <= time.monotonic() - began < 15
    assert "waiting for the gateway to declare" in dispatcher.proc.logs()


async def test_function_slow_to_start_loses_no_task(
    rabbit: Rabbit,
    procs,
    tmp_path,
    launch: Launch,  # type: ignore[no-untyped-def]
) -> None:
    slow = start_function(procs, tmp_path, start_delay=2.0)
    dispatcher = launch(slow.url)
    tasks = [await rabbit.submit({}) for _ in range(3)]

    for task_id in tasks:
        assert (await rabbit.wait_terminal(task_id, timeout=20)).kind is EventKind.SUCCEEDED
    await eventually(lambda: all(slow.calls(t) for t in tasks), 5, "calls")
    assert await stop_and_count(dispatcher, rabbit) == 0


async def test_a_short_call_sends_its_terminal_event_alone_carrying_host_and_start(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """STARTED_DELAY_MS (100 by default): a call that answers sooner sends no `started`.
    A whole second here, so that the quick call is sooner on a loaded machine too."""
    dispatcher = launch(function.url, started_delay_ms=1000)
    await dispatcher.wait_ready()
    before = datetime.now(UTC)
    quick = await rabbit.submit({"response": {"n": 1}})
    slow = await rabbit.submit({"sleep": 1.6})
    reporting = await rabbit.submit({"progress": [30]})  # short, but it reports progress

    done = await rabbit.wait_terminal(quick)
    assert rabbit.kinds(quick) == [EventKind.SUCCEEDED]
    assert done.host == "pod-1" and done.started is not None
    assert before <= done.started <= datetime.now(UTC)
    assert done.attempt

    slow_done = await rabbit.wait_terminal(slow)
    assert rabbit.kinds(slow) == [EventKind.STARTED, EventKind.SUCCEEDED]
    assert slow_done.started is None  # its `started` said it already

    await rabbit.wait_terminal(reporting)
    kinds = rabbit.kinds(reporting)
    assert kinds[0] is EventKind.STARTED and EventKind.PROGRESS in kinds  # `started` first
    assert await stop_and_count(dispatcher, rabbit) == 0


async def test_started_delay_0_always_sends_started(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url, started_delay_ms=0)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({})
    done = await rabbit.wait_terminal(task_id)
    assert rabbit.kinds(task_id) == [EventKind.STARTED, EventKind.SUCCEEDED]
    assert done.started is None
    assert await stop_and_count(dispatcher, rabbit) == 0


async def test_a_host_name_no_queue_name_may_hold_still_runs_tasks_under_its_name(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """Found by a black-box sweep: HOSTNAME goes into the name of the dispatcher's cancel
    queue, and one holding what AMQP queue names may not (`<`, a non-ASCII letter, 300
    characters) ended the dispatcher at start in pamqp's `Invalid value for queue`. The
    events still carry the name as it was given."""
    host = "pod<1>-é" + "x" * 300
    dispatcher = launch(function.url, hostname=host)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"response": {"ok": True}})
    done = await rabbit.wait_terminal(task_id)
    assert done.kind is EventKind.SUCCEEDED
    assert done.host == host[:255]
