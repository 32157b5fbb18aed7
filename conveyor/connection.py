"""One way to reach RabbitMQ, for the gateway, the dispatcher and the CLI (SPEC §11.7).

CONVEYOR_AMQP_URL may list several nodes separated by `;`. Each process shuffles the
list once (a fleet spreads over the nodes), connects to the first node that answers,
and moves along the list whenever its connection is down. aio-pika has no multi-host
URL and its robust connection reconnects to the URL it holds, so `FailoverConnection`
moves that URL (a public attribute aio-pika itself reassigns) to the next node on every
drop, and again at each reconnect interval while no node answers. One URL, such as a
Kubernetes Service in front of the cluster, is a list of one.

The heartbeat bounds how long a frozen node (no socket closed) goes unnoticed: a
connection silent for two of the broker's heartbeat frames (one heartbeat, plus a second)
is closed, and the failover follows.

Every robust connection sends the frames written in one turn of the event loop together
(`CoalescingWriter`, `conveyor.coalescing`): aiormq writes each publish and each ack on
its own, each a system call and a TCP segment the broker reads on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any

import aio_pika
import aiormq
import pamqp.commands
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractRobustChannel,
    AbstractRobustConnection,
)
from aiormq.connection import TCPTransportFactory, TLSTransportFactory, TransportFactory
from yarl import URL

from conveyor.coalescing import TurnBuffer
from conveyor.dispatcher_settings import amqp_nodes

log = logging.getLogger(__name__)

# A dropped connection's next attempt, and each one after it while no node answers, comes
# this long after the last. aio-pika's default is 5 s: publishes resumed up to 5 s after the
# broker did (tests/integration/test_broker_reconnection.py). An attempt is cheap.
RECONNECT_INTERVAL = 1.0

# The connection itself lost, refused or frozen (aiormq's connection errors are OSErrors).
# A channel's error (a queue missing, locked, declared otherwise) is not one: it ends that
# channel, and a loop asking about many queues goes on to the next (gateway/outbox.py).
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (OSError, TimeoutError)

# What a connection attempt to a node that is down, frozen or refusing raises.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    *TRANSPORT_ERRORS,
    aiormq.exceptions.AMQPError,
)

# How long a channel being let go (replaced, or done with) may take to close.
CLOSE_TIMEOUT = 5.0


class NodeList:
    """The broker nodes of CONVEYOR_AMQP_URL, in this process's own order."""

    def __init__(self, setting: str, heartbeat: int | None = None, shuffle: bool = True) -> None:
        self.urls = [_with_heartbeat(url, heartbeat) for url in amqp_nodes(setting)]
        if shuffle:
            random.shuffle(self.urls)

    def __len__(self) -> int:
        return len(self.urls)

    def after(self, url: URL | str) -> str:
        """The node to try once `url` failed (the first one if `url` is not in the list)."""
        try:
            at = self.urls.index(str(url))
        except ValueError:
            return self.urls[0]
        return self.urls[(at + 1) % len(self.urls)]


def _with_heartbeat(url: str, heartbeat: int | None) -> str:
    """The URL with `heartbeat` in its query, unless the URL already sets one."""
    if heartbeat is None:
        return url
    parsed = URL(url)
    if "heartbeat" in parsed.query:
        return url
    return str(parsed.update_query(heartbeat=heartbeat))


# Past this many bytes not yet sent, a drain waits for the socket (the transport's default
# high-water mark): the coalescing never lifts the connection's flow control.
_COALESCE_LIMIT = 64 * 1024
# aiormq's queue of frames waiting for its writer holds 10 by default. A publisher that
# finds it full waits there holding its channel's lock, and the channel's next publisher
# gets the lock a turn of the event loop later: past 10, a burst of publishes left one frame
# per send again (91 sends for 100 publishes, tests/e2e/test_coalesced_sends.py). Every
# publisher awaits its confirm, so what waits in the queue is bounded by the publishers.
aiormq.connection.Connection.FRAME_BUFFER_SIZE = 256
# aiormq leaves a connection once nothing came from the broker for (heartbeat + 1) s times
# this multiplier, 3 by default: with CONVEYOR_AMQP_HEARTBEAT=10 a frozen node went unnoticed
# for 33-38 s. The broker sends a frame every heartbeat / 2 at least, so one multiple is
# RabbitMQ's own rule (two heartbeats missed), and the heartbeat is the bound it documents.
aiormq.connection.Connection.HEARTBEAT_GRACE_MULTIPLIER = 1


def _close_frame(frame: pamqp.commands.Connection.Close) -> str:
    return f"<Connection.Close {frame.reply_code} {frame.reply_text}>"


# A broker that accepts the login and then refuses the virtual host (missing, or not this
# user's) answers Connection.Close, which aiormq reports as "Expected Connection.OpenOk, got
# <Connection.Close object at 0x…>": every log and /readyz line said it failed, none why. The
# frame now shows the broker's code and reason (`530 NOT_ALLOWED - vhost … not found`).
pamqp.commands.Connection.Close.__repr__ = _close_frame  # type: ignore[method-assign,assignment]


class CoalescingWriter:
    """aiormq's socket writer, sending what one turn of the event loop wrote in one send.

    aiormq's writer task takes every frame queued since its last turn and writes each,
    then drains after each ack (and each publish that waits for it); a write is a `send()`
    and a segment of its own. Here the frames of a turn leave together at its end
    (`TurnBuffer`). A drain waits for the socket only once the unsent bytes pass
    `_COALESCE_LIMIT`, and a close or an end of file sends what is pending first.
    """

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._buffer = TurnBuffer(self._send)

    def _send(self, data: bytes) -> None:
        if not self._writer.is_closing():
            self._writer.write(data)

    @property
    def transport(self) -> asyncio.WriteTransport:
        return self._writer.transport

    def write(self, data: bytes) -> None:
        self._buffer.write(data)

    async def drain(self) -> None:
        if self._buffer.size + self._writer.transport.get_write_buffer_size() < _COALESCE_LIMIT:
            return
        self._buffer.flush()
        await self._writer.drain()

    def can_write_eof(self) -> bool:
        return self._writer.can_write_eof()

    def write_eof(self) -> None:
        self._buffer.flush()
        self._writer.write_eof()

    def is_closing(self) -> bool:
        return self._writer.is_closing()

    def close(self) -> None:
        self._buffer.flush()
        self._writer.close()

    async def wait_closed(self) -> None:
        await self._writer.wait_closed()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._writer.get_extra_info(name, default)


class CoalescingTransport(TransportFactory):
    """aiormq's own socket (TCP, or TLS for `amqps`), written through a `CoalescingWriter`."""

    async def create(
        self, url: URL, **kwargs: Any
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        inner = TLSTransportFactory() if url.scheme == "amqps" else TCPTransportFactory()
        reader, writer = await inner.create(url, **kwargs)
        return reader, CoalescingWriter(writer)  # type: ignore[return-value]


class FailoverConnection(aio_pika.RobustConnection):
    """A robust connection that tries the next node while it cannot reach the current one."""

    def __init__(self, url: URL, loop: Any = None, *, nodes: NodeList, **kwargs: Any) -> None:
        super().__init__(url, loop=loop, **kwargs)
        # aio-pika passes its connection's keyword arguments on to aiormq's
        self.kwargs["transport_factory"] = CoalescingTransport()
        self.nodes = nodes
        self.close_callbacks.add(self._move_on)
        self._watch: asyncio.Task[None] | None = None

    async def connect(self, timeout: Any = None) -> None:
        await super().connect(timeout)
        if self._watch is None and len(self.nodes) > 1:
            self._watch = asyncio.get_running_loop().create_task(self._move_while_down())

    def _move_on(self, *_: Any) -> None:
        """The connection dropped: the next attempt goes to the next node."""
        if len(self.nodes) > 1:
            self.url = URL(self.nodes.after(self.url))

    async def _move_while_down(self) -> None:
        """While no attempt succeeds, each reconnect interval points at another node."""
        while not self.is_closed:
            await asyncio.sleep(max(0.5, float(self.reconnect_interval)))
            if not self.connected.is_set() and not self.is_closed:
                self.url = URL(self.nodes.after(self.url))

    async def close(self, exc: Any = asyncio.CancelledError) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        await super().close(exc)


async def connect_robust(
    setting: str,
    *,
    name: str,
    heartbeat: int | None = None,
    reconnect_interval: float = RECONNECT_INTERVAL,
    timeout: float = 5.0,
) -> AbstractRobustConnection:
    """A robust connection to the first node that answers; raises the last error if none."""
    nodes = NodeList(setting, heartbeat)
    last: BaseException | None = None
    for url in nodes.urls:
        connection = FailoverConnection(
            URL(url),
            nodes=nodes,
            reconnect_interval=reconnect_interval,
            client_properties={"connection_name": name},
        )
        try:
            await connection.connect(timeout=timeout)
            return connection
        except CONNECTION_ERRORS as exc:
            await connection.close()
            last = exc
        except BaseException:
            # Cancelled mid-connect (a shutdown): closed here, or its reconnection task, which
            # swallows cancellations, kept the process alive after its shutdown was complete.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), timeout)
            raise
    assert last is not None
    raise last


async def connect(
    setting: str, *, name: str, heartbeat: int | None = None, timeout: float = 5.0
) -> AbstractConnection:
    """A plain connection (one command, one probe) to the first node that answers."""
    nodes = NodeList(setting, heartbeat)
    last: BaseException | None = None
    for url in nodes.urls:
        try:
            return await aio_pika.connect(
                url, client_properties={"connection_name": name}, timeout=timeout
            )
        except CONNECTION_ERRORS as exc:
            last = exc
    assert last is not None
    raise last


async def close_quietly(channel: AbstractChannel, timeout: float = CLOSE_TIMEOUT) -> None:
    """A channel let go, closed within `timeout` whatever the broker says (or does not): its
    owner has already moved on (a replacement, the end of a declaration), so a close that
    fails is logged, not raised."""
    try:
        await asyncio.wait_for(channel.close(), timeout)
    except Exception as exc:
        log.info("channel close did not complete", extra={"error": repr(exc)})


async def publish_confirmed(
    channel: AbstractChannel,
    exchange: str,
    message: aio_pika.Message,
    key: str,
    mandatory: bool = True,
) -> None:
    """A `mandatory` publish, awaited until the broker confirms it.

    Published on aio-pika's underlying aiormq channel with `wait=False`: aio-pika's own
    publish holds the channel's lock until aiormq's writer has sent the frame, so the
    publishes of one channel left one send each, one turn of the event loop apart; here
    the lock is released once the frame is queued, and the publishes of one turn leave
    together (`CoalescingWriter`). The confirm is awaited all the same.

    When the connection drops, aiormq cancels the confirmation it was waiting for: that
    CancelledError is the connection's, not a cancellation of ours, and becomes a
    ConnectionError the caller retries. Our own task being cancelled still cancels.
    """
    if channel.is_closed:
        raise aiormq.exceptions.ChannelInvalidStateError(f"{channel!r} closed")
    try:
        underlay = await channel.get_underlay_channel()
        assert isinstance(underlay, aiormq.Channel)  # `wait` is aiormq's, not in its abc
        await underlay.basic_publish(
            message.body,
            exchange=exchange,
            routing_key=key,
            properties=message.properties,
            mandatory=mandatory,
            wait=False,
        )
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise ConnectionError("the connection closed before the broker confirmed") from None


# A channel on which a publish has waited this long without the broker answering any
# publish (neither confirm nor nack) is taken for dead and replaced (`ConfirmingChannel`).
SILENT_CHANNEL = 5.0


class ConfirmingChannel:
    """The channel a process publishes on with confirms, replaced when the broker nacks or
    stops answering.

    RabbitMQ 3.10 was seen to nack every publish to a quorum queue, for as long as we
    watched (40 s), on a channel that had published while the queue's leader moved, though
    the new leader was elected within a second; a fresh channel publishes at once. A channel
    opened on a surviving node while the cluster had not yet replaced a frozen leader was
    seen to leave every publish to that queue unanswered until the frozen node came back
    (80 s), where a channel opened after the election publishes at once. So a nack replaces
    the channel, and so does a publish starting once the channel has left one unanswered for
    `SILENT_CHANNEL` seconds; the callers retry as after any unconfirmed publish.
    """

    def __init__(self, connection: AbstractConnection) -> None:
        self.connection = connection
        self.channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()
        # Since when the current channel has had a publish sent and no answer to any: a
        # publish its caller gave up on (a timeout) still counts.
        self._unanswered_since: float | None = None

    async def open(self) -> AbstractChannel:
        self.channel = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
        self._unanswered_since = None
        return self.channel

    @property
    def silent(self) -> bool:
        """Nothing answered for `SILENT_CHANNEL` seconds since a publish was sent."""
        since = self._unanswered_since
        return since is not None and time.monotonic() - since >= SILENT_CHANNEL

    async def ready(self) -> None:
        """Once a reconnection under way has restored the channel."""
        if isinstance(self.channel, AbstractRobustChannel):
            await self.channel.ready()

    async def publish(self, message: aio_pika.Message, key: str, exchange: str = "") -> None:
        """To a queue by name (the default exchange, `mandatory`: an unroutable message is an
        error), or to a named exchange (a broadcast: nobody listening is fine)."""
        channel = self.channel or await self.open()
        # While a robust connection reconnects, it restores the channel itself.
        if self.silent and self.connection.connected.is_set():
            if await self._replace(channel):
                log.warning("publish channel silent; replaced", extra={"seconds": SILENT_CHANNEL})
            channel = self.channel or await self.open()
        if self._unanswered_since is None:
            self._unanswered_since = time.monotonic()
        try:
            await publish_confirmed(channel, exchange, message, key, mandatory=not exchange)
        except aio_pika.exceptions.PublishError:
            self._answer(channel)
            raise  # returned as unroutable: the channel is fine
        except aio_pika.exceptions.DeliveryError:
            await self._replace(channel)
            raise
        self._answer(channel)

    def _answer(self, channel: AbstractChannel) -> None:
        if self.channel is channel:
            self._unanswered_since = None

    async def _replace(self, stale: AbstractChannel) -> bool:
        """A new channel in place of `stale`, unless another publish replaced it already; a
        connection that drops meanwhile cancels the opening, which is a ConnectionError to
        the caller as in `publish_confirmed`."""
        async with self._lock:
            if self.channel is not stale:
                return False
            try:
                self.channel = await self.connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                raise ConnectionError("the connection closed while a channel opened") from None
            self._unanswered_since = None
        with contextlib.suppress(Exception):
            await stale.close()
        return True
