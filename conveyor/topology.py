"""RabbitMQ topology of a service (SPEC §6.1), declared the same way by everyone.

* `<q>-in`: durable quorum queue; `x-delivery-limit` bounds crash redeliveries,
  after which the broker dead-letters the submission to `<q>-dlq`, at least once: by
  default a quorum queue dead-letters at most once, and a submission dead-lettered while
  `-dlq` cannot take it (no leader yet after a restart, or absent) would be dropped, its
  task PENDING until its time to live. At least once, the broker keeps it and tries again
  (every `dead_letter_worker_publisher_confirm_timeout`, 3 min by default). RabbitMQ
  requires `x-overflow: reject-publish` for it; with no length limit it refuses nothing.
* `<q>-out`: durable quorum queue of task events, drained by the gateways.
* `<q>-dlq`: durable quorum queue the gateway drains into FAILURE rows.
* `<q>-control`: a fanout exchange of cancels (SPEC §11.1); each dispatcher binds an
  exclusive, auto-delete queue of its own, so every dispatcher hears every cancel.
* `<q>-cancels`: a stream bound to `<q>-control`, declared with the service's first cancel.
  A dispatcher started later (scaled from zero, a Job, a restart) reads it from
  CANCEL_MEMORY_SECONDS ago before it takes any submission, so it knows the cancels it was not
  there to hear; a fanout drops what no queue is bound to.

Quorum queues on one node too (SPEC §11.7): on a cluster no single node holds a
service's submissions, results or dead letters alone, and a single node grows into
a cluster unchanged. A queue's type and arguments cannot change in place: `conveyor admin
migrate-queues` moves an older installation's queues to the ones declared here.

Legacy services keep plain durable queues: the seed's workers declare `-in` and
`-out` with `durable: true` and nothing else, and RabbitMQ would refuse them with
PRECONDITION_FAILED otherwise. On a cluster their `-out` lives on one node.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.events import MessageFormat

if TYPE_CHECKING:
    import aio_pika


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def check_name(value: str) -> str:
    """The rule of every service, queue name and id, in a platform file, on the command line
    and in a dispatcher's CONVEYOR_QUEUE alike: it goes into URLs, queue names and Basic auth
    (which splits at the first ':'). Whole: `$` let a trailing newline through."""
    if not _NAME.fullmatch(value):
        raise ValueError(
            "use 1 to 100 letters, digits, '.', '_' or '-', the first a letter or digit"
        )
    return value


def in_queue(queue_name: str) -> str:
    return f"{queue_name}-in"


def out_queue(queue_name: str) -> str:
    return f"{queue_name}-out"


def dead_letter_queue(queue_name: str) -> str:
    return f"{queue_name}-dlq"


def control_exchange(queue_name: str) -> str:
    return f"{queue_name}-control"


def cancel_log(queue_name: str) -> str:
    return f"{queue_name}-cancels"


def queue_name_of(queue: str) -> str:
    """The service's queue name, from the name of one of its queues."""
    for suffix in ("-in", "-out", "-dlq"):
        if queue.endswith(suffix):
            return queue[: -len(suffix)]
    raise ValueError(f"{queue} is not a service queue")


@dataclass(frozen=True, slots=True)
class QueueSpec:
    name: str
    arguments: dict[str, Any]


QUORUM: dict[str, Any] = {"x-queue-type": "quorum"}
# A cancel is a few hundred bytes: small segments let a day's retention drop old ones, and
# the size cap bounds the disk a flood of cancels can take.
CANCEL_LOG: dict[str, Any] = {
    "x-queue-type": "stream",
    "x-max-age": "1D",  # the dispatchers' default CANCEL_MEMORY_SECONDS
    "x-stream-max-segment-size-bytes": 1_000_000,
    "x-max-length-bytes": 100_000_000,
}


def service_queues(
    queue_name: str, message_format: MessageFormat, delivery_limit: int
) -> list[QueueSpec]:
    if message_format is MessageFormat.LEGACY:
        return [
            QueueSpec(dead_letter_queue(queue_name), {}),
            QueueSpec(in_queue(queue_name), {}),
            QueueSpec(out_queue(queue_name), {}),
        ]
    in_args = {
        **QUORUM,
        "x-delivery-limit": delivery_limit,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": dead_letter_queue(queue_name),
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }
    return [
        QueueSpec(dead_letter_queue(queue_name), QUORUM),
        QueueSpec(in_queue(queue_name), in_args),
        QueueSpec(out_queue(queue_name), QUORUM),
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
    if message_format is MessageFormat.CLOUDEVENTS:  # legacy workers hear no cancel
        await declare_control(channel, queue_name)


async def queue_exists(channel: aio_pika.abc.AbstractChannel, name: str) -> bool:
    """Whether the broker holds a queue of that name (`ready_messages`)."""
    return await ready_messages(channel, name) is not None


async def ready_messages(channel: aio_pika.abc.AbstractChannel, name: str) -> int | None:
    """The messages ready in that queue (delivered to no one yet), or None when the broker
    holds no such queue; asked on `channel` (passively, and never re-declared by a robust
    channel's restore). Only the broker's NOT_FOUND says None, and it closes `channel`; any
    other error raises, so that a queue that may well exist is never taken for a lost one."""
    import aio_pika

    queue: aio_pika.abc.AbstractQueue
    try:
        if isinstance(channel, aio_pika.abc.AbstractRobustChannel):
            queue = await channel.declare_queue(name, passive=True, robust=False)
        else:
            queue = await channel.declare_queue(name, passive=True)
    except aio_pika.exceptions.ChannelNotFoundEntity:
        return None
    declared = queue.declaration_result
    return int(declared.message_count or 0)


class QueueProbe:
    """One channel kept for passive questions about queues (`ready_messages`), opened again
    only after a NOT_FOUND closed it: aio-pika 10.2.1 keeps ~4 KB on its connection for every
    channel ever opened there, and the gateway's queue check and service figures and an idle
    dispatcher ask every few seconds. One question at a time: the NOT_FOUND that answers one
    closes the channel under every other in flight, which then failed or read "no such
    queue" for a queue that exists."""

    def __init__(self) -> None:
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._asking = asyncio.Lock()
        self._abandoned: set[asyncio.Future[Any]] = set()

    async def ready_messages(
        self, connection: aio_pika.abc.AbstractConnection, name: str
    ) -> int | None:
        async with self._asking:
            if self._channel is None or self._channel.is_closed:
                self._channel = await connection.channel(publisher_confirms=False)
            channel = self._channel
            question = asyncio.ensure_future(ready_messages(channel, name))
            try:
                return await asyncio.shield(question)
            except asyncio.CancelledError:
                self._abandon(channel, question)
                raise

    def _abandon(
        self, channel: aio_pika.abc.AbstractChannel, question: asyncio.Future[int | None]
    ) -> None:
        """A question its caller gave up on (a timeout) is left to end on its channel, then
        the channel is closed; the next question opens another. Cancelled halfway, aiormq
        closed the channel under the next question, which failed; and a question that does
        not end (a frozen node) would hold every later one for as long as it lasts."""
        if self._channel is channel:
            self._channel = None
        self._abandoned.add(question)

        def ended(_: asyncio.Future[int | None]) -> None:
            self._abandoned.discard(question)
            if not question.cancelled():
                question.exception()  # whatever it was, nobody waits for it
            closing = asyncio.ensure_future(channel.close())
            self._abandoned.add(closing)
            closing.add_done_callback(self._closed)

        question.add_done_callback(ended)

    def _closed(self, closing: asyncio.Future[Any]) -> None:
        self._abandoned.discard(closing)
        if not closing.cancelled():
            closing.exception()  # the connection may be gone already: so is the channel


async def declare_control(channel: aio_pika.abc.AbstractChannel, queue_name: str) -> Any:
    """The service's cancel exchange (idempotent); returns it."""
    import aio_pika

    return await channel.declare_exchange(
        control_exchange(queue_name), aio_pika.ExchangeType.FANOUT, durable=True
    )


async def declare_cancel_log(channel: aio_pika.abc.AbstractChannel, queue_name: str) -> None:
    """The service's cancel exchange and the stream that keeps what it broadcast (idempotent)."""
    exchange = await declare_control(channel, queue_name)
    log = await channel.declare_queue(cancel_log(queue_name), durable=True, arguments=CANCEL_LOG)
    await log.bind(exchange)
