"""Confirmed, persistent publishes: task events to `-out`, graceful requeues to `-in`, and
the dead letters of tasks whose crashes passed their limit through requeues to `-dlq`.

Events go out in the format of the submission they answer: CloudEvents (binary
binding) for CloudEvents submissions, the seed's JSON for legacy ones, so that
a legacy service keeps a legacy `-out`.

Every publish waits for the broker's confirm (and `mandatory` turns an
unroutable message, e.g. a deleted `-out`, into an error rather than a silent
loss). Publishes from concurrent tasks share one channel and are pipelined:
each task awaits only its own confirm. The terminal event is retried through a
reconnection (`publish_reliably`), because the message is acked only once that
event is confirmed; a lost confirm may mean a duplicate event, which the
gateway ignores.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
from aio_pika.abc import DateType
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from conveyor import headers as h
from conveyor.amqp import to_amqp
from conveyor.connection import SILENT_CHANNEL, ConfirmingChannel
from conveyor.events import MessageFormat, TaskEvent, encode_event, expiry_of, expiry_text
from dispatcher.consumer import BROKER_ERRORS, Delivery

log = logging.getLogger(__name__)

_PERSISTENT = aio_pika.DeliveryMode.PERSISTENT
# One attempt of `publish_reliably` waits this long for its confirm: the next attempt then
# finds a channel the broker stopped answering silent, and publishes on a new one.
ATTEMPT = SILENT_CHANNEL + 1.0


class Publisher:
    def __init__(
        self,
        publishing: ConfirmingChannel,
        in_queue: str,
        out_queue: str,
        dead_letter_queue: str,
        service: str,
    ) -> None:
        self.publishing = publishing
        self.in_queue = in_queue
        self.out_queue = out_queue
        self.dead_letter_queue = dead_letter_queue
        self.service = service

    async def publish_event(self, event: TaskEvent, fmt: MessageFormat) -> None:
        """One attempt; raises one of BROKER_ERRORS when it is not confirmed."""
        await self._publish(to_amqp(encode_event(event, self.service, fmt)), self.out_queue)

    async def publish_reliably(self, event: TaskEvent, fmt: MessageFormat, patience: float) -> bool:
        """Retries through reconnections for up to `patience` seconds.

        The first attempt goes straight out: nearly every event is confirmed at once,
        and the retry machinery is built only for the rare one that is not.
        """
        message = to_amqp(encode_event(event, self.service, fmt))
        give_up = time.monotonic() + patience
        about = {"task_id": event.task_id, "kind": event.kind.value}
        try:
            async with asyncio.timeout(min(patience, ATTEMPT)):
                await self._publish(message, self.out_queue)
            return True
        except (TimeoutError, *BROKER_ERRORS) as exc:
            if time.monotonic() >= give_up:
                log.warning("event not confirmed; giving up", extra={**about, "error": repr(exc)})
                return False
        retrying = AsyncRetrying(
            stop=stop_after_delay(give_up - time.monotonic()),
            wait=wait_exponential(multiplier=0.1, max=1.0),
            retry=retry_if_exception_type((TimeoutError, *BROKER_ERRORS)),
            before_sleep=lambda state: log.info(
                "event not confirmed; retrying",
                extra={
                    **about,
                    "error": repr(state.outcome.exception() if state.outcome else None),
                },
            ),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    left = max(0.1, min(give_up - time.monotonic(), ATTEMPT))
                    async with asyncio.timeout(left):
                        await self.publishing.ready()  # through a reconnection under way
                        await self._publish(message, self.out_queue)
        except (TimeoutError, *BROKER_ERRORS) as exc:
            log.warning("event not confirmed; giving up", extra={**about, "error": repr(exc)})
            return False
        return True

    async def republish(self, delivery: Delivery, previous_deliveries: int, renewed: bool) -> None:
        """A copy of the delivered message at the tail of `-in`, counted in headers.

        The broker's own `x-delivery-count` is dropped from the copy (it restarts
        from zero for a new message); what it counted is folded into
        `x-conveyor-requeues`, so X-Conveyor-Attempt keeps increasing, and into
        `x-conveyor-crashes`, so that crashes still end the task at its delivery limit.

        A `renewed` copy lives its time to live again, as its task does (the gateway moves
        the row's expiry with the `requeued` event sent beside it); any other (a message
        handed back uncalled, an attempt whose `started` never went out) keeps its task's
        expiry, which nothing moved: no dispatcher may call the task after the gateway
        expired it.
        """
        original = delivery.message
        headers = {k: v for k, v in (original.headers or {}).items() if k != h.DELIVERY_COUNT}
        headers[h.REQUEUES] = previous_deliveries
        crashes = delivery.crashes()
        if crashes:
            headers[h.CRASHES] = crashes
        ttl = original.expiration  # seconds, as aio-pika decodes it
        expires = expiry_of(headers)
        if renewed and isinstance(ttl, int | float) and expires is not None:
            headers[h.CE_EXPIRES] = expiry_text(datetime.now(UTC) + timedelta(seconds=ttl))
        elif expires is not None:
            ttl = max((expires - datetime.now(UTC)).total_seconds(), 0.001)
        await self._publish(_copy(delivery, headers, ttl), self.in_queue)

    async def dead_letter(self, delivery: Delivery) -> None:
        """The message on `-dlq`, as the broker dead-letters it past `x-delivery-limit`, when
        its crashes passed the limit only counted through graceful requeues (each copy's count
        starts from zero). The gateway judges it as the broker's: FAILURE, or given back when
        no worker's attempt explains the returns."""
        headers = dict(delivery.message.headers or {})
        headers.pop(h.DELIVERY_COUNT, None)
        headers[h.CRASHES] = delivery.crashes()
        headers[h.DEAD_LETTERED] = "delivery_limit"
        await self._publish(_copy(delivery, headers, None), self.dead_letter_queue)

    async def _publish(self, message: aio_pika.Message, routing_key: str) -> None:
        await self.publishing.publish(message, routing_key)


def _copy(delivery: Delivery, headers: dict[str, Any], expiration: DateType) -> aio_pika.Message:
    """The delivered message again, persistent, with `headers` and time to live (seconds)."""
    original = delivery.message
    return aio_pika.Message(
        body=original.body,
        headers=headers,
        content_type=original.content_type,
        content_encoding=original.content_encoding,
        message_id=original.message_id,
        correlation_id=original.correlation_id,
        reply_to=original.reply_to,
        timestamp=original.timestamp,
        type=original.type,
        app_id=original.app_id,
        priority=original.priority,
        expiration=expiration,
        delivery_mode=_PERSISTENT,
    )
