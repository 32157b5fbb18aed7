"""PREFETCH_BUFFER (SPEC §7): messages held beyond CONCURRENCY never raise the number of
calls under way, and a shutdown hands them back uncalled, in either mode."""

from __future__ import annotations

import asyncio
import json
import signal
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from conveyor.events import EventKind, expiry_text
from tests.dispatcher.conftest import FakeFunction, Launch, Rabbit, eventually

pytestmark = pytest.mark.timeout(90)


def _most_at_once(function: FakeFunction) -> int:
    """The most calls the function had open at one time, from its journal's order."""
    journal = [json.loads(line) for line in function.log.read_text().splitlines() if line]
    open_calls = most = 0
    for entry in journal:
        open_calls += {"start": 1, "end": -1}.get(entry["phase"], 0)
        most = max(most, open_calls)
    return most


async def test_calls_stay_within_concurrency_and_a_sigterm_hands_the_buffer_back(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url, concurrency=2, prefetch_buffer=2)
    await dispatcher.wait_ready()
    quick = [await rabbit.submit({}) for _ in range(10)]
    for task_id in quick:
        assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED
    slow = [await rabbit.submit({"sleep": 30}) for _ in range(6)]
    await eventually(lambda: len(function.entries("start")) >= 12, 10, "two slow calls")
    await asyncio.sleep(0.5)  # the buffer has filled: 2 running, 2 waiting, 2 in the queue
    assert len(function.entries("start")) == 12
    assert await rabbit.depth(rabbit.in_q) == 2  # ready ones: 4 are held

    dispatcher.signal(signal.SIGTERM)
    assert await dispatcher.exit_code(10) == 0
    assert await rabbit.depth(rabbit.in_q) == 6  # every slow task is back, none lost
    assert not [t for t in slow if rabbit.terminal(t) is not None]
    assert len(function.entries("start")) == 12  # the buffered ones were never called
    assert _most_at_once(function) <= 2


async def test_a_drain_finishes_the_calls_under_way_and_starts_no_buffered_one(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(
        function.url, concurrency=2, prefetch_buffer=2, shutdown_mode="drain", drain_timeout=20
    )
    await dispatcher.wait_ready()
    tasks = [await rabbit.submit({"sleep": 1.5}) for _ in range(5)]
    await eventually(lambda: len(function.entries("start")) >= 2, 10, "two calls")
    await asyncio.sleep(0.3)
    dispatcher.signal(signal.SIGTERM)
    assert await dispatcher.exit_code(20) == 0
    finished = [t for t in tasks if rabbit.terminal(t) is not None]
    assert len(finished) == 2 and len(function.entries("start")) == 2, dispatcher.proc.logs()
    assert await rabbit.depth(rabbit.in_q) == 3


async def test_a_buffered_task_cancelled_or_expired_while_it_waits_is_not_called(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """A message held beyond CONCURRENCY waits for a slot, and its task may be cancelled or
    expire meanwhile: it used to be called all the same once the slot was free."""
    dispatcher = launch(function.url, concurrency=1, prefetch_buffer=2)
    await dispatcher.wait_ready()
    slow = await rabbit.submit({"sleep": 2})
    await eventually(lambda: len(function.entries("start")) >= 1, 10, "the slow call")
    cancelled = await rabbit.submit({})
    expiring = await rabbit.submit({}, expires_at=datetime.now(UTC) + timedelta(seconds=1))
    await asyncio.sleep(0.3)  # both wait in the buffer
    await rabbit.cancel(cancelled)
    assert (await rabbit.wait_terminal(slow)).kind is EventKind.SUCCEEDED
    later = await rabbit.submit({})
    assert (await rabbit.wait_terminal(later)).kind is EventKind.SUCCEEDED
    assert [entry["id"] for entry in function.entries("start")] == [slow, later]
    assert rabbit.terminal(cancelled) is None and rabbit.terminal(expiring) is None
    assert await rabbit.depth(rabbit.in_q) == 0  # acked, not handed back


@pytest.mark.parametrize("mode", ["requeue", "drain"])
async def test_a_buffered_message_handed_back_keeps_its_tasks_expiry(
    rabbit: Rabbit, function: FakeFunction, launch: Launch, mode: str
) -> None:
    """A shutdown hands buffered messages back uncalled. Their copies got a new expiry, which
    nothing gave their tasks: the next dispatcher called tasks the gateway had expired. Now a
    task past its expiry is acked, and any other copy keeps its expiry. Found by a black-box
    test."""
    first = launch(
        function.url, concurrency=1, prefetch_buffer=2, shutdown_mode=mode, drain_timeout=1
    )
    await first.wait_ready()
    slow = await rabbit.submit({"sleep": 30})
    await eventually(lambda: len(function.entries("start")) >= 1, 10, "the slow call")
    gone = await rabbit.submit({}, expires_at=datetime.now(UTC) + timedelta(seconds=1))
    waiting_until = datetime.now(UTC) + timedelta(minutes=5)
    waiting = await rabbit.submit({}, expires_at=waiting_until)
    await asyncio.sleep(1.5)  # both wait in the buffer; `gone` is past its expiry
    first.signal(signal.SIGTERM)
    assert await first.exit_code(15) == 0

    assert await rabbit.depth(rabbit.in_q) == 2  # `slow` and `waiting`: `gone` was acked
    copies = await _peek(rabbit)
    assert sorted(copies) == sorted([slow, waiting])
    headers, expiration = copies[waiting]
    assert headers["ce-conveyorexpires"] == expiry_text(waiting_until)  # as the gateway's row
    left = (waiting_until - datetime.now(UTC)).total_seconds()
    assert expiration is not None and float(expiration) <= left + 0.5

    second = launch(function.url, concurrency=2)
    assert (await rabbit.wait_terminal(waiting)).kind is EventKind.SUCCEEDED
    await eventually(lambda: len(function.calls(slow)) == 2, 10, "slow called again")
    assert function.calls(gone) == []
    second.signal(signal.SIGKILL)
    await second.exit_code(5)


async def _peek(rabbit: Rabbit) -> dict[str, tuple[dict[str, Any], Any]]:
    """The copies waiting in `-in`, by task id: their headers and time to live (seconds),
    each given back to the queue."""
    assert rabbit.channel is not None
    queue = await rabbit.channel.get_queue(rabbit.in_q, ensure=True)
    taken = []
    while (message := await queue.get(no_ack=False, fail=False)) is not None:
        taken.append(message)
    seen = {str(m.headers["ce-id"]): (dict(m.headers or {}), m.expiration) for m in taken}
    for message in taken:
        await message.nack(requeue=True)
    return seen
