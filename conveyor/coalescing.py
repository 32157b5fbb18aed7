"""Bytes written during one turn of the event loop, sent in one call at its end.

asyncio's socket transports send on every `write()` while nothing is queued, so a
protocol that writes a message in parts pays a system call per part, and on loopback TCP
(TCP_NODELAY) a segment the peer wakes up for: uvicorn writes an answer's head and then
its body, aiormq each publish and each ack. Deferring the send with `call_soon` to the end
of the current turn joins what the turn wrote, in order, and delays nothing past it.
Both servers write through one (bench/README.md, "Sends of one turn in one").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class TurnBuffer:
    """Collects writes and hands them to `send` joined, once, at the end of the turn."""

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self._send = send
        self._pending: list[bytes] = []
        self.size = 0  # bytes written and not sent yet

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self._pending.append(data)
        self.size += len(data)

    def flush(self) -> None:
        """Sends what is pending now (before a close, or to apply backpressure)."""
        if not self._pending:
            return
        data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending.clear()
        self.size = 0
        self._send(data)
