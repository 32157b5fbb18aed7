"""The gateway's RabbitMQ connection: robust (aio-pika reconnects by itself) and
publishing with confirms, `mandatory` so that a missing queue is an error
(`QueueMissing`, which the outbox answers by declaring the queue again) rather than a
silently dropped task.

Broadcasts (cancels, to a service's `-control` exchange) go on a channel of their own: a
publish to an exchange that no longer exists is a channel error (NOT_FOUND), which closed the
channel every task was published on, failed the publishes in flight on it and turned
`/readyz` 503 until it was restored."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractRobustConnection

from conveyor import topology
from conveyor.amqp import to_amqp
from conveyor.connection import ConfirmingChannel, connect_robust
from conveyor.events import WireMessage

log = logging.getLogger("conveyor.gateway.broker")


class PublishError(RuntimeError):
    """The broker did not confirm: the outbox keeps the task for the relay."""


class PublishTimeout(PublishError):
    """Nor did it refuse, within `publish_timeout`: a broker that blocks publishers (a memory
    or disk alarm), or a queue that cannot take messages now."""


class ExchangeMissing(PublishError):
    """The broker closed the broadcast channel: no exchange of that name (NOT_FOUND)."""


class QueueMissing(PublishError):
    """The broker returned the message (`basic.return`, NO_ROUTE): no queue of that name.
    A `mandatory` publish to the default exchange is returned only so, and RabbitMQ reports a
    missing queue no other way (no channel error, the publish is even confirmed after it)."""


PROBE_ROUTING_KEY = "amq.conveyor.probe"
_PROBE = WireMessage(body=b"", content_type=None)


class Broker:
    def __init__(
        self, url: str, publish_timeout: float = 5.0, heartbeat: int | None = None
    ) -> None:
        self.url = url
        self.heartbeat = heartbeat
        self.publish_timeout = publish_timeout
        self._connection: AbstractRobustConnection | None = None
        self._publishing: ConfirmingChannel | None = None
        self._broadcasting: ConfirmingChannel | None = None
        self._connect_lock = asyncio.Lock()
        self._on_reconnect: list[Callable[[], None]] = []
        self._declared: set[str] = set()
        self._probe = topology.QueueProbe()  # `queue_exists`'s channel

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        """`callback()` after the connection was lost and made again."""
        self._on_reconnect.append(callback)

    def _reconnected(self, *_: object) -> None:
        for callback in self._on_reconnect:
            callback()

    @property
    def connected(self) -> bool:
        return (
            self._connection is not None
            and not self._connection.is_closed
            and self._publishing is not None
            and self._publishing.channel is not None
            and not self._publishing.channel.is_closed
        )

    async def connect(self) -> AbstractRobustConnection:
        async with self._connect_lock:
            if self._connection is None:
                self._connection = await connect_robust(
                    self.url, name="conveyor-gateway", heartbeat=self.heartbeat
                )
                self._connection.reconnect_callbacks.add(self._reconnected)
                self._publishing = ConfirmingChannel(self._connection)
                self._broadcasting = ConfirmingChannel(self._connection)
                await self._publishing.open()
                # Opened here, not by the first cancels: a batch of them at once would each
                # open one, and keep only the last.
                await self._broadcasting.open()
            return self._connection

    async def channel(self, prefetch: int | None = None) -> AbstractChannel:
        """A new channel for a consumer (one per consumer keeps acks independent)."""
        connection = await self.connect()
        channel = await connection.channel()
        if prefetch:
            await channel.set_qos(prefetch_count=prefetch)
        return channel

    async def declare_once(
        self, key: str, declare: Callable[[AbstractChannel], Awaitable[None]]
    ) -> None:
        """`declare(channel)` the first time `key` is asked for by this process, within
        `publish_timeout`, or PublishError (asked again next time)."""
        if key in self._declared:
            return
        await self.declare(key, declare)
        self._declared.add(key)

    def forget(self, key: str) -> None:
        """`declare_once(key, …)` declares again: what it declared was deleted."""
        self._declared.discard(key)

    async def declare(
        self, key: str, declare: Callable[[AbstractChannel], Awaitable[None]]
    ) -> None:
        """`declare(channel)` now, on a channel of its own (a refused declaration closes the
        channel it was made on), within `publish_timeout`, or PublishError naming `key`."""
        try:
            async with asyncio.timeout(self.publish_timeout):
                channel = await self.channel()
                try:
                    await declare(channel)
                finally:
                    if not channel.is_closed:
                        await channel.close()
        except Exception as exc:
            raise PublishError(f"{key} not declared: {exc!r}") from None

    async def ready_messages(self, name: str) -> int | None:
        """The messages ready in that queue (None: no such queue), within `publish_timeout`
        (else TimeoutError), asked on one channel kept for it (`topology.QueueProbe`): the
        loops that ask every few seconds open no channel each time."""
        async with asyncio.timeout(self.publish_timeout):
            return await self._probe.ready_messages(await self.connect(), name)

    async def queue_exists(self, name: str) -> bool:
        return await self.ready_messages(name) is not None

    async def takes_publishes(self) -> bool:
        """Whether the broker confirms a publish now. A memory or disk alarm leaves every
        connection up and blocks its publishes: the workers' results wait in their dispatchers
        meanwhile, which the watchdog must know. The probe goes to a queue name no client can
        declare (`amq.` is the broker's): returned unroutable, it is answered and kept nowhere.
        Not connected: False at once (the connection is the start's and aio-pika's to make,
        not a probe's under its timeout)."""
        if not self.connected:
            return False
        try:
            await self.publish(_PROBE, PROBE_ROUTING_KEY)
        except QueueMissing:
            return True
        except PublishError:
            return False
        return True

    async def publish(self, message: WireMessage, routing_key: str, exchange: str = "") -> None:
        """Confirmed within `publish_timeout` in all, connecting included, or PublishError.
        To a queue by name, or with `exchange` to that exchange (e.g. a service's cancels)."""
        target = exchange or routing_key
        try:
            async with asyncio.timeout(self.publish_timeout):
                await self._publish(message, routing_key, exchange)
        except TimeoutError:  # _publish turns every error of its own into PublishError
            raise PublishTimeout(f"publish to {target} not confirmed in time") from None

    async def _publish(self, message: WireMessage, routing_key: str, exchange: str = "") -> None:
        if not self.connected:
            try:
                await self.connect()
            except Exception as exc:
                raise PublishError(f"broker unavailable: {exc.__class__.__name__}") from None
        channel = self._broadcasting if exchange else self._publishing
        assert channel is not None
        try:
            await channel.publish(to_amqp(message), routing_key, exchange)
        except aiormq.exceptions.PublishError:  # returned: only a mandatory one, to a queue
            raise QueueMissing(f"publish to {routing_key} returned: no such queue") from None
        except aiormq.exceptions.ChannelNotFoundEntity:
            raise ExchangeMissing(f"publish to {exchange}: no such exchange") from None
        except Exception as exc:
            target = exchange or routing_key
            raise PublishError(f"publish to {target} not confirmed: {exc!r}") from None

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
            self._publishing = None
            self._broadcasting = None
