"""A crashed background loop is restarted, counted and reported down meanwhile."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import REGISTRY

from gateway import supervisor as supervisor_module
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


def _failures(loop: str) -> float:
    value = REGISTRY.get_sample_value("conveyor_gateway_loop_failures_total", {"loop": loop})
    return value or 0.0


async def test_a_loop_failing_every_pass_is_counted_and_named_until_a_pass_succeeds() -> None:
    """Found by a black-box test: the reaper, the relay, the listener… catch their errors and
    try again, so one failing every pass never crashed: /readyz said nothing and nothing was
    counted, while expired tasks stayed PENDING. A pass that fails now says so."""
    outcome = {"fail": True}
    passes: list[bool] = []

    async def retries_by_itself() -> None:
        while True:
            try:
                if outcome["fail"]:
                    raise ValueError("refused")
                supervisor_module.pass_succeeded()
            except ValueError as exc:
                supervisor_module.pass_failed(exc)
            passes.append(outcome["fail"])
            await asyncio.sleep(0.01)

    before = _failures("by-itself")
    supervisor = Supervisor(backoff=0.01, backoff_max=0.01)
    supervisor.spawn("by-itself", retries_by_itself)
    while len(passes) < 3:
        await asyncio.sleep(0.01)
    assert "refused" in supervisor.failing()["by-itself"]
    assert supervisor.down() == {}  # it runs: not a crash
    assert _failures("by-itself") - before >= 3
    outcome["fail"] = False
    while passes[-1]:
        await asyncio.sleep(0.01)
    assert supervisor.failing() == {}
    await supervisor.stop()
    supervisor_module.pass_failed(ValueError("outside any supervised loop"))  # reports to nobody


async def test_the_backoff_starts_over_after_a_healthy_run(monkeypatch: Any) -> None:
    """Found by a black-box test: the backoff grew during an outage and never came back, so a
    single crash minutes later waited the longest backoff (10 s with the loop down)."""
    monkeypatch.setattr(supervisor_module, "HEALTHY_RUN", 0.2)
    runs: list[float] = []
    crash_now = asyncio.Event()

    async def crashes_then_runs() -> None:
        runs.append(asyncio.get_running_loop().time())
        if len(runs) <= 4:  # an outage: four crashes in a row at once
            raise RuntimeError("outage")
        if len(runs) == 5:  # a healthy run, then one crash
            await crash_now.wait()
            raise RuntimeError("once")
        await asyncio.Event().wait()

    supervisor = Supervisor(backoff=0.05, backoff_max=0.4)
    supervisor.spawn("resets", crashes_then_runs)
    while len(runs) < 5:
        await asyncio.sleep(0.01)
    assert runs[4] - runs[3] >= 0.3  # 0.05, 0.1, 0.2, then 0.4
    await asyncio.sleep(0.3)  # longer than HEALTHY_RUN
    crash_now.set()
    while len(runs) < 6:
        await asyncio.sleep(0.01)
    await supervisor.stop()
    assert runs[5] - runs[4] - 0.3 < 0.2  # the first backoff again (0.05), not 0.4


async def test_a_loop_crashing_for_hours_is_still_restarted() -> None:
    """Found by a review: the backoff's exponent grew with every crash in a row, and past
    about 1,024 (under 3 hours of a database outage at the 10 s maximum) it overflowed a float
    inside the wait: the loop ended for good, `stopped` in /readyz until the process restarted."""
    runs: list[int] = []

    async def always_crashes() -> None:
        runs.append(1)
        raise RuntimeError("database away")

    supervisor = Supervisor(backoff=0.5, backoff_max=0.0)  # no wait: 1,100 crashes at once
    supervisor.spawn("outage", always_crashes)
    deadline = asyncio.get_running_loop().time() + 20
    while len(runs) < 1100 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0)
    assert len(runs) >= 1100, f"restarts ended after {len(runs)} runs: {supervisor.down()}"
    assert "database away" in supervisor.down().get("outage", "database away")
    assert supervisor.down().get("outage") != "stopped"
    await supervisor.stop()


async def test_a_loop_that_will_not_end_does_not_hold_the_shutdown(monkeypatch: Any) -> None:
    """Seen in CI: an old worker of `conveyor gateway --workers 2`, told to stop by a SIGHUP
    restart, never finished its shutdown (the last line of its log: a channel closed because a
    declaration under way was cancelled), so it kept the background loops' lock and neither new
    worker ever ran them. stop() now waits for the loops only STOP_PATIENCE, names those that
    did not end, and lets the shutdown go on."""
    monkeypatch.setattr(supervisor_module, "STOP_PATIENCE", 0.2)
    stuck = asyncio.Event()

    async def deaf() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await stuck.wait()  # a cleanup that waits on an answer that never comes

    supervisor = Supervisor()
    supervisor.spawn("deaf", deaf)
    await asyncio.sleep(0.05)
    await asyncio.wait_for(supervisor.stop(), 2)
    stuck.set()
