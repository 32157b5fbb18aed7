"""The take-over of `conveyor gateway --workers N`'s background loops outlives a lock file it
cannot open. Found by a black-box test: with a directory in the lock file's place, the
waiting worker's take-over ended on IsADirectoryError without a line in the log, so once the
holder died no worker ran the loops, and nothing said so."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from gateway import workers


async def test_the_take_over_keeps_trying_a_lock_it_cannot_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers, "LOCK_RETRY", 0.02)
    path = tmp_path / "loops.lock"
    path.mkdir()  # what the lock file became
    caplog.set_level(logging.ERROR, "conveyor.gateway.workers")
    waiting = asyncio.create_task(workers._lock_taken(str(path)))
    await asyncio.sleep(0.2)
    assert not waiting.done(), waiting  # it did not end
    said = [r for r in caplog.records if "cannot take" in r.getMessage()]
    assert len(said) == 1  # said once, not at every try
    path.rmdir()
    await asyncio.wait_for(waiting, 2)  # and it takes the lock once it can
    fd = workers._held.pop()
    os.close(fd)
