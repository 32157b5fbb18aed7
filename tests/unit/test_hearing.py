"""What the watchdog's silence counts from (gateway/hearing.py)."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime

import pytest

from gateway import hearing as hearing_module
from gateway.hearing import Hearing


def test_hearing_stops_while_the_broker_is_away_and_begins_again_after() -> None:
    connected = [True]
    hearing = Hearing(lambda: connected[0])
    first = hearing.since()
    assert first is not None
    connected[0] = False
    assert hearing.since() is None
    connected[0] = True
    again = hearing.since()
    assert again is not None and again > first  # counted from when it was seen back
    assert hearing.since() == again  # and not moved by every look


def test_a_reconnection_between_two_looks_still_restarts_the_count() -> None:
    hearing = Hearing(lambda: True)
    first = hearing.since()
    hearing.restarted()  # the broker connection's reconnect callback
    later = hearing.since()
    assert first is not None and later is not None and later > first


def test_writes_refused_stop_hearing_until_one_goes_through() -> None:
    hearing = Hearing(lambda: True)
    first = hearing.since()
    hearing.lost()
    assert hearing.since() is None
    hearing.lost()
    hearing.heard()
    later = hearing.since()
    assert first is not None and later is not None and later > first
    hearing.heard()  # an ordinary batch moves nothing
    assert hearing.since() == later


def test_a_loop_that_did_not_run_restarts_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stall (SIGSTOP, a paused VM, a blocked loop) is seen by the first look after it, even
    before the clock's own tick runs; a loop that runs moves nothing."""
    monkeypatch.setattr(hearing_module, "TICK", 0.05)
    monkeypatch.setattr(hearing_module, "STALL", 0.3)

    async def run() -> tuple[datetime | None, datetime | None, datetime | None]:
        hearing = Hearing(lambda: True)
        with hearing.keeping_time():
            first = hearing.since()
            await asyncio.sleep(0.5)  # the loop runs: ticks on time
            steady = hearing.since()
            time.sleep(0.6)  # noqa: ASYNC251 - the loop does not run: the stall itself
            stalled = hearing.since()
        return first, steady, stalled

    first, steady, stalled = asyncio.run(run())
    assert first is not None and steady == first
    assert stalled is not None and stalled > first
