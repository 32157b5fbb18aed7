"""The AMQP side: one robust connection, the wait for `-in`, and deliveries.

Reconnection is aio-pika's job (`connect_robust`): after a broker restart or a
network cut it reconnects, reopens the channels, re-applies the prefetch and
restores the consumer. What it cannot do is make old delivery tags valid
again: a tag only means something on the channel that delivered it, and the
broker has already requeued every message that channel held unacked. So a
`Delivery` remembers the exact channel it came from, and `ack()` refuses to
act once that channel is gone (the message will be, or already was, delivered
again); it never acks on the new channel with an old tag.

The dispatcher never declares `-in`: the gateway owns the topology and a
declaration with other arguments would be refused. It waits for the queues
with passive declarations, once a second, on a short-lived plain connection.

Deliveries are handed to the dispatcher's own tasks at once: aio-pika runs the
consumer callback in a task that is cancelled when its channel closes, and an
in-flight call must survive a reconnection to still publish its result.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

import aio_pika
import aiormq
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustChannel, AbstractRobustConnection

from conveyor import connection as amqp_connection
from conveyor import headers as h
from conveyor.amqp import from_amqp
from conveyor.connection import ConfirmingChannel, close_quietly
from conveyor.events import WireMessage
from conveyor.topology import QueueProbe, cancel_log, control_exchange, declare_control

log = logging.getLogger(__name__)

# What a broker outage looks like to a caller (ChannelInvalidStateError is a RuntimeError).
BROKER_ERRORS = (*aio_pika.exceptions.CONNECTION_EXCEPTIONS, TimeoutError)
# The `type` of the message a dispatcher appends to the cancel log to know it has read it all.
RECALL_MARKER = "io.conveyor.dispatcher.recalled"
RECALL_PREFETCH = 1000
# Deliveries of the cancel log acked at once: well under the prefetch, so that credit flows.
RECALL_ACK_EVERY = RECALL_PREFETCH // 4
# A consumer replaced (`Broker.consume_again`) in this long at most, or left as it was.
CONSUME_AGAIN_TIMEOUT = 5.0


def _int_header(headers: dict[str, Any], name: str) -> int:
    value = headers.get(name)
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(0, value)
    if isinstance(value, bytes | str):
        try:
            return max(0, int(value))
        except ValueError:
            return 0
    return 0


@dataclass(eq=False, slots=True)
class Delivery:
    """One message taken from `-in`, bound to the channel that delivered it."""

    message: AbstractIncomingMessage
    channel: aiormq.abc.AbstractChannel
    received: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, message: AbstractIncomingMessage) -> Delivery:
        return cls(message, message.channel)

    @property
    def tag(self) -> int | None:
        return self.message.delivery_tag

    @property
    def message_id(self) -> str | None:
        return self.message.message_id

    @property
    def headers(self) -> dict[str, Any]:
        return dict(self.message.headers or {})

    @property
    def valid(self) -> bool:
        """False once the delivering channel is closed: the tag means nothing any more."""
        return not self.channel.is_closed

    @property
    def settled(self) -> bool:
        return self.message.processed

    def wire(self) -> WireMessage:
        return from_amqp(self.message)

    def previous_deliveries(self) -> int:
        """Deliveries of this task before this one.

        `x-delivery-count` is the broker's count of returns of this copy
        (crashes, connection losses); `x-conveyor-requeues` carries what
        earlier copies used before a graceful requeue republished the message.
        A classic queue has no delivery count: its `redelivered` flag counts one.
        """
        headers = self.message.headers or {}
        return _int_header(headers, h.REQUEUES) + self._returns(headers)

    def crashes(self) -> int:
        """Returns of this task's copies without a graceful requeue: crashes, connection
        losses, nacks. The broker counts this copy's; an earlier copy's are in CRASHES."""
        headers = self.message.headers or {}
        return _int_header(headers, h.CRASHES) + self._returns(headers)

    def _returns(self, headers: dict[str, Any]) -> int:
        count = _int_header(headers, h.DELIVERY_COUNT)
        if not count and h.DELIVERY_COUNT not in headers and self.message.redelivered:
            count = 1  # a classic queue has no count: its flag says one at least
        return count

    async def ack(self) -> bool:
        return await self._settle("ack", self.message.ack)

    async def reject(self) -> bool:
        """Without requeue: a quorum `-in` dead-letters it to `-dlq`."""
        return await self._settle("reject", lambda: self.message.nack(requeue=False))

    async def nack_requeue(self) -> bool:
        return await self._settle("nack", lambda: self.message.nack(requeue=True))

    async def _settle(self, what: str, action: Callable[[], Any]) -> bool:
        if self.settled:
            return False
        if not self.valid:
            log.info(
                "%s skipped: channel closed, the broker has requeued the message",
                what,
                extra={"delivery_tag": self.tag, "message_id": self.message_id},
            )
            return False
        try:
            await action()
        except BROKER_ERRORS as exc:
            log.warning("%s failed", what, extra={"delivery_tag": self.tag, "error": repr(exc)})
            return False
        return True


# What AMQP (pamqp) takes in a queue name: the host name in the cancel queue's is only there to
# be read in the broker's lists, so anything else becomes '_' (it refused the dispatcher's start).
_NOT_IN_QUEUE_NAMES = re.compile(r"[^a-zA-Z0-9\-_.:@#,/+ ]")
_HOST_IN_QUEUE_NAME = 100  # of the 255 bytes a queue name may have, beside the exchange's name


def _queue_safe(hostname: str) -> str:
    return _NOT_IN_QUEUE_NAMES.sub("_", hostname)[:_HOST_IN_QUEUE_NAME]


class ControlQueue(aio_pika.RobustQueue):
    """The cancel queue, under a new name at every reconnection.

    Its exclusive name stays locked as long as the cluster believes the old connection
    alive, which for a frozen node lasts until the other nodes give up on it
    (`net_ticktime`). Declared again under that name, it refused the whole reconnection
    (RESOURCE_LOCKED), and the dispatcher consumed nothing until the node came back.
    """

    @staticmethod
    def named(prefix: str) -> str:
        return f"{prefix}.{uuid.uuid4().hex[:8]}"

    async def restore(self, channel: Any = None) -> None:
        self.name = self.named(self.name.rpartition(".")[0])
        await super().restore(channel)


class CancelLogReading:
    """One read of the cancel log, consumed on its aiormq channel (a consumer aio-pika would
    restore after a reconnection, on a new channel, with the old offset; the reconnection
    reads the log again itself).

    A delivery is counted and handed to `heard`, nothing more. The reading coroutine alone
    acks (a stream's acks are credit, and only credit), every `RECALL_ACK_EVERY` deliveries
    at once: once it stops, nothing acks on the channel any more, and the channel may be
    closed. Each delivery used to ack itself in a task of its own, one awaited ack each, and
    those still running when a read gave up acked after `channel.close`: the broker, whose
    channel was closed, closed the whole connection (CHANNEL_ERROR, expected 'channel.open')
    and the dispatcher died at every start.
    """

    def __init__(
        self, channel: aiormq.abc.AbstractChannel, heard: Callable[[AbstractIncomingMessage], None]
    ) -> None:
        self.channel = channel
        self.heard = heard
        self.marker = uuid.uuid4().hex
        self.read = 0
        self._delivered = 0
        self._last_tag: int | None = None
        self._acked_tag: int | None = None
        self._came_back = False
        self._stopped = False
        self._batch = asyncio.Event()

    async def on_delivery(self, delivered: aiormq.abc.DeliveredMessage) -> None:
        if self._stopped:
            return  # after the end or the patience: dropped, never acked
        message = aio_pika.IncomingMessage(delivered, no_ack=False)
        if message.message_id == self.marker:
            self._came_back = True
        elif message.type != RECALL_MARKER:  # another dispatcher's marker
            self.heard(message)
            self.read += 1
        self._last_tag = delivered.delivery_tag
        self._delivered += 1
        if self._came_back or self._delivered % RECALL_ACK_EVERY == 0:
            self._batch.set()

    async def next_batch(self) -> bool:
        """Waits for the next batch of deliveries and acks it; True once the marker came back."""
        await self._batch.wait()
        self._batch.clear()
        if self._came_back:
            return True
        tag = self._last_tag
        if tag is not None and tag != self._acked_tag and not self.channel.is_closed:
            self._acked_tag = tag
            await self.channel.basic_ack(tag, multiple=True)
        return False

    def stop(self) -> None:
        self._stopped = True


class Broker:
    """The robust connection, its consume channel and its publish channel."""

    def __init__(
        self,
        url: str,
        in_queue: str,
        out_queue: str,
        prefetch: int,
        name: str,
        heartbeat: int | None = None,
    ) -> None:
        self.url = url
        self.heartbeat = heartbeat
        self.in_queue = in_queue
        self.out_queue = out_queue
        self.prefetch = prefetch
        self.name = name
        self.connection: AbstractRobustConnection | None = None
        self.publishing: ConfirmingChannel | None = None
        self._consume_channel: AbstractRobustChannel | None = None
        self._queue: aio_pika.abc.AbstractRobustQueue | None = None
        self._consumer_tag: str | None = None
        self._probe = QueueProbe()  # `ready_in_queue`'s channel

    async def consuming(self) -> bool:
        """Whether the broker delivers to our consumer now. It cancels it when `-in` goes
        (deleted, or lost with a node): aio-pika consumes again once the queue is back, and
        until then the dispatcher is connected but takes nothing, so it is not ready."""
        tag, channel = self._consumer_tag, self._consume_channel
        if tag is None or channel is None or channel.is_closed:
            return False
        try:
            underlay = cast(aiormq.Channel, await channel.get_underlay_channel())
        except aiormq.exceptions.AMQPError:
            return False
        return tag in underlay.consumers

    @property
    def connected(self) -> bool:
        conn = self.connection
        channel = self._consume_channel
        return (
            conn is not None
            and not conn.is_closed
            and conn.connected.is_set()
            and channel is not None
            and not channel.is_closed
        )

    async def wait_for_queues(self, stop: asyncio.Event) -> bool:
        """Passive declarations every second until both queues exist; False if stopped."""
        attempt = 0
        while not stop.is_set():
            try:
                missing = await self._missing_queues()
            except BROKER_ERRORS as exc:
                missing = None
                if attempt % 10 == 0:
                    log.warning("broker unreachable; retrying", extra={"error": repr(exc)})
            else:
                if not missing:
                    return True
                if attempt % 10 == 0:
                    log.info("waiting for the gateway to declare %s", ", ".join(missing))
            attempt += 1
            await _sleep_unless(stop, 1.0)
        return False

    async def _missing_queues(self) -> list[str]:
        connection = await amqp_connection.connect(
            self.url, name=f"{self.name} probe", heartbeat=self.heartbeat
        )
        try:
            missing = []
            for name in (self.in_queue, self.out_queue):
                channel = await connection.channel(publisher_confirms=False)
                try:
                    await channel.declare_queue(name, passive=True)
                except aio_pika.exceptions.ChannelNotFoundEntity:
                    missing.append(name)
                finally:
                    if not channel.is_closed:
                        await channel.close()
            return missing
        finally:
            await connection.close()

    async def connect(self, stop: asyncio.Event) -> bool:
        """The robust connection; retried every second until it works or `stop`."""
        while not stop.is_set():
            try:
                self.connection = await amqp_connection.connect_robust(
                    self.url,
                    name=self.name,
                    heartbeat=self.heartbeat,
                )
            except BROKER_ERRORS as exc:
                log.warning("cannot connect to the broker; retrying", extra={"error": repr(exc)})
                await _sleep_unless(stop, 1.0)
                continue
            self.publishing = ConfirmingChannel(self.connection)
            await self.publishing.open()
            return True
        return False

    async def consume(self, callback: Callable[[AbstractIncomingMessage], Any]) -> None:
        self._consume_channel, self._queue, self._consumer_tag = await self._consumer(callback)
        log.info("consuming", extra={"queue": self.in_queue, "prefetch": self.prefetch})

    async def _consumer(
        self, callback: Callable[[AbstractIncomingMessage], Any]
    ) -> tuple[AbstractRobustChannel, aio_pika.abc.AbstractRobustQueue, str]:
        """A channel of its own with the prefetch, and a consumer of `-in` on it."""
        assert self.connection is not None
        channel = cast(
            AbstractRobustChannel, await self.connection.channel(publisher_confirms=False)
        )
        try:
            await channel.set_qos(prefetch_count=self.prefetch)
            queue = cast(
                aio_pika.abc.AbstractRobustQueue,
                await channel.declare_queue(self.in_queue, passive=True),
            )
            return channel, queue, await queue.consume(callback, no_ack=False)
        except BaseException:
            await close_quietly(channel)
            raise

    async def ready_in_queue(self) -> int | None:
        """The messages ready in `-in` now (None: no such queue), within CONSUME_AGAIN_TIMEOUT,
        asked on one channel kept for it (`QueueProbe`)."""
        assert self.connection is not None
        async with asyncio.timeout(CONSUME_AGAIN_TIMEOUT):
            return await self._probe.ready_messages(self.connection, self.in_queue)

    async def consume_again(self, callback: Callable[[AbstractIncomingMessage], Any]) -> bool:
        """The consumer replaced by one on a fresh channel; whether it was.

        RabbitMQ 3.10 sends no cancel to the consumers of a quorum queue deleted and declared
        again at once (an operator's script): they stay counted on the new queue, which hands
        them its messages, and the channel passes none on. Neither the consumer nor a new one
        on the same channel hears anything again; closing the channel gives those messages
        back. The new consumer comes first: should it fail (the queue missing, the broker
        away), the old one stays. A delivery the old channel took meanwhile and could not ack
        is given again and known (`Orphans`): its function is not called twice.
        """
        old = (self._consume_channel, self._queue, self._consumer_tag)
        if old[0] is None or old[0].is_closed or old[2] is None:
            return False  # not consuming (shutting down), or aio-pika is restoring it
        try:
            fresh = await asyncio.wait_for(self._consumer(callback), CONSUME_AGAIN_TIMEOUT)
        except (*BROKER_ERRORS, aio_pika.exceptions.AMQPError) as exc:
            log.info("consumer not replaced", extra={"error": repr(exc)})
            return False
        self._consume_channel, self._queue, self._consumer_tag = fresh
        await close_quietly(old[0])  # its consumer with it; what it held goes back
        return True

    async def listen_for_cancels(
        self, queue_name: str, hostname: str, callback: Callable[[AbstractIncomingMessage], Any]
    ) -> None:
        """Binds a queue of this process's own (exclusive, auto-delete: it goes with the
        connection, and the robust connection declares and binds another) to the service's
        cancel exchange."""
        assert self.connection is not None
        channel = await self.connection.channel(publisher_confirms=False)
        exchange = await declare_control(channel, queue_name)
        channel.QUEUE_CLASS = ControlQueue
        name = ControlQueue.named(f"{control_exchange(queue_name)}.{_queue_safe(hostname)}")
        queue = await channel.declare_queue(name, exclusive=True, auto_delete=True)
        await queue.bind(exchange)
        await queue.consume(callback, no_ack=True)

    async def recall_cancels(
        self,
        queue_name: str,
        since: datetime,
        heard: Callable[[AbstractIncomingMessage], None],
        patience: float,
    ) -> int | None:
        """The cancels the service's `<q>-cancels` stream kept since `since`, each handed to
        `heard`; how many, or None when the log went quiet for `patience` before it was all
        read (what was read is kept; the caller carries on without the rest).

        A stream has no end to wait for: a marker of this dispatcher's own is appended, and
        everything before it has been read when it comes back. No stream yet: no cancel yet.
        `patience` bounds a silence, not the read: a day of cancels may be tens of thousands.
        """
        assert self.connection is not None and self.publishing is not None
        name = cancel_log(queue_name)
        channel = await self.connection.channel(publisher_confirms=False)
        reading: CancelLogReading | None = None
        try:
            async with asyncio.timeout(patience) as silence:
                try:
                    stream = await channel.declare_queue(name, passive=True)
                except aio_pika.exceptions.ChannelNotFoundEntity:
                    return 0
                await channel.set_qos(prefetch_count=RECALL_PREFETCH)
                underlay = cast(aiormq.Channel, await channel.get_underlay_channel())
                reading = CancelLogReading(underlay, heard)
                await underlay.basic_consume(
                    stream.name, reading.on_delivery, arguments={"x-stream-offset": since}
                )
                await self.publishing.publish(
                    aio_pika.Message(b"", message_id=reading.marker, type=RECALL_MARKER), name
                )
                while not await reading.next_batch():
                    silence.reschedule(asyncio.get_running_loop().time() + patience)
        except BROKER_ERRORS as exc:
            log.warning(
                "cancel log not read in time; cancels from before this start may be missed",
                extra={"error": repr(exc), "read": reading.read if reading else 0},
            )
            return None
        finally:
            if reading is not None:
                reading.stop()
            if not channel.is_closed:
                try:
                    await channel.close()
                except BROKER_ERRORS as exc:  # the connection went meanwhile: so did the channel
                    log.info("cancel log channel not closed", extra={"error": repr(exc)})
        return reading.read if reading else 0

    async def stop_consuming(self) -> None:
        """basic.cancel: the broker sends nothing more; deliveries in flight stay ours."""
        tag, self._consumer_tag = self._consumer_tag, None
        if tag is None or self._queue is None:
            return
        try:
            await asyncio.wait_for(self._queue.cancel(tag), timeout=2)
        except Exception as exc:  # broker gone: it stops delivering anyway
            log.info("consumer cancel did not complete", extra={"error": repr(exc)})

    async def close(self) -> None:
        if self.connection is not None and not self.connection.is_closed:
            try:
                await asyncio.wait_for(self.connection.close(), timeout=3)
            except Exception as exc:
                log.info("connection close did not complete", extra={"error": repr(exc)})


async def _sleep_unless(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass
