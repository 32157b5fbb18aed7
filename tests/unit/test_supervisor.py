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
