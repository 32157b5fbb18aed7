"""The shared queue probe (`topology.QueueProbe`) with a question that never ends: a frozen
node, or a quorum queue whose leader is frozen, may leave a passive declaration unanswered."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from conveyor.topology import QueueProbe


class _Channel:
    """Answers every question at once, but those about `stuck` until `release` is set."""

    def __init__(self, release: asyncio.Event) -> None:
        self.release = release
        self.is_closed = False

    async def declare_queue(self, name: str, passive: bool = False, **_: Any) -> Any:
        assert passive
        if name == "stuck":
            await self.release.wait()
        return SimpleNamespace(declaration_result=SimpleNamespace(message_count=3))

    async def close(self) -> None:
        self.is_closed = True


class _Connection:
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.channels: list[_Channel] = []

    async def channel(self, **_: Any) -> _Channel:
        self.channels.append(_Channel(self.release))
        return self.channels[-1]


async def _after_a_stuck_question() -> tuple[Any, _Connection]:
    connection = _Connection()
    probe = QueueProbe()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await probe.ready_messages(connection, "stuck")  # type: ignore[arg-type]
    try:
        async with asyncio.timeout(1.0):
            answer: Any = await probe.ready_messages(connection, "other")  # type: ignore[arg-type]
    except TimeoutError:
        answer = "no answer in 1 s"
    connection.release.set()  # the stuck question ends at last
    for _ in range(5):
        await asyncio.sleep(0)
    return answer, connection


def test_a_question_that_does_not_end_holds_no_other() -> None:
    """Given up by its caller, the question is left to end on its channel (cancelled halfway,
    aiormq would close the channel under the next one), but the next question is asked on a
    fresh channel, not after it: one unanswered question held every later one, of every
    loop, for as long as it lasted. The abandoned channel is closed once its question ends."""
    answer, connection = asyncio.run(_after_a_stuck_question())
    assert answer == 3
    assert len(connection.channels) == 2
    assert connection.channels[0].is_closed
    assert not connection.channels[1].is_closed
