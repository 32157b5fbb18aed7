"""The broker connection's socket writer (conveyor/connection.py, `CoalescingWriter`): the
frames of one turn of the event loop leave in one send, in order, and never later than
that turn; flow control and closing still hold."""

from __future__ import annotations

import asyncio
from typing import Any

from conveyor.connection import _COALESCE_LIMIT, CoalescingWriter


class _Transport:
    def __init__(self) -> None:
        self.buffered = 0

    def get_write_buffer_size(self) -> int:
        return self.buffered


class _Recorder:
    """Stands in for asyncio's StreamWriter: records each send."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.events: list[str] = []
        self.transport = _Transport()
        self.closing = False

    def write(self, data: bytes) -> None:
        self.sent.append(data)
        self.events.append("write")

    async def drain(self) -> None:
        self.events.append("drain")

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.events.append("eof")

    def close(self) -> None:
        self.closing = True
        self.events.append("close")

    async def wait_closed(self) -> None:
        return None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def _writer() -> tuple[CoalescingWriter, _Recorder]:
    inner = _Recorder()
    return CoalescingWriter(inner), inner  # type: ignore[arg-type]


async def test_writes_of_one_turn_leave_in_one_send_in_order() -> None:
    writer, inner = _writer()
    for frame in (b"publish-1;", b"ack-7;", b"publish-2;"):
        writer.write(frame)
        await writer.drain()  # aiormq drains after each publish and ack
    assert inner.sent == []  # nothing is held past this turn, but nothing left yet
    await asyncio.sleep(0)
    assert inner.sent == [b"publish-1;ack-7;publish-2;"]
    writer.write(b"next-turn;")
    await asyncio.sleep(0)
    assert inner.sent[-1] == b"next-turn;"


async def test_past_the_limit_a_drain_sends_and_waits_for_the_socket() -> None:
    writer, inner = _writer()
    writer.write(b"x" * (_COALESCE_LIMIT // 2))
    await writer.drain()
    assert inner.events == []
    writer.write(b"y" * (_COALESCE_LIMIT // 2))
    await writer.drain()
    assert inner.events == ["write", "drain"]
    assert len(inner.sent[0]) == _COALESCE_LIMIT

    inner.transport.buffered = _COALESCE_LIMIT  # the socket itself is behind
    writer.write(b"z")
    await writer.drain()
    assert inner.events[-2:] == ["write", "drain"]


async def test_closing_sends_what_is_pending_first() -> None:
    writer, inner = _writer()
    writer.write(b"close-ok;")
    writer.write_eof()
    writer.close()
    assert inner.sent == [b"close-ok;"]
    assert inner.events == ["write", "eof", "close"]
    await asyncio.sleep(0)  # the scheduled send finds nothing more to send
    assert inner.sent == [b"close-ok;"]


async def test_on_a_real_socket_every_byte_arrives_in_order() -> None:
    received = bytearray()
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.extend(await reader.read())
        done.set()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, plain = await asyncio.open_connection("127.0.0.1", port)
    writer = CoalescingWriter(plain)
    frames = [f"{n:05d};".encode() * (n % 7 + 1) for n in range(3000)]
    for n, frame in enumerate(frames):
        writer.write(frame)
        await writer.drain()
        if n % 50 == 0:
            await asyncio.sleep(0)
    writer.write_eof()
    await asyncio.wait_for(done.wait(), 10)
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()
    assert bytes(received) == b"".join(frames)
