"""The gateway's HTTP connections: uvicorn's httptools protocol, each answer in one send.

uvicorn writes an answer's head when the app starts it and its body when the app sends
it: two system calls, two TCP segments and two wake-ups of the client for every answer.
`conveyor gateway` serves with `CoalescingHttpToolsProtocol` (uvicorn's `http` setting
takes a protocol class), whose transport joins what one turn of the event loop wrote
(`conveyor.coalescing`). Streams (the event stream's SSE) still leave turn by turn.
What the parser refuses before the app sees it is answered with the API's own 400002
envelope, as every other refusal is, rather than uvicorn's plain text. uvicorn has no limit
on the time a request takes to arrive: a client that connects and sends nothing, or trickles
a request a byte at a time, held its connection (and a descriptor) forever. A request must
now arrive whole within CONVEYOR_REQUEST_READ_TIMEOUT of its connection, or of its first
byte, or its connection is closed. Between requests an idle connection is uvicorn's to close,
after CONVEYOR_KEEP_ALIVE_TIMEOUT.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from conveyor.coalescing import TurnBuffer
from conveyor.settings import GatewaySettings
from gateway import errors


class TurnTransport(asyncio.Transport):
    """A connection's transport whose writes of one turn leave together at its end."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self._transport = transport
        self._buffer = TurnBuffer(self._send)

    def _send(self, data: bytes) -> None:
        if not self._transport.is_closing():
            self._transport.write(data)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._buffer.write(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def get_write_buffer_size(self) -> int:
        return self._buffer.size + self._transport.get_write_buffer_size()

    def close(self) -> None:
        self._buffer.flush()  # what was answered goes out before the connection closes
        self._transport.close()

    def abort(self) -> None:
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def write_eof(self) -> None:
        self._buffer.flush()
        self._transport.write_eof()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)


@functools.cache
def read_timeout() -> float:
    """Read once per process: uvicorn makes the protocol, and its workers are processes."""
    return GatewaySettings().request_read_timeout


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a `TurnTransport`, with a deadline for each request."""

    _reading: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(TurnTransport(transport))
        self._expect_request()

    def data_received(self, data: bytes) -> None:
        if self._reading is None:  # a request begins (or goes on after a whole one)
            self._expect_request()
        super().data_received(data)

    def on_message_complete(self) -> None:
        self._stop_expecting()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_expecting()
        super().connection_lost(exc)

    def _expect_request(self) -> None:
        self._stop_expecting()
        self._reading = self.loop.call_later(read_timeout(), self._not_in_time)

    def _stop_expecting(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None

    def _not_in_time(self) -> None:
        """Closed without an answer: the client is not reading one either. An app already
        reading the body is told the client is gone."""
        self._reading = None
        if not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(errors.invalid("request", msg).envelope()).encode()
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        head += [
            name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers
        ]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
