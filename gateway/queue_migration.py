"""Moves a service's queues to the arguments this version declares, losing nothing.

A queue's type and arguments cannot change in place: 0.1's classic `-out` and `-dlq`
become quorum queues, and an `-in` declared before it dead-lettered at least once (or with
another `DELIVERY_LIMIT`) gets today's arguments. For each queue: its messages go to a
quorum queue `<name>.migrating` (each published with a confirm before it is acked), the
old queue is deleted once it is empty, the new one is declared under the old name and the
messages come back. Run again after a crash, it finishes the job (`<name>.migrating` is
emptied into the new queue).

Who must be stopped: the command refuses a queue that has consumers (a consumer's unacked
messages would go with the deleted queue), so the gateways, which consume `-out` and
`-dlq`, and for `-in` the dispatchers too. Dispatchers may keep publishing to a classic
`-out`: a message that arrives before the delete is moved too, and the delete is refused
while the queue holds one (`if-empty`); in the instant the name is absent their
`mandatory` publish is returned and retried. A quorum queue has no `if-empty` delete, so
`-in` moves only while its publishers, the gateways, are stopped: checked by `-out` having
no consumer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection

from conveyor import topology
from conveyor.events import MessageFormat

log = logging.getLogger("conveyor.gateway.queue_migration")


class InUse(RuntimeError):
    """A queue still has consumers, or `-in` still has publishers: stop them first."""


@dataclass
class Moved:
    queue: str
    state: str  # "declared anew", "move finished" (an interrupted run's), or "up to date"
    messages: int  # brought into the queue as it is now


def staging_name(name: str) -> str:
    return f"{name}.migrating"


Gateways = Callable[[], Awaitable[int]]  # how many gateway processes run (pg_stat_activity)


async def migrate_service(
    connection: AbstractConnection, queue_name: str, delivery_limit: int, gateways: Gateways
) -> list[Moved]:
    """The service's queues with this version's arguments; a no-op when they have them.
    When `-in` must move, nothing moves while a gateway (its publisher) or a dispatcher runs;
    `-in` goes last."""
    specs = {
        spec.name: spec.arguments
        for spec in topology.service_queues(queue_name, MessageFormat.CLOUDEVENTS, delivery_limit)
    }
    out, dead, submissions = (
        topology.out_queue(queue_name),
        topology.dead_letter_queue(queue_name),
        topology.in_queue(queue_name),
    )
    stop = "stop the dispatchers first (scale them to zero, and pause their autoscaling)"

    async def no_gateway() -> None:
        """Asked before anything moves and again just before `-in` is deleted: a gateway,
        one serving the API only included, publishes submissions into it."""
        running = await gateways() or await _consumers(connection, out)
        if running:
            raise InUse(
                f"{running} gateway process(es) still run: stop the gateways first (they"
                f" publish to {submissions})"
            )

    if await _refusal(connection, submissions, specs[submissions]) is not None:
        await no_gateway()
        dispatchers = await _consumers(connection, submissions)
        if dispatchers:
            raise InUse(f"{submissions} has {dispatchers} consumer(s): {stop}")
    return [
        await migrate_queue(connection, out, specs[out], "stop the gateways first"),
        await migrate_queue(connection, dead, specs[dead], "stop the gateways first"),
        await migrate_queue(connection, submissions, specs[submissions], stop, no_gateway),
    ]


async def migrate_left_behind(
    connection: AbstractConnection, queue_name: str, delivery_limit: int, gateways: Gateways
) -> list[Moved]:
    """The queues a service moved away from (`moved_queues`), migrated as its own are: a
    sweep found them left with their old arguments, so that moving the service back was
    refused however often this ran. A queue deleted since is not declared again, and one of
    another type (a legacy service's classic queues) is left as it is."""
    submissions = topology.in_queue(queue_name)
    probe = await connection.channel()
    try:
        if not await topology.queue_exists(probe, submissions):
            return []
    finally:
        await _close(probe)
    arguments = next(
        spec.arguments
        for spec in topology.service_queues(queue_name, MessageFormat.CLOUDEVENTS, delivery_limit)
        if spec.name == submissions
    )
    refusal = await _refusal(connection, submissions, arguments)
    if refusal is not None and "x-queue-type" in refusal:
        return []
    return await migrate_service(connection, queue_name, delivery_limit, gateways)


async def migrate_queue(
    connection: AbstractConnection,
    name: str,
    arguments: dict[str, Any],
    in_use: str,
    before_delete: Callable[[], Awaitable[None]] | None = None,
) -> Moved:
    """`name` declared with `arguments`, its messages kept. `in_use` is what to tell the
    operator when the queue has consumers; `before_delete` may refuse (InUse) at the last
    moment before an unconditional delete."""
    staging = staging_name(name)
    refusal = await _refusal(connection, name, arguments)
    if refusal is not None:
        consumers = await _consumers(connection, name)
        if consumers:
            raise InUse(f"{name} has {consumers} consumer(s): {in_use}")
        await _empty_into(connection, name, staging, refusal, in_use, before_delete)
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    try:
        await channel.declare_queue(name, durable=True, arguments=arguments)
        probe = await connection.channel()
        try:
            staged = await topology.queue_exists(probe, staging)
        finally:
            if not probe.is_closed:
                await probe.close()
        restored = 0
        if staged:
            await channel.declare_queue(staging, durable=True, arguments=topology.QUORUM)
            restored = await _move(channel, staging, name)
            # Nobody else publishes to it, and it is empty now (quorum queues have no if-empty).
            await (await channel.get_queue(staging, ensure=False)).delete(
                if_unused=False, if_empty=False
            )
    finally:
        await _close(channel)
    if refusal is not None:
        log.info("queue declared anew", extra={"queue": name, "messages": restored})
        return Moved(name, "declared anew", restored)
    return Moved(name, "move finished" if staged else "up to date", restored)


async def _empty_into(
    connection: AbstractConnection,
    name: str,
    staging: str,
    refusal: str,
    in_use: str,
    before_delete: Callable[[], Awaitable[None]] | None,
) -> None:
    """Every message of `name` into `staging`, then `name` deleted once empty."""
    classic = "'x-queue-type'" in refusal  # RabbitMQ names the argument that differs
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    try:
        await channel.declare_queue(staging, durable=True, arguments=topology.QUORUM)
        while True:
            await _move(channel, name, staging)
            if classic:
                source = await channel.get_queue(name, ensure=False)
                try:
                    await source.delete(if_unused=True, if_empty=True)
                    return
                except aio_pika.exceptions.ChannelPreconditionFailed:
                    # A message arrived after the move: the channel is closed; round again.
                    channel = await connection.channel(
                        publisher_confirms=True, on_return_raises=True
                    )
            elif await _emptied(connection, name, staging, in_use, before_delete):
                return
    finally:
        await _close(channel)


async def _emptied(
    connection: AbstractConnection,
    name: str,
    staging: str,
    in_use: str,
    before_delete: Callable[[], Awaitable[None]] | None,
) -> bool:
    """Deletes quorum queue `name` if it holds no message and has no consumer (RabbitMQ
    deletes a quorum queue only unconditionally): whether it did. A refusal says where the
    messages moved so far wait."""
    channel = await connection.channel()
    try:
        try:
            if before_delete is not None:
                await before_delete()
            declared = (await channel.declare_queue(name, passive=True)).declaration_result
            if declared.consumer_count:
                raise InUse(f"{name} has {declared.consumer_count} consumer(s): {in_use}")
        except InUse as exc:
            raise InUse(
                f"{exc}; the messages moved so far wait in {staging}: run the command again"
                " once they are stopped, or they are never delivered"
            ) from None
        if declared.message_count:
            return False
        await channel.queue_delete(name)
        return True
    finally:
        await _close(channel)


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
            reply_to=message.reply_to,
            # A submission expires from -in with its task (a relative TTL: it starts again).
            expiration=message.expiration,
            priority=message.priority,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await channel.default_exchange.publish(copy, routing_key=target, mandatory=True)
        await message.ack()
        moved += 1
    return moved


async def _refusal(
    connection: AbstractConnection, name: str, arguments: dict[str, Any]
) -> str | None:
    """RabbitMQ's reason for refusing to declare `name` with `arguments` (PRECONDITION_FAILED:
    it exists with others), or None: it has them, or did not exist and has them now."""
    channel = await connection.channel()
    try:
        await channel.declare_queue(name, durable=True, arguments=arguments)
        return None
    except aio_pika.exceptions.ChannelPreconditionFailed as exc:
        return str(exc)
    finally:
        await _close(channel)


async def _consumers(connection: AbstractConnection, name: str) -> int:
    channel = await connection.channel()
    try:
        declared = await channel.declare_queue(name, passive=True)
        return int(declared.declaration_result.consumer_count or 0)
    finally:
        await _close(channel)


async def _close(channel: AbstractChannel) -> None:
    if not channel.is_closed:
        await channel.close()
