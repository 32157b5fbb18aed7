"""Reads every service's `-out` (task events) and `-dlq` (dead-lettered submissions).

Events are applied in small batches, one transaction per batch, and acked only
after the commit: the ack follows durability, and a crash in between only
replays events that the state machine ignores the second time. A message that
cannot be understood never blocks its queue: it is stored in `poison_messages`
(the operator's view, in SQL), counted, and acked. A message the database
refuses on its own (e.g. a response PostgreSQL cannot store) is retried alone,
and set aside the same way if it fails alone.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from conveyor import topology
from conveyor.events import WireError, WireMessage, decode_event, decode_submission
from gateway import catalog, lifecycle, metrics
from gateway.broker import Broker

log = logging.getLogger("conveyor.gateway.results")

POISON_BODY_LIMIT = 64 * 1024
BATCH_SIZE = 200
BATCH_WINDOW = 0.005

_POISON = text(
    """
    INSERT INTO poison_messages (queue, reason, headers, body, body_size)
    VALUES (:queue, :reason, :headers, :body, :body_size)
    """
).bindparams(bindparam("headers", type_=JSONB))


@dataclass(frozen=True, slots=True)
class Delivery:
    queue: str
    dead_lettered: bool
    message: AbstractIncomingMessage

    def wire(self) -> WireMessage:
        m = self.message
        return WireMessage(m.body, dict(m.headers or {}), m.content_type, m.message_id)


class Poison(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _transient(exc: BaseException) -> bool:
    """Database unreachable (retry the whole batch) rather than a refused statement."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


class ResultConsumer:
    def __init__(
        self,
        engine: AsyncEngine,
        broker: Broker,
        delivery_limit: int,
        refresh_interval: float = 5.0,
        on_finished: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine
        self.broker = broker
        self.delivery_limit = delivery_limit
        self.refresh_interval = refresh_interval
        self.on_finished = on_finished
        self._inbox: asyncio.Queue[Delivery] = asyncio.Queue()
        self._channel: AbstractChannel | None = None
        self._subscribed: dict[str, list[tuple[AbstractQueue, str]]] = {}  # service -> consumers

    # -- subscriptions -----------------------------------------------------

    async def subscriptions_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:
                log.warning("could not refresh subscriptions", extra={"error": repr(exc)})
            await asyncio.sleep(self.refresh_interval)

    async def refresh(self) -> None:
        async with self.engine.connect() as conn:
            services = {s.name: s for s in await catalog.all_services(conn)}
        if self._channel is None or self._channel.is_closed:
            old, self._channel = self._channel, await self.broker.channel(prefetch=BATCH_SIZE * 2)
            self._subscribed.clear()
            if old is not None:
                # A robust channel comes back with its consumers after a reconnection:
                # closed for good, it cannot double the new channel's.
                await _close_quietly(old)
        for name in set(self._subscribed) - set(services):
            for queue, tag in self._subscribed.pop(name):
                await queue.cancel(tag)
        for service in services.values():
            if service.name not in self._subscribed:
                await self._subscribe(self._channel, service)

    async def _subscribe(self, channel: AbstractChannel, service: catalog.Service) -> None:
        await topology.declare_service(
            channel, service.queue_name, service.message_format, self.delivery_limit
        )
        tags = []
        for name, dead in (
            (topology.out_queue(service.queue_name), False),
            (topology.dead_letter_queue(service.queue_name), True),
        ):
            # The queue object the robust channel registered when declaring it: its consumers
            # are restored with the channel after a reconnection. (`get_queue(ensure=False)`
            # gave an unregistered one: the channel came back without consumers, and every
            # task stayed PENDING or IN_PROGRESS until the gateway restarted.)
            queue = await channel.declare_queue(name, passive=True)
            tags.append((queue, await queue.consume(self._receiver(name, dead))))
        self._subscribed[service.name] = tags
        log.info("consuming results", extra={"service": service.name})

    def _receiver(self, queue: str, dead: bool) -> Callable[[AbstractIncomingMessage], Any]:
        async def receive(message: AbstractIncomingMessage) -> None:
            await self._inbox.put(Delivery(queue, dead, message))

        return receive

    # -- batches -----------------------------------------------------------

    async def apply_loop(self) -> None:
        while True:
            batch = await self._next_batch()
            await self.process(batch)

    async def _next_batch(self) -> list[Delivery]:
        batch = [await self._inbox.get()]
        deadline = asyncio.get_running_loop().time() + BATCH_WINDOW
        while len(batch) < BATCH_SIZE:
            timeout = deadline - asyncio.get_running_loop().time()
            if timeout <= 0 and self._inbox.empty():
                break
            try:
                batch.append(await asyncio.wait_for(self._inbox.get(), max(timeout, 0)))
            except TimeoutError:
                break
        return batch

    async def process(self, batch: list[Delivery]) -> None:
        delay = 0.5
        while True:
            try:
                finished = await self._apply_together(batch)
                break
            except Exception as exc:
                if not _transient(exc):
                    finished = await self._apply_alone(batch)
                    break
                log.warning("database unavailable; batch retried", extra={"error": repr(exc)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        for delivery in batch:
            await _ack(delivery.message)
        if finished:
            self.on_finished()

    async def _apply_together(self, batch: list[Delivery]) -> bool:
        async with self.engine.begin() as conn:
            outcomes = [await self._apply_one(conn, d) for d in batch]
        return lifecycle.Applied.FINISHED in outcomes

    async def _apply_alone(self, batch: list[Delivery]) -> bool:
        finished = False
        for delivery in batch:
            try:
                async with self.engine.begin() as conn:
                    finished |= await self._apply_one(conn, delivery) is lifecycle.Applied.FINISHED
            except Exception as exc:
                if _transient(exc):
                    raise
                async with self.engine.begin() as conn:
                    await _set_aside(
                        conn, delivery, f"database refused it: {exc.__class__.__name__}"
                    )
        return finished

    async def _apply_one(
        self, conn: AsyncConnection, delivery: Delivery
    ) -> lifecycle.Applied | None:
        try:
            if delivery.dead_lettered:
                return await self._dead_lettered(conn, delivery)
            event = decode_event(delivery.wire())
        except (WireError, Poison) as exc:
            await _set_aside(conn, delivery, str(exc))
            return None
        outcome = await lifecycle.apply(conn, event)
        metrics.EVENTS.labels(kind=event.kind.value, outcome=outcome.value).inc()
        return outcome

    async def _dead_lettered(self, conn: AsyncConnection, delivery: Delivery) -> lifecycle.Applied:
        wire = delivery.wire()
        try:
            task_id = decode_submission(wire).task_id
        except WireError as exc:
            raise Poison(f"dead-lettered message is not a submission: {exc}") from None
        metrics.DEAD_LETTERED.inc()
        return await lifecycle.fail(conn, uuid.UUID(task_id), _dead_letter_message(wire.headers))


def _dead_letter_message(headers: dict[str, Any]) -> str:
    """Why the broker gave up on the submission, from its `x-death` header.

    RabbitMQ's dead-lettered copy carries no `x-delivery-count`, and `x-death`'s
    `count` is how many times the message was dead-lettered, not delivered: the
    reason is what can be said reliably.
    """
    reason = headers.get("x-first-death-reason")
    for death in headers.get("x-death") or []:
        if isinstance(death, dict) and death.get("reason") is not None:
            reason = death["reason"]
            break
    if isinstance(reason, bytes):
        reason = reason.decode(errors="replace")
    if reason == "delivery_limit":
        return (
            "The task was dead-lettered: its workers crashed or gave it back every time"
            " until its queue's delivery limit (x-delivery-limit) was reached."
        )
    if reason == "rejected":
        return "The task was dead-lettered: its worker rejected the message."
    if reason == "expired":
        return "The task was dead-lettered: its message expired in the queue."
    return f"The task was dead-lettered by the broker (reason: {str(reason or 'unknown')[:100]})."


def _json_safe_headers(headers: dict[str, Any]) -> dict[str, str]:
    return {str(k)[:200]: repr(v)[:500] for k, v in list(headers.items())[:50]}


async def _set_aside(conn: AsyncConnection, delivery: Delivery, reason: str) -> None:
    body = delivery.message.body or b""
    await conn.execute(
        _POISON,
        {
            "queue": delivery.queue,
            "reason": reason[:1000],
            "headers": _json_safe_headers(dict(delivery.message.headers or {})),
            "body": body[:POISON_BODY_LIMIT],
            "body_size": len(body),
        },
    )
    metrics.POISON.labels(queue_kind="dlq" if delivery.dead_lettered else "out").inc()
    log.warning(
        "message set aside",
        extra={"queue": delivery.queue, "reason": reason[:200], "size": len(body)},
    )


async def _close_quietly(channel: AbstractChannel) -> None:
    try:
        await channel.close()
    except Exception:
        log.debug("closing a stale channel failed")


async def _ack(message: AbstractIncomingMessage) -> None:
    try:
        await message.ack()
    except Exception:
        # The channel died since delivery: the broker has already requeued it and will
        # redeliver; applying it again is a no-op.
        log.debug("ack on a closed channel skipped")
