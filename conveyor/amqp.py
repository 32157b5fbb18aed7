"""WireMessage <-> aio-pika, written once: what every publisher sends and every consumer
reads is the same AMQP message (persistent, with its id, headers and expiration)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.events import WireMessage

if TYPE_CHECKING:
    import aio_pika
    from aio_pika.abc import AbstractIncomingMessage


def to_amqp(wire: WireMessage) -> aio_pika.Message:
    import aio_pika  # the dispatcher's and the gateway's dependency, not the contract's

    return aio_pika.Message(
        body=wire.body,
        headers=wire.headers or None,
        content_type=wire.content_type,
        message_id=wire.message_id,
        expiration=wire.expiration,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )


def from_amqp(message: AbstractIncomingMessage) -> WireMessage:
    return WireMessage(
        body=message.body,
        headers=dict(message.headers or {}),
        content_type=message.content_type,
        message_id=message.message_id,
    )
