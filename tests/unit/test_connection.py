"""The broker node list of CONVEYOR_AMQP_URL and the publishing channel's replacement
(conveyor/connection.py), without a broker."""

from __future__ import annotations

import asyncio
from typing import Any

import aio_pika
import pytest
from yarl import URL

from conveyor import connection as connection_module
from conveyor.connection import ConfirmingChannel, NodeList

THREE = "amqp://u:p@rmq-0:5672/;amqp://u:p@rmq-1:5672/ ; amqp://u:p@rmq-2:5672/;"


def test_the_list_is_split_shuffled_per_process_and_walked_round() -> None:
    nodes = NodeList(THREE, shuffle=False)
    assert nodes.urls == [f"amqp://u:p@rmq-{n}:5672/" for n in range(3)]
    assert nodes.after(nodes.urls[0]) == nodes.urls[1]
    assert nodes.after(URL(nodes.urls[2])) == nodes.urls[0]
    assert nodes.after("amqp://elsewhere/") == nodes.urls[0]
    orders = {tuple(NodeList(THREE).urls) for _ in range(50)}
    assert len(orders) > 1  # each process starts somewhere else


def test_one_url_is_a_list_of_one() -> None:
    nodes = NodeList("amqp://guest:guest@127.0.0.1:5672/")
    assert nodes.urls == ["amqp://guest:guest@127.0.0.1:5672/"]
    assert nodes.after(nodes.urls[0]) == nodes.urls[0]


def test_the_heartbeat_is_added_unless_the_url_sets_its_own() -> None:
    nodes = NodeList("amqp://a/;amqp://b/?heartbeat=3", heartbeat=10, shuffle=False)
    assert [URL(u).query.get("heartbeat") for u in nodes.urls] == ["10", "3"]


def test_an_empty_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="must name a broker node"):
        NodeList(" ; ")


class _Channel:
    def __init__(self, number: int) -> None:
        self.number = number
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class _Connection:
    """Hands out numbered channels; the broker behind it never answers on the first."""

    def __init__(self) -> None:
        self.channels: list[_Channel] = []
        self.connected = asyncio.Event()
        self.connected.set()

    async def channel(self, **_: object) -> _Channel:
        self.channels.append(_Channel(len(self.channels) + 1))
        return self.channels[-1]


def test_a_channel_the_broker_stopped_answering_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RabbitMQ 3.10 left every publish of a channel opened mid-election unanswered until the
    frozen node came back; the callers' retries went to the same channel forever."""
    published: list[tuple[int, bytes]] = []

    async def publish_confirmed(
        channel: _Channel, _e: str, message: Any, _k: str, **__: Any
    ) -> None:
        if channel.number == 1:
            await asyncio.Event().wait()  # never confirmed, never nacked
        published.append((channel.number, message.body))

    monkeypatch.setattr(connection_module, "publish_confirmed", publish_confirmed)
    monkeypatch.setattr(connection_module, "SILENT_CHANNEL", 0.3)

    async def scenario() -> _Connection:
        conn = _Connection()
        confirming = ConfirmingChannel(conn)  # type: ignore[arg-type]
        await confirming.open()
        for body in (b"a", b"b"):  # the caller gives up on each before the channel is silent
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await confirming.publish(aio_pika.Message(body), "q")
        await asyncio.sleep(0.3)
        async with asyncio.timeout(1):
            await confirming.publish(aio_pika.Message(b"c"), "q")  # on a new channel
            await confirming.publish(aio_pika.Message(b"d"), "q")  # which answers: kept
        return conn

    conn = asyncio.run(scenario())
    assert published == [(2, b"c"), (2, b"d")]
    assert [c.closed for c in conn.channels] == [True, False]


def test_a_quiet_channel_that_answers_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    async def publish_confirmed(*_: Any, **__: Any) -> None:
        return None

    monkeypatch.setattr(connection_module, "publish_confirmed", publish_confirmed)
    monkeypatch.setattr(connection_module, "SILENT_CHANNEL", 0.1)

    async def scenario() -> _Connection:
        conn = _Connection()
        confirming = ConfirmingChannel(conn)  # type: ignore[arg-type]
        for _ in range(3):
            await confirming.publish(aio_pika.Message(b"x"), "q")
            await asyncio.sleep(0.15)  # idle longer than SILENT_CHANNEL between publishes
        return conn

    assert len(asyncio.run(scenario()).channels) == 1
