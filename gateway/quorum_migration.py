"""Moves an older installation's classic `-out` and `-dlq` to quorum queues, losing nothing.

A queue's type cannot change in place. For each queue: its messages go to a quorum
queue `<name>.migrating` (each published with a confirm before it is acked), the
classic queue is deleted only once it is empty, the quorum queue is declared under
the old name and the messages come back. Dispatchers may keep publishing meanwhile:
a message that arrives before the delete is moved too, and the delete is refused
while the queue holds one; in the instant the name is absent their `mandatory`
publish is returned and retried. Gateways, which consume these queues, must be
stopped: the command refuses a queue that has consumers (a consumer's unacked
messages would go with the deleted queue). Run again after a crash, it finishes
the job (`<name>.migrating` is emptied into the quorum queue).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection

from conveyor import topology

log = logging.getLogger("conveyor.gateway.quorum_migration")

ChannelFactory = Callable[[], Awaitable[AbstractChannel]]


class InUse(RuntimeError):
    """A queue still has consumers: stop the gateways first."""


@dataclass
class Moved:
    queue: str
    converted: bool  # False: it was a quorum queue already
    messages: int


def staging_name(name: str) -> str:
    return f"{name}.migrating"


async def migrate_service(connection: AbstractConnection, queue_name: str) -> list[Moved]:
    """The service's `-out` and `-dlq` as quorum queues; a no-op when they already are."""
    return [
        await migrate_queue(connection, name)
        for name in (topology.out_queue(queue_name), topology.dead_letter_queue(queue_name))
    ]


async def migrate_queue(connection: AbstractConnection, name: str) -> Moved:
    staging = staging_name(name)
    moved = 0
    if not await _is_quorum(connection, name):
        consumers = await _consumers(connection, name)
        if consumers:
            raise InUse(f"{name} has {consumers} consumer(s): stop the gateways first")
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        try:
            await channel.declare_queue(staging, durable=True, arguments=topology.QUORUM)
            while True:
                moved += await _move(channel, name, staging)
                source = await channel.get_queue(name, ensure=False)
                try:
                    await source.delete(if_unused=True, if_empty=True)
                    break
                except aio_pika.exceptions.ChannelPreconditionFailed:
                    # A message arrived after the move: the channel is closed; round again.
                    channel = await connection.channel(
                        publisher_confirms=True, on_return_raises=True
                    )
        finally:
            await _close(channel)
        converted = True
    else:
        converted = False
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    try:
        await channel.declare_queue(name, durable=True, arguments=topology.QUORUM)
        if await _exists(connection, staging):
            await channel.declare_queue(staging, durable=True, arguments=topology.QUORUM)
            await _move(channel, staging, name)
            # Nobody else publishes to it, and it is empty now (quorum queues have no if-empty).
            staged = await channel.get_queue(staging, ensure=False)
            await staged.delete(if_unused=False, if_empty=False)
    finally:
        await _close(channel)
    if converted:
        log.info("queue now quorum", extra={"queue": name, "messages": moved})
    return Moved(name, converted, moved)


async def _move(channel: AbstractChannel, source_name: str, target: str) -> int:
    """Every ready message of `source_name` into `target`, each confirmed before its ack."""
    source = await channel.get_queue(source_name, ensure=False)
    moved = 0
    while (message := await source.get(no_ack=False, fail=False)) is not None:
        copy = aio_pika.Message(
            body=message.body,
            headers=message.headers,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            message_id=message.message_id,
            correlation_id=message.correlation_id,
            timestamp=message.timestamp,
            type=message.type,
            app_id=message.app_id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await channel.default_exchange.publish(copy, routing_key=target, mandatory=True)
        await message.ack()
        moved += 1
    return moved


async def _is_quorum(connection: AbstractConnection, name: str) -> bool:
    """Declaring it as quorum is refused (PRECONDITION_FAILED) when it is classic."""
    channel = await connection.channel()
    try:
        await channel.declare_queue(name, durable=True, arguments=topology.QUORUM)
        return True
    except aio_pika.exceptions.ChannelPreconditionFailed:
        return False
    finally:
        await _close(channel)


async def _consumers(connection: AbstractConnection, name: str) -> int:
    channel = await connection.channel()
    try:
        declared = await channel.declare_queue(name, passive=True)
        return int(declared.declaration_result.consumer_count or 0)
    finally:
        await _close(channel)


async def _exists(connection: AbstractConnection, name: str) -> bool:
    channel = await connection.channel()
    try:
        await channel.declare_queue(name, passive=True)
        return True
    except aio_pika.exceptions.ChannelNotFoundEntity:
        return False
    finally:
        await _close(channel)


async def _close(channel: AbstractChannel) -> None:
    if not channel.is_closed:
        await channel.close()
