"""RabbitMQ topology of a service (SPEC §6.1), declared the same way by everyone.

* `<q>-in`: durable quorum queue; `x-delivery-limit` bounds crash redeliveries,
  after which the broker dead-letters the submission to `<q>-dlq`.
* `<q>-out`: durable classic queue with no arguments, so that the seed's own
  workers, which declare it `durable: true` and nothing else, are accepted.
* `<q>-dlq`: durable classic queue the gateway drains into FAILURE rows.

Legacy services keep `-in` a plain durable queue too: the seed's JS worker
declares it with no arguments and RabbitMQ would refuse it with
PRECONDITION_FAILED otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.events import MessageFormat

if TYPE_CHECKING:
    import aio_pika


def in_queue(queue_name: str) -> str:
    return f"{queue_name}-in"


def out_queue(queue_name: str) -> str:
    return f"{queue_name}-out"


def dead_letter_queue(queue_name: str) -> str:
    return f"{queue_name}-dlq"


@dataclass(frozen=True, slots=True)
class QueueSpec:
    name: str
    arguments: dict[str, Any]


def service_queues(
    queue_name: str, message_format: MessageFormat, delivery_limit: int
) -> list[QueueSpec]:
    if message_format is MessageFormat.LEGACY:
        in_args: dict[str, Any] = {}
    else:
        in_args = {
            "x-queue-type": "quorum",
            "x-delivery-limit": delivery_limit,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": dead_letter_queue(queue_name),
        }
    return [
        QueueSpec(dead_letter_queue(queue_name), {}),
        QueueSpec(in_queue(queue_name), in_args),
        QueueSpec(out_queue(queue_name), {}),
    ]


async def declare_service(
    channel: aio_pika.abc.AbstractChannel,
    queue_name: str,
    message_format: MessageFormat,
    delivery_limit: int,
) -> None:
    """Idempotent: re-declaring with the same arguments changes nothing."""
    for spec in service_queues(queue_name, message_format, delivery_limit):
        await channel.declare_queue(spec.name, durable=True, arguments=spec.arguments or None)
