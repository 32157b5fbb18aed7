"""SIGTERM, SIGINT and SIGKILL with a task in flight (SPEC §7.1), with real signals."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aio_pika
import pytest

from conveyor.events import EventKind
from tests.dispatcher.conftest import FakeFunction, Launch, Rabbit, eventually
from tests.support.processes import free_port

pytestmark = pytest.mark.timeout(90)

# Long on the first delivery only, so that a redelivery finishes at once.
LONG_FIRST = {"sleep": 30, "sleepOnAttempts": [1]}
KILL, TERM = signal.SIGKILL, signal.SIGTERM


async def test_sigterm_requeues_the_task_and_a_second_dispatcher_finishes_it(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    first = launch(function.url, started_delay_ms=0)  # `started` at once: both hosts seen
    await first.wait_ready()
    task_id = await rabbit.submit(LONG_FIRST)
    await function.wait_calls(task_id)

    began = time.monotonic()
    first.signal(signal.SIGTERM)
    await asyncio.sleep(0.05)
    first.signal(signal.SIGTERM)  # a second signal is harmless
    assert await first.exit_code(10) == 0
    assert time.monotonic() - began < 5
    # no terminal event when requeued: the gateway learns the task waits in the queue again
    assert rabbit.kinds(task_id) == [EventKind.STARTED, EventKind.REQUEUED]
    assert await rabbit.depth(rabbit.in_q) == 1  # back in -in

    second = launch(function.url, started_delay_ms=0)
    done = await rabbit.wait_terminal(task_id)
    assert done.kind is EventKind.SUCCEEDED
    hosts = [e.host for e in rabbit.of(task_id) if e.kind is EventKind.STARTED]
    assert hosts == ["pod-1", "pod-2"]
    attempts = [c["headers"]["x-conveyor-attempt"] for c in function.calls(task_id)]
    assert attempts == ["1", "2"]
    second.signal(signal.SIGINT)
    assert await second.exit_code(10) == 0
    assert await rabbit.depth(rabbit.in_q) == 0


@pytest.mark.topology(delivery_limit=1)
async def test_graceful_requeues_beyond_the_delivery_limit_do_not_dead_letter(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """With nack(requeue=true) the task would reach -dlq at the second requeue."""
    task_id = await rabbit.submit({"sleep": 30, "sleepOnAttempts": [1, 2, 3, 4]})
    for n in range(1, 5):
        dispatcher = launch(function.url)
        await function.wait_calls(task_id, count=n)
        dispatcher.signal(signal.SIGTERM)
        assert await dispatcher.exit_code(10) == 0
        assert await rabbit.depth(rabbit.dlq) == 0
        assert await rabbit.depth(rabbit.in_q) == 1

    last = launch(function.url)
    assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED
    attempts = [c["headers"]["x-conveyor-attempt"] for c in function.calls(task_id)]
    assert attempts == ["1", "2", "3", "4", "5"]
    last.signal()
    assert await last.exit_code(10) == 0
    assert await rabbit.depth(rabbit.dlq) == 0 and await rabbit.depth(rabbit.in_q) == 0


async def test_sigkill_leaves_the_message_to_the_broker(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    doomed = launch(function.url)
    await doomed.wait_ready()
    task_id = await rabbit.submit(LONG_FIRST)
    await function.wait_calls(task_id)
    doomed.signal(signal.SIGKILL)
    assert await doomed.exit_code(5) == -signal.SIGKILL

    survivor = launch(function.url)
    assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED
    attempts = [c["headers"]["x-conveyor-attempt"] for c in function.calls(task_id)]
    assert attempts == ["1", "2"]  # the broker's x-delivery-count, plus one
    survivor.signal()
    assert await survivor.exit_code(10) == 0
    assert await rabbit.depth(rabbit.in_q) == 0


async def test_drain_mode_finishes_the_task_in_flight(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url, shutdown_mode="drain", drain_timeout=10)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"sleep": 2})
    await function.wait_calls(task_id)

    dispatcher.signal(signal.SIGTERM)
    await asyncio.sleep(0.3)
    late = await rabbit.submit({})  # while draining: not taken
    assert await dispatcher.exit_code(10) == 0
    assert (await rabbit.wait_terminal(task_id, timeout=2)).kind is EventKind.SUCCEEDED
    assert function.calls(late) == []
    assert await rabbit.depth(rabbit.in_q) == 1  # only the late task: the other was acked


async def test_drain_timeout_requeues_what_is_left(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url, shutdown_mode="drain", drain_timeout=1)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit(LONG_FIRST)
    await function.wait_calls(task_id)
    began = time.monotonic()
    dispatcher.signal(signal.SIGTERM)
    assert await dispatcher.exit_code(10) == 0
    assert 1 <= time.monotonic() - began < 5
    assert rabbit.terminal(task_id) is None
    assert await rabbit.depth(rabbit.in_q) == 1


def _importing(pid: int) -> bool:
    """The process is in its heavy imports: aiohttp's and aio-pika's compiled parts load."""
    try:
        return "multidict" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_during_start_up_exits_0(sig: signal.Signals, launch: Launch) -> None:
    """Found by a sweep: SIGTERM or SIGINT in the first ~0.3 s killed the process (-15, or a
    KeyboardInterrupt traceback). Now it exits 0 at once: nothing is held yet."""
    dispatcher = launch(f"http://127.0.0.1:{free_port()}/")
    pid = dispatcher.proc.pid
    await eventually(lambda: _importing(pid), 10, "the imports under way", step=0.001)
    dispatcher.signal(sig)
    assert await dispatcher.exit_code(10) == 0
    assert "Traceback" not in dispatcher.proc.logs()


@pytest.mark.topology(delivery_limit=2)
async def test_crashes_before_a_graceful_requeue_still_count_toward_the_delivery_limit(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """A graceful requeue republishes the message, whose copy the broker counts from zero:
    a task that kept crashing its workers was called for ever as long as a scale-in came
    between crashes (SPEC §7.1: leave a worker that merely crashed its limit). The copy
    carries the crashes; past the limit, the dispatcher dead-letters it uncalled, as the
    broker would have (the gateway judges it as it judges the broker's). Found by a
    black-box test."""
    task_id = await rabbit.submit({"sleep": 30}, delivery_limit=2)
    await _stop_each_call(function, launch, task_id, KILL, TERM, KILL, KILL)
    # Three crashes, one graceful requeue: with a limit of 2 the broker would have
    # dead-lettered it at the third crash had the requeue not come between.
    last = launch(function.url)
    await eventually(lambda: _depth_is(rabbit, rabbit.dlq, 1), 30, "dead-lettered")
    assert len(function.calls(task_id)) == 4
    assert await rabbit.depth(rabbit.in_q) == 0
    assert rabbit.terminal(task_id) is None  # the gateway decides, from `-dlq`
    (dead,) = await _take(rabbit, rabbit.dlq)
    assert dead.headers["x-conveyor-dead-lettered"] == "delivery_limit"
    assert dead.headers["x-conveyor-crashes"] == 3
    assert dead.headers["ce-id"] == task_id
    last.signal()
    assert await last.exit_code(10) == 0


@pytest.mark.topology(delivery_limit=2)
async def test_graceful_requeues_alone_never_reach_the_delivery_limit(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """The crash count goes on across copies, the graceful requeues still count nothing:
    one crash, then requeues beyond the limit, and the task still runs to its end."""
    task_id = await rabbit.submit({"sleep": 30, "sleepOnAttempts": [1, 2, 3, 4]}, delivery_limit=2)
    await _stop_each_call(function, launch, task_id, KILL, TERM, TERM, TERM)
    last = launch(function.url)
    assert (await rabbit.wait_terminal(task_id, timeout=30)).kind is EventKind.SUCCEEDED
    attempts = [c["headers"]["x-conveyor-attempt"] for c in function.calls(task_id)]
    assert attempts == ["1", "2", "3", "4", "5"]
    last.signal()
    assert await last.exit_code(10) == 0


async def test_a_returned_delivery_is_on_record_as_started_before_its_call(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """Found by a black-box test: a worker killed within STARTED_DELAY_MS of its call left
    no `started`, so the gateway took the returns for the broker's (no attempt explains
    them) and gave the dead letter back three times: 24 calls for a limit of 5, and no
    attempt in the task's history. A delivery the broker returned says `started`, confirmed,
    before its call; a first delivery keeps the delay."""
    task_id = await rabbit.submit({"sleep": 30})
    await _stop_each_call(function, launch, task_id, KILL, KILL, KILL)
    assert len(function.calls(task_id)) == 3

    def started() -> list[str | None]:
        return [e.host for e in rabbit.of(task_id) if e.kind is EventKind.STARTED]

    await eventually(lambda: len(started()) >= 2, 10, "started events")
    assert started() == ["pod-2", "pod-3"]  # the returned deliveries', not the first's


async def _stop_each_call(
    function: FakeFunction, launch: Launch, task_id: str, *signals: signal.Signals
) -> None:
    """One dispatcher per signal, stopped by it once it has called the function."""
    for calls, sig in enumerate(signals, 1):
        dispatcher = launch(function.url, started_delay_ms=5000)  # a kill always comes first
        await function.wait_calls(task_id, count=calls)
        dispatcher.signal(sig)
        assert await dispatcher.exit_code(10) in (0, -signal.SIGKILL)


async def _depth_is(rabbit: Rabbit, queue: str, depth: int) -> bool:
    return await rabbit.depth(queue) == depth


async def _take(rabbit: Rabbit, queue: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    assert rabbit.channel is not None
    declared = await rabbit.channel.get_queue(queue, ensure=True)
    taken = []
    while (message := await declared.get(no_ack=False, fail=False)) is not None:
        taken.append(message)
        await message.ack()
    return taken
