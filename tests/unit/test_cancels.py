"""The dispatcher's memory of cancels (dispatcher/cancels.py): bounded in time and size, and
aborting the calls of a cancelled task that run here."""

from __future__ import annotations

import asyncio

from dispatcher.cancels import Cancels
from dispatcher.shutdown import Aborted, AbortToken


async def test_a_cancel_aborts_the_running_call_of_its_task_only() -> None:
    cancels = Cancels(memory_seconds=60)
    mine, other = AbortToken(), AbortToken()
    cancels.running("t1", mine)
    cancels.running("t2", other)
    call = asyncio.create_task(mine.guard(asyncio.sleep(30)))
    await asyncio.sleep(0)
    assert cancels.heard("t1") == 1
    try:
        await call
        raise AssertionError("the call was not aborted")
    except Aborted:
        pass
    assert not other.aborted
    assert cancels.cancelled("t1") and not cancels.cancelled("t2")
    cancels.finished("t1", mine)
    assert cancels.heard("t1") == 0  # nothing running any more: remembered only


async def test_cancels_are_forgotten_after_their_time() -> None:
    cancels = Cancels(memory_seconds=0.05)
    cancels.heard("t1")
    assert cancels.cancelled("t1")
    await asyncio.sleep(0.1)
    assert not cancels.cancelled("t1")
    assert len(cancels) == 0


def test_the_memory_is_bounded_in_size() -> None:
    cancels = Cancels(memory_seconds=3600, max_remembered=100)
    for i in range(1000):
        cancels.heard(f"t{i}")
    assert len(cancels) == 100
    assert cancels.cancelled("t999") and not cancels.cancelled("t0")
