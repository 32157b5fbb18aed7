"""The dispatcher's /metrics after real calls: function calls by outcome, retries, durations."""

from __future__ import annotations

import re

import httpx
import pytest

from conveyor.events import EventKind
from tests.dispatcher.conftest import DispatcherProc, FakeFunction, Launch, Rabbit, eventually
from tests.support.metrics import Key, samples

pytestmark = pytest.mark.timeout(60)


async def _samples(dispatcher: DispatcherProc) -> dict[Key, float]:
    async with httpx.AsyncClient(timeout=5) as client:
        answer = await client.get(f"{dispatcher.base}/metrics")
    assert answer.status_code == 200
    return samples(answer.text)


def _calls(found: dict[Key, float], outcome: str) -> float:
    return found.get(("conveyor_dispatcher_function_calls_total", (("outcome", outcome),)), -1)


async def test_calls_are_counted_by_outcome(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    before = await _samples(dispatcher)
    assert {_calls(before, o) for o in ("success", "failure", "retryable", "timeout")} == {0.0}

    ok = await rabbit.submit({"response": {"fine": True}})
    refused = await rabbit.submit({"statuses": [422], "error": "bad input"})
    flaky = await rabbit.submit({"statuses": [503, 200]}, max_attempts=3)
    slow = await rabbit.submit({"sleep": 5}, timeout=1)
    for task_id, kind in (
        (ok, EventKind.SUCCEEDED),
        (refused, EventKind.FAILED),
        (flaky, EventKind.SUCCEEDED),
        (slow, EventKind.FAILED),
    ):
        assert (await rabbit.wait_terminal(task_id)).kind is kind

    # A terminal event reaches -out's consumer as the dispatcher gets its confirm: the task
    # is counted once that confirm is read, and leaves the in-flight gauge after its ack.
    async def settled() -> dict[Key, float] | None:
        found = await _samples(dispatcher)
        ended = found.get(("conveyor_dispatcher_tasks_succeeded_total", ()), 0) + found.get(
            ("conveyor_dispatcher_tasks_failed_total", ()), 0
        )
        idle = found.get(("conveyor_dispatcher_tasks_in_flight", ()), -1) == 0
        return found if ended >= 4 and idle else None

    after = await eventually(settled, 10, "the four tasks counted and out of flight")
    assert _calls(after, "success") == 2  # ok, and flaky's second call
    assert _calls(after, "failure") == 1  # the 422: final, not retried
    assert _calls(after, "retryable") == 1  # flaky's 503
    assert _calls(after, "timeout") == 1  # no answer within the task timeout
    assert _calls(after, "error") == 0
    assert after[("conveyor_dispatcher_function_retries_total", ())] == 1
    assert after[("conveyor_dispatcher_function_call_seconds_count", ())] == 5
    assert after[("conveyor_dispatcher_tasks_succeeded_total", ())] == 2
    assert after[("conveyor_dispatcher_tasks_failed_total", ())] == 2
    assert after[("conveyor_dispatcher_tasks_in_flight", ())] == 0


async def test_the_sidecar_froze_its_start_up_objects_and_exports_its_collections(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    frozen = re.search(r'frozen["=: ]+(\d+)', dispatcher.proc.logs())
    assert frozen, "the dispatcher did not say it froze its start-up objects"
    assert int(frozen.group(1)) > 20_000  # aio-pika, aiohttp, its own modules
    found = await _samples(dispatcher)
    generations = {
        dict(labels)["generation"]
        for (name, labels), _ in found.items()
        if name == "conveyor_dispatcher_gc_pause_seconds_count"
    }
    assert generations == {"0", "1", "2"}
