"""A crashed background loop is restarted, counted and reported down meanwhile."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from gateway.supervisor import Supervisor


def _restarts(loop: str) -> float:
    value = REGISTRY.get_sample_value("conveyor_gateway_loop_restarts_total", {"loop": loop})
    return value or 0.0


async def test_a_loop_that_raises_is_restarted_and_counted() -> None:
    runs: list[int] = []
    healthy = asyncio.Event()

    async def flaky() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("boom")
        healthy.set()
        await asyncio.Event().wait()  # then runs forever

    before = _restarts("flaky")
    supervisor = Supervisor(backoff=0.01, backoff_max=0.02)
    supervisor.spawn("flaky", flaky)
    await asyncio.wait_for(healthy.wait(), 5)
    assert len(runs) == 3
    assert _restarts("flaky") - before == 2
    assert supervisor.down() == {}
    await supervisor.stop()


async def test_a_loop_is_reported_down_until_it_runs_again() -> None:
    async def crashes() -> None:
        raise ValueError("database refused")

    supervisor = Supervisor(backoff=5.0, backoff_max=5.0)  # the restart is far away
    supervisor.spawn("crashes", crashes)
    for _ in range(100):
        if supervisor.down():
            break
        await asyncio.sleep(0.01)
    assert "database refused" in supervisor.down()["crashes"]
    await supervisor.stop()


async def test_a_loop_that_returns_is_a_crash_too() -> None:
    runs: list[int] = []

    async def returns() -> None:
        runs.append(1)

    supervisor = Supervisor(backoff=0.01, backoff_max=0.01)
    supervisor.spawn("returns", returns)
    for _ in range(200):
        if len(runs) >= 2:
            break
        await asyncio.sleep(0.01)
    await supervisor.stop()
    assert len(runs) >= 2


async def test_a_loop_a_library_cancels_from_within_is_restarted_too() -> None:
    """Found by a sweep: when aiormq gave up on a stuck connection it cancelled the futures
    the `service-stats` loop awaited. The CancelledError (a BaseException) ended the loop for
    good, without a line in the log: /readyz said "stopped" until the process restarted.
    Only the supervisor's own stop() ends a loop."""
    runs: list[int] = []
    healthy = asyncio.Event()

    async def cancelled_inside() -> None:
        runs.append(1)
        if len(runs) < 3:
            future = asyncio.get_running_loop().create_future()
            future.cancel()  # as a library does to an RPC whose connection it closed
            await future
        healthy.set()
        await asyncio.Event().wait()

    before = _restarts("cancelled-inside")
    supervisor = Supervisor(backoff=0.01, backoff_max=0.02)
    supervisor.spawn("cancelled-inside", cancelled_inside)
    await asyncio.wait_for(healthy.wait(), 5)
    assert len(runs) == 3
    assert _restarts("cancelled-inside") - before == 2
    assert supervisor.down() == {}
    await asyncio.wait_for(supervisor.stop(), 5)  # and stop() still ends it
    assert supervisor.down() == {"cancelled-inside": "stopped"}
