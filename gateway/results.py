"""Reads every service's `-out` (task events) and `-dlq` (dead-lettered submissions).

Events are applied in small batches, one transaction per batch, and acked only
after the commit: the ack follows durability, and a crash in between only
replays events that the state machine ignores the second time.

Every message ends, and no service can stop another's:

* a message that cannot be understood is stored in `poison_messages` (the
  operator's view, in SQL), counted, and acked;
* a batch the database refuses is applied one message at a time;
* a terminal event set aside, because the database refuses it (a response
  PostgreSQL cannot store) or because it cannot be read whole (a response nested
  deeper than a parser goes) while its task still can, fails that task with the
  reason, so the task ends and its callback goes out;
* an unreachable database is waited for (the batch is retried, never dropped);
* the results held in memory (received, not applied yet) weigh at most `memory` (one result
  alone may weigh more): a queue whose next result would go past it is no longer consumed,
  that result handed back unread, until half of it is free; then consumed again with a
  prefetch its largest result fits in; a new consumer starts with a small prefetch, raised
  once its results prove small (`_pace_queues`);
* each service's queues are declared and consumed on their own: one whose
  queues were declared with other arguments is reported (`broken()`, /readyz,
  metrics) and its existing queues are still consumed; one the broker does not let this
  gateway consume (ACCESS_REFUSED) is reported and left out until it may;
* no consumer is aio-pika's to restore: after a reconnection a fresh channel subscribes
  every service again;
* a service given another queue name or message format is consumed as it now is,
  and the result queues it left are still consumed while they exist; submissions
  still waiting in the `-in` it left go to its new one, where its dispatchers are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import aiormq.exceptions
import psycopg
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustQueue,
)
from psycopg.types.json import Jsonb
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    retry_if_exception,
    wait_exponential,
)

from conveyor import headers as h
from conveyor import logs, storable, topology, tracing
from conveyor.amqp import from_amqp
from conveyor.connection import TRANSPORT_ERRORS, close_quietly
from conveyor.events import (
    MessageFormat,
    Submission,
    WireError,
    WireMessage,
    decode_event,
    decode_submission,
    encode_submission,
    is_cloudevent,
)
from gateway import catalog, lifecycle, metrics, schema, supervisor
from gateway.broker import Broker
from gateway.hearing import Hearing
from gateway.pgpool import CONNECTION_ERRORS, Pool, server_timeout

log = logging.getLogger("conveyor.gateway.results")

POISON_BODY_LIMIT = 64 * 1024
BATCH_SIZE = 200
PREFETCH = BATCH_SIZE * 2  # per consumer, once its results are known to be small enough
# A result queue's new consumer (a start, a subscription, a reconnection) is given one result
# until it is known how large they are: a gateway started on backlogs of many services takes
# one result of each at first, not 400.
START_PREFETCH = 1
BATCH_WINDOW = 0.005
# What a batch's messages may weigh together; a heavier message is applied alone. A dozen
# answers of a few MiB (within the dispatcher's MAX_RESPONSE_BYTES) took the database longer
# than CONVEYOR_DB_TIMEOUT as one batch: cut off, handed back and taken again, for ever, the
# results of every service waiting behind them (found by a black-box test).
BATCH_BYTES = 1024 * 1024
REPLACED_KEPT = 8  # channels a reconnection may reopen: those it found, a few at most
DEAD_LETTERED = "dead_lettered"  # the kind of a -dlq message, beside the events' kinds
POISON = "poison"  # the kind of a message that asks for nothing

# The broker counts every return of a submission to `-in` (a worker that crashed with it,
# and a connection that dropped under a healthy dispatcher alike) and dead-letters it at
# `x-delivery-limit`. Crashes happen during attempts, and every attempt is announced
# (`started`) as its call begins; a message waiting in a dispatcher's prefetch when its
# broker node went away never started one, and an attempt a shutdown handed back
# (`requeued`) ended without a crash. So when the workers started fewer other attempts than
# the limit, some returns were the infrastructure's, not crashes: the submission goes back
# to `-in` as a new message, at most MAX_RETURNS times (a lost `started` cannot loop forever).
MAX_RETURNS = 3

# How long a results statement waits for a row lock: a batch that meets a locked task is then
# applied one result at a time, each waiting less, and the locked task's result goes back to
# the queue; the others are applied (found by a black-box test: one task row held by a
# `SELECT … FOR UPDATE` stalled every replica's results for as long as it was held).
_LOCK_WAIT = "SELECT set_config('lock_timeout', %(ms)s || 'ms', true)"
TOGETHER_LOCK_WAIT_MS = 2000
ALONE_LOCK_WAIT_MS = 200
# The rows of the tasks a transaction is about to change, locked first, in one order (the
# ORDER BY's: the ids come in any order). Each statement after it reads them as another
# replica's transaction left them: a statement that waited for a row another replica held
# judged it by what it had read before the wait, and an attempt handed back there while its
# `started` waited was recorded nowhere.
_LOCK_TASKS = "SELECT 1 FROM tasks WHERE task_id = ANY(%(ids)s) ORDER BY task_id FOR UPDATE"


def lock_waits(use_timeout: float) -> tuple[int, int]:
    """The waits (ms, together and alone) for a pool lending connections `use_timeout` s: at
    most half the server's statement timeout, so the lock's error comes first (a
    CONVEYOR_DB_TIMEOUT of 3 s ends statements at 1.5 s, before a 2 s lock wait: the batch
    was retried whole, every result waiting for the lock, found by a black-box test)."""
    together = min(TOGETHER_LOCK_WAIT_MS, int(server_timeout(use_timeout) * 500))
    return max(together, 1), max(min(ALONE_LOCK_WAIT_MS, together // 10), 1)


# How long a batch may wait for the database before this replica lets go of the results it
# holds (`ResultConsumer._release`); a blip (a failover: ~1 s) is retried in place.
RELEASE_AFTER = 5.0

_ATTEMPTS = """
    SELECT t.task_id, (SELECT count(*) FROM task_attempts a
                        WHERE a.task_id = t.task_id AND a.outcome IS DISTINCT FROM 'requeued')
      FROM tasks t
     WHERE t.task_id = ANY(%(ids)s) AND t.status IN ('PENDING', 'IN_PROGRESS')
    """

# Where an unfinished task's submission goes now: its service's queue and format as they are.
_WHERE_NOW = """
    SELECT t.task_id, s.name, s.queue_name, s.message_format, t.expires_at
      FROM tasks t JOIN services s ON s.name = t.service
     WHERE t.task_id = ANY(%(ids)s) AND t.status IN ('PENDING', 'IN_PROGRESS')
    """

_POISON = """
    INSERT INTO poison_messages (queue, reason, headers, body, body_size)
    VALUES (%(queue)s, %(reason)s, %(headers)s, %(body)s, %(body_size)s)
    """


@dataclass(frozen=True, slots=True)
class Delivery:
    queue: str
    dead_lettered: bool
    message: AbstractIncomingMessage
    left_behind: bool = False  # a submission in the `-in` its service moved away from
    channel: int = 0  # which results channel it came on (ResultConsumer._generation)

    def wire(self) -> WireMessage:
        return from_amqp(self.message)


class Poison(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Plan:
    """What one message asks for: a transition, counted under the message's kind; or to be
    set aside (kept in `poison_messages`), saying why; or both: a terminal event set aside
    still ends its task, FAILURE with the reason, rather than IN_PROGRESS until the watchdog."""

    kind: str
    change: lifecycle.Transition | None
    aside: str | None = None


Consumer = tuple[AbstractQueue, str]  # a queue, and the tag this gateway consumes it with


@dataclass(slots=True)
class _Pace:
    """A service's result queue as this gateway consumes it: with which prefetch, what it
    gave since (how many results, the largest), whether it waits for room."""

    queue: AbstractQueue
    tag: str
    dead: bool
    prefetch: int
    seen: int = 0
    largest: int = 0
    paused: bool = False
    # Its consumer cancelled to be made again with another prefetch, and not made yet.
    cancelled: bool = False


@dataclass(frozen=True, slots=True)
class Subscription:
    """A service's result queues as consumed: declared for this queue name and format."""

    queue_name: str
    message_format: MessageFormat

    def serves(self, service: catalog.Service) -> bool:
        return (self.queue_name, self.message_format) == (
            service.queue_name,
            service.message_format,
        )


# A refresh takes this long at most. A black-box sweep saw both gateways stop consuming every
# result queue for good after a RabbitMQ cut (once, not reproduced): the connection was back,
# and from then on not one line of log, not even the failed refresh's each second, as if a
# refresh waited on the client library for ever. Cut, it is a failed pass (named in /readyz
# under `failing`) and the next one starts from a fresh channel.
REFRESH_LIMIT = 60.0

# How long a consumer's making or cancelling may take: aio-pika's robust channel waits, before
# each, for the channel to be restored, and a channel closed meanwhile (replaced by a refresh)
# is never restored. A pace raising a prefetch on the channel a refresh had just replaced
# waited for good, holding `_pacing`: no result was applied again, and every refresh after it
# stalled (found in CI: a queueName changed while results flowed).
CONSUMER_LIMIT = 10.0
# After a failed refresh, the next one waits at least this long, woken or not.
FAILED_PAUSE = 1.0


class RefreshStalled(Exception):
    """A refresh of the subscriptions did not end within REFRESH_LIMIT."""


# How much a queue's prefetch grows at most from one pace to the next (a slow start).
GROWTH = 4


def _time_to_release(state: RetryCallState) -> bool:
    """RELEASE_AFTER of refusals, the last one not a statement the server gave up on (its
    statement_timeout: a slow database, which another replica would find as slow)."""
    error = state.outcome.exception() if state.outcome else None
    slow = isinstance(error, psycopg.errors.QueryCanceled)
    return (state.seconds_since_start or 0.0) >= RELEASE_AFTER and not slow


def _locked(exc: BaseException) -> bool:
    """A statement gave up waiting for a row lock (`lock_timeout`): another transaction holds
    the task (an operator's `SELECT … FOR UPDATE`), not the database away."""
    return isinstance(exc, psycopg.errors.LockNotAvailable)


def _transient(exc: BaseException) -> bool:
    """Database unreachable (retry the whole batch) rather than a refused statement; or its
    schema older than the code (a `conveyor db downgrade` under a running gateway, a
    roll-back's first step): no message is at fault, and each `started` set aside as poison
    left its task PENDING while it ran (found by a black-box sweep)."""
    return isinstance(exc, (*CONNECTION_ERRORS, *schema.MISSING))


class ResultConsumer:
    def __init__(
        self,
        pool: Pool,
        broker: Broker,
        delivery_limit: int,
        refresh_interval: float = 5.0,
        on_finished: Callable[[], None] = lambda: None,
        hearing: Hearing | None = None,
        on_missing_in: Callable[[dict[str, MessageFormat]], Awaitable[None]] | None = None,
        memory: int = 64 * 1024 * 1024,
    ) -> None:
        self.pool = pool  # raw psycopg: events are applied pipelined
        self.hearing = hearing or Hearing(lambda: True)  # told when results cannot be written
        self.broker = broker
        self.delivery_limit = delivery_limit
        self.refresh_interval = refresh_interval
        self.on_finished = on_finished
        self._on_missing_in = on_missing_in or _nothing_to_restore
        self._inbox: asyncio.Queue[Delivery] = asyncio.Queue()
        self._next: Delivery | None = None  # taken from the inbox, too heavy for the last batch
        self._channel: AbstractRobustChannel | None = None
        # Channels replaced by a fresh one, closed, yet closed again should a reconnection
        # reopen them: aio-pika's restore resets a close that lands while it reopens.
        self._replaced: deque[AbstractRobustChannel] = deque(maxlen=REPLACED_KEPT)
        self._subscribed: dict[str, Subscription] = {}  # service -> its result queues
        # Queue names services moved away from -> consumers of the result queues left there.
        self._retired: dict[str, list[Consumer]] = {}
        # The results channel in use: a delivery of an earlier one is left to the broker, which
        # gave it again on this one when the earlier one closed. A channel is replaced only
        # between batches (`_applying`), so a batch is never acked on a closing channel.
        self._generation = 0
        self._applying = asyncio.Lock()
        self._broken: dict[str, str] = {}  # service -> why its topology could not be declared
        self._released = False  # results handed back for the database (`_release`)
        self._releases = 0  # how many times
        self._held: list[Delivery] = []  # the batch's results whose task row was locked
        # The tasks the batch being applied ended, with their traces (tracing on only).
        self._ended: list[tuple[uuid.UUID, lifecycle.Finished]] = []
        # RabbitMQ limits a consumer's unacked messages by count only: 150 results of 4 MB
        # queued while no gateway ran held 694 MB of the next one at once, over its 512Mi
        # limit, and a gateway killed for it met the same backlog again (found by a black-box
        # test). The bytes of the results received and not applied yet stay within `memory`.
        self._memory = memory
        self._holding = 0
        self._pace: dict[str, _Pace] = {}  # each service's result queue as it is consumed
        # Services whose result queues this gateway may not consume (ACCESS_REFUSED), and why:
        # left out of the results channel, whose consumers a refusal would all end.
        self._refused: dict[str, str] = {}
        # The results channel reopened (a reconnection, a channel error) without its consumers,
        # which are never aio-pika's to restore: the next refresh, woken at once, replaces it.
        self._emptied = False
        self._wake = asyncio.Event()
        self._qos = asyncio.Lock()  # a prefetch set for one consumer is no one else's
        self._pacing = asyncio.Lock()

    def broken(self) -> dict[str, str]:
        """Services whose queues could not be declared as this gateway would, or consumed,
        and why."""
        return dict(self._broken)

    # -- subscriptions -----------------------------------------------------

    async def subscriptions_loop(self) -> None:
        """A refresh every `refresh_interval`, and at once when the results channel must be
        replaced (`_empty`: a reconnection), a second after the last one if it failed (a
        failure does not spin, and the reconnection it waited for is met within a second)."""
        while True:
            limit = asyncio.timeout(REFRESH_LIMIT)
            failed = False
            try:
                async with limit:
                    await self.refresh()
                supervisor.pass_succeeded()
            except Exception as exc:
                failed = True
                error: Exception = exc
                if limit.expired():
                    error = RefreshStalled(f"a refresh did not end within {REFRESH_LIMIT:g} s")
                    await self._let_go()
                supervisor.pass_failed(error)
                log.warning(
                    "could not refresh subscriptions", extra={"error": logs.describe(error)}
                )
            if failed:
                await asyncio.sleep(min(FAILED_PAUSE, self.refresh_interval))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.refresh_interval)
            self._wake.clear()

    async def _let_go(self) -> None:
        """A refresh cut for good measure lets the results channel go: the next one starts
        from a fresh channel, with nothing of what the stalled one left half done."""
        try:
            async with asyncio.timeout(REFRESH_LIMIT), self._applying:
                await self._replace_channel(None)
        except TimeoutError:
            log.warning("the results channel could not be let go: a batch is being applied")

    async def refresh(self) -> None:
        await self._close_reopened()
        releases = self._releases  # a release after the read below: the read proves nothing
        async with self.pool.connection() as conn:
            services = {s.name: s for s in await catalog.all_services(conn)}
            moved = await catalog.moved_queues(conn)
            behind = await schema.problem(conn)
        if behind is not None:
            # A schema older than this code's (a downgrade under a running gateway): no result
            # is taken until it is back. Taken, the terminal events it could apply went through
            # while their `started` went back to the broker, and the previous release's
            # gateways then dropped those `started` (a sweep of a roll-back: 30 tasks without
            # an attempt); and a released replica took them again once this read answered.
            if not self._released:
                async with self._applying:
                    await self._stop_taking()
                log.warning("results left to the broker until the schema is back: " + behind)
            return
        stale = {
            name: subscription
            for name, subscription in self._subscribed.items()
            if name not in services or not subscription.serves(services[name])
        }
        if self._channel is None or self._channel.is_closed or stale or self._emptied:
            # A fresh channel, on which every service is subscribed again (its queues declared
            # again first: a broker that crashed may have lost them); unacked results go back
            # to their queues.
            async with self._applying:
                if self._releases != releases:
                    return  # the next refresh reads the database again first
                # The broker's channels are robust (`connect_robust`).
                fresh = cast(
                    AbstractRobustChannel, await self.broker.channel(prefetch=START_PREFETCH)
                )
                fresh.reopen_callbacks.add(self._reopened)
                await self._replace_channel(fresh)
                if self._released:  # the database answered the catalog's read above
                    self._released = False
                    self.hearing.heard()
                    log.info("database available again; consuming results")
        for name in set(self._broken) - set(services):
            del self._broken[name]
        for name in set(self._refused) - set(services):
            del self._refused[name]
        if (channel := self._channel) is None:
            return  # released meanwhile: the next refresh opens one
        await self._pace_queues()  # if the loop applying results could not (a reconnection)
        await self._notice_cancelled(channel)
        unsubscribed = [s for s in services.values() if s.name not in self._subscribed]
        await self._restore_lost(unsubscribed)
        for service in unsubscribed:
            if service.name in self._refused and not await self._may_consume(service):
                continue
            if not await self._subscribe(channel, service):
                return  # the refusal closed the channel: a fresh one at once, without it
        await self._consume_retired(channel, {s.queue_name for s in services.values()}, moved)

    async def _notice_cancelled(self, channel: AbstractRobustChannel) -> None:
        """A consumer the broker cancelled (its queue deleted) is not made again by aio-pika
        (none of ours is robust): the channel is replaced at once, and the fresh one declares
        the service's queues again and consumes them (found by a sweep: `-out` deleted, and
        the service's results waited there until a restart). Under `_pacing`: a consumer being
        made again with another prefetch is not live for a moment, and is not lost."""
        async with self._pacing:
            live = await _consumer_tags(channel)
            lost = [
                name
                for name, pace in self._pace.items()
                if not pace.paused and not pace.cancelled and pace.tag not in live
            ]
        if lost:
            log.warning("the broker cancelled a results consumer", extra={"queue": lost[0]})
            self._empty()

    def _empty(self) -> None:
        """The results channel is to be replaced by the next refresh, which runs at once."""
        self._emptied = True
        self._wake.set()

    async def _replace_channel(self, fresh: AbstractRobustChannel | None) -> None:
        """The results channel replaced (None: none until the next refresh), its consumers
        with it. The old one is closed for good (`_close_reopened`). Under `_applying`: never
        under a batch."""
        old, self._channel = self._channel, fresh
        self._generation += 1
        self._emptied = False
        self._subscribed.clear()
        self._pace.clear()  # the fresh channel's subscriptions consume them again
        self._retired = {queue_name: [] for queue_name in self._retired}
        if old is not None:
            self._replaced.append(old)
            await close_quietly(old)

    async def _close_reopened(self) -> None:
        """A replaced channel the reconnection reopened anyway would stay open for nothing
        (consuming nothing: its consumers were not robust), never closed: closed again."""
        for channel in self._replaced:
            if not channel.is_closed:
                log.warning("a replaced results channel was reopened by a reconnection; closed")
                metrics.REPLACED_CHANNELS_REOPENED.inc()
                await close_quietly(channel)

    async def _subscribe(self, channel: AbstractRobustChannel, service: catalog.Service) -> bool:
        """Declares the service's queues on a channel of their own (a refused declaration
        closes the channel it was made on), then consumes its `-out` and `-dlq` if they
        exist, whatever their arguments. False if the broker refused to let this gateway
        consume them (`_refuse`): the channel closed with the refusal."""
        missing = await self._declare(service)
        broken = service.name in self._broken
        specs = {
            spec.name: spec
            for spec in topology.service_queues(
                service.queue_name, service.message_format, self.delivery_limit
            )
        }
        consumed = False
        for name, dead in _result_queues(service.queue_name):
            if name in missing:
                continue
            # Not robust: aio-pika restores a channel with every consumer or none, so one the
            # broker refused after a reconnection (a permission narrowed on one service) failed
            # the whole connection's restore, every second, and every service stalled (found
            # by a sweep). The refresh after a reconnection subscribes each service again.
            try:
                if broken:
                    queue = await channel.declare_queue(name, passive=True, robust=False)
                else:
                    arguments = specs[name].arguments or None
                    queue = await channel.declare_queue(
                        name, durable=True, arguments=arguments, robust=False
                    )
                await self._consume(queue, dead, START_PREFETCH)
                consumed = True
            except aiormq.exceptions.ChannelAccessRefused as exc:
                self._refuse(service, exc)
                return False
        if consumed:
            self._subscribed[service.name] = Subscription(
                service.queue_name, service.message_format
            )
            log.info("consuming results", extra={"service": service.name})
        return True

    def _refuse(self, service: catalog.Service, refusal: Exception) -> None:
        """The broker refused this gateway one of the service's result queues: the service is
        reported (`broken()`) and left out of the results channel until `_may_consume`."""
        reason = str(refusal)[:300] or refusal.__class__.__name__
        if self._refused.get(service.name) != reason:
            log.error(
                "results of a service may not be consumed; the others go on",
                extra={"service": service.name, "error": reason},
            )
        self._refused[service.name] = self._broken[service.name] = reason
        self._empty()

    async def _may_consume(self, service: catalog.Service) -> bool:
        """Whether the broker now lets this gateway consume the service's result queues, tried
        on a channel of its own (a refusal closes it): a consumer made and closed with it,
        what it was given handed back. Any other error is the subscription's to meet."""
        channel = cast(AbstractRobustChannel, await self.broker.channel(prefetch=1))
        try:
            for name, _ in _result_queues(service.queue_name):
                queue = await channel.declare_queue(name, passive=True, robust=False)
                consuming = cast(AbstractRobustQueue, queue).consume(_leave_unacked, robust=False)
                await asyncio.wait_for(consuming, CONSUMER_LIMIT)
        except aiormq.exceptions.ChannelAccessRefused:
            return False
        except Exception as exc:
            log.debug("results probe", extra={"error": logs.describe(exc)})
        finally:
            await close_quietly(channel)
        del self._refused[service.name]
        self._broken.pop(service.name, None)
        log.info("results of a service may be consumed again", extra={"service": service.name})
        return True

    async def _consume_retired(
        self, channel: AbstractRobustChannel, in_use: set[str], moved: set[str]
    ) -> None:
        """Consumes the result queues of the queue names services moved away from (the
        database records each move), as long as they exist: the old queue's dispatchers still
        finish their tasks and report there, whether or not this gateway saw the move. Their
        `-in` too: what still waits there is moved on to the service's queue (`_move_on`).

        Declared passively and not robustly: aio-pika declares a robust queue again after a
        reconnection, and as soon as the broker cancels its consumer (the queue was deleted),
        so the operator could never delete it. A consumer either of these ended is made again
        while its queue exists; a name with neither queue left is forgotten, for every
        gateway."""
        for queue_name in moved - in_use:
            self._retired.setdefault(queue_name, [])
        live = await _consumer_tags(channel)
        for queue_name, consumers in list(self._retired.items()):
            consumers = [(queue, tag) for queue, tag in consumers if tag in live]
            if queue_name in in_use or queue_name not in moved:
                # a service's again (consumed as that service's), or forgotten by a replica
                self._retired.pop(queue_name, None)  # or by `_stop_retired` meanwhile
                for queue, tag in consumers:
                    await queue.cancel(tag)
                continue
            consumed = {queue.name for queue, _ in consumers}
            left = [(topology.in_queue(queue_name), False, True)]
            for name, dead, left_behind in [(*q, False) for q in _result_queues(queue_name)] + left:
                if name not in consumed and await self.broker.queue_exists(name):
                    queue = await channel.declare_queue(name, passive=True, robust=False)
                    receiver = self._receiver(name, dead, left_behind)
                    tag = await self._consumed(queue, receiver, PREFETCH)
                    consumers.append((queue, tag))
                    log.info("consuming a queue left by its service", extra={"queue": name})
            if consumers:
                self._retired[queue_name] = consumers
            else:
                self._retired.pop(queue_name, None)
                async with self.pool.connection() as conn:
                    await catalog.forget_moved(conn, queue_name)
                log.info("queues left by their service are gone", extra={"queue": queue_name})

    async def _restore_lost(self, services: list[catalog.Service]) -> None:
        """Before subscribing (which declares `-in`), the services whose `-in` is missing go
        to `on_missing_in`: if it was deleted, the tasks whose messages went with it must be
        published again, and a queue declared again here would hide that it ever went. A
        queue that cannot be looked at is left to the subscription; one that does not answer
        (a frozen node, the connection lost) ends the looking: a probe each, one after the
        other, would hold every subscription a timeout per service."""
        missing: dict[str, MessageFormat] = {}
        for service in services:
            try:
                exists = await self.broker.queue_exists(topology.in_queue(service.queue_name))
            except Exception as exc:
                log.warning(
                    "a service's queue could not be looked for",
                    extra={"service": service.name, "error": logs.describe(exc)},
                )
                if isinstance(exc, TRANSPORT_ERRORS):
                    break
                continue
            if not exists:
                missing[service.queue_name] = service.message_format
        if missing:
            await self._on_missing_in(missing)

    async def _declare(self, service: catalog.Service) -> set[str]:
        """The service's topology; on a refusal, which of its result queues do not exist.
        Only the broker's refusal of the declaration (a channel error) marks the service: a
        connection lost meanwhile fails the refresh, which runs again once reconnected."""
        channel = await self.broker.channel()
        try:
            await topology.declare_service(
                channel, service.queue_name, service.message_format, self.delivery_limit
            )
            self._broken.pop(service.name, None)
            return set()
        except aiormq.exceptions.AMQPChannelError as exc:
            reason = str(exc)[:300] or exc.__class__.__name__
            if self._broken.get(service.name) != reason:
                metrics.child(metrics.BROKEN_TOPOLOGY, service.name).inc()
                log.error(
                    "queues of a service declared with other arguments; consuming as they are"
                    " (`conveyor admin migrate-queues` gives them this version's)",
                    extra={"service": service.name, "error": reason},
                )
            self._broken[service.name] = reason
        finally:
            await close_quietly(channel)
        names = [name for name, _ in _result_queues(service.queue_name)]
        return {name for name in names if not await self.broker.queue_exists(name)}

    def _receiver(
        self, queue: str, dead: bool, left_behind: bool = False
    ) -> Callable[[AbstractIncomingMessage], Any]:
        channel = self._generation

        async def receive(message: AbstractIncomingMessage) -> None:
            size = len(message.body)
            if queue in self._pace:
                pace = self._pace[queue]
                pace.seen += 1
                pace.largest = max(pace.largest, size)
                if pace.paused or (self._holding and self._holding + size > self._memory):
                    await self._make_room(queue, pace, message)
                    return
            self._holding += size
            await self._inbox.put(Delivery(queue, dead, message, left_behind, channel))

        return receive

    async def _consume(self, queue: AbstractQueue, dead: bool, prefetch: int) -> Consumer:
        """A service's result queue consumed with `prefetch`, paced from now on (unless its
        channel was replaced meanwhile: the fresh one's subscriptions pace their own)."""
        generation = self._generation
        tag = await self._consumed(queue, self._receiver(queue.name, dead), prefetch)
        if self._generation == generation:
            self._pace[queue.name] = _Pace(queue, tag, dead, prefetch)
        return queue, tag

    async def _consumed(
        self,
        queue: AbstractQueue,
        receiver: Callable[[AbstractIncomingMessage], Any],
        prefetch: int,
    ) -> str:
        """`queue` consumed with a prefetch of its own (RabbitMQ gives a consumer the
        channel's as it was when it began), and not robustly: the refresh after a reconnection
        makes it again (`_subscribe`)."""
        channel = queue.channel
        async with self._qos:
            await asyncio.wait_for(channel.set_qos(prefetch_count=prefetch), CONSUMER_LIMIT)
            try:
                consuming = cast(AbstractRobustQueue, queue).consume(receiver, robust=False)
                return await asyncio.wait_for(consuming, CONSUMER_LIMIT)
            finally:
                if not channel.is_closed:  # a refusal closed it: that is what is raised
                    await asyncio.wait_for(
                        channel.set_qos(prefetch_count=START_PREFETCH), CONSUMER_LIMIT
                    )

    async def _make_room(self, name: str, pace: _Pace, message: AbstractIncomingMessage) -> None:
        """`message` would take the results held past `memory`: handed back unread, and its
        queue no longer consumed until `_pace_queues` finds room.

        The hand-back first, before anything is awaited: its frame is then written before any
        later ack, whose `multiple` would otherwise cover it (found by a black-box sweep: with
        the consumer's cancel awaited first, a batch was acked up to a later delivery tag
        meanwhile, this one included: acked unapplied, its task PENDING for good, and the late
        nack closed the channel). What the broker gives back before the cancel lands is
        handed back as it comes."""
        await _settle(message.nack, requeue=True)
        metrics.RESULTS_DEFERRED.inc()
        if not pace.paused:
            pace.paused = True
            log.info(
                "results held weigh CONVEYOR_RESULTS_MEMORY: a queue waits",
                extra={"queue": name, "held_bytes": self._holding},
            )
            await self._cancel(pace)

    async def _pace_queues(self) -> None:
        """After each batch (and each refresh, should a reconnection have stopped it), each
        service's result queue consumed with the prefetch its results fit in: half of `memory`
        at the largest result it gave since it was last consumed. A paused queue is consumed
        again once half of `memory` is free; one that gave as many results as its prefetch,
        all small enough, with a larger prefetch (a new consumer starts low: its results'
        size is not known yet)."""
        channel = self._channel
        if channel is None or channel.is_closed:
            return  # a fresh channel (the next refresh) consumes every queue again
        async with self._pacing:  # the loop applying results, or a refresh: one at a time
            await self._pace_each()

    async def _pace_each(self) -> None:
        generation = self._generation
        for pace in list(self._pace.values()):
            if self._generation != generation:
                return  # the channel replaced meanwhile, its paces with it: the fresh one's own
            fits = max(1, min(PREFETCH, (self._memory // 2) // max(1, pace.largest)))
            if not pace.paused:
                # Four times at most: from 1 to 400 on one small result, a queue whose next
                # ones were large came in whole but the room's worth, handed back and given
                # again, 20 to 40 times a result (found by a black-box sweep).
                fits = min(fits, GROWTH * pace.prefetch)
            if pace.paused:
                if self._holding > self._memory // 2:
                    continue
            elif pace.cancelled:
                pass  # its new consumer could not be made: made now
            elif pace.seen < pace.prefetch or fits <= pace.prefetch:
                continue
            else:
                await self._cancel(pace)
                # Not consumed until the new consumer is made: should that fail, the next
                # batch or refresh makes it. It failed on a queue deleted meanwhile, and the
                # channel aio-pika reopened restored no consumer it had been told was cancelled:
                # the queue was never consumed again (found by a sweep).
                pace.cancelled = True
                if self._generation != generation:
                    return
            try:
                await self._consume(pace.queue, pace.dead, fits)  # its new pace replaces this one
            except Exception as exc:  # the connection lost: the next batch or refresh tries
                log.warning("a result queue not consumed yet", extra={"error": logs.describe(exc)})
                return

    def _reopened(self, channel: object, *_: object) -> None:
        """The results channel reopened (a reconnection, or a channel error) consumes nothing:
        replaced at once by a fresh one that subscribes every service again."""
        if channel is self._channel:
            self._empty()

    async def _cancel(self, pace: _Pace) -> None:
        try:
            await asyncio.wait_for(pace.queue.cancel(pace.tag), CONSUMER_LIMIT)
        except Exception as exc:  # a channel closed meanwhile took the consumer with it
            log.debug("consumer not cancelled", extra={"error": logs.describe(exc)})

    # -- batches -----------------------------------------------------------

    async def apply_loop(self) -> None:
        while True:
            batch = await self._next_batch()
            try:
                await self.process(batch)
            finally:
                self._holding -= sum(len(delivery.message.body) for delivery in batch)
            await self._pace_queues()

    async def _next_batch(self) -> list[Delivery]:
        """What has arrived, after one short pause for stragglers when it is not much: up
        to BATCH_SIZE messages and BATCH_BYTES of them (the first one whatever its size)."""
        first, self._next = self._next, None
        batch = [first or await self._inbox.get()]
        self._take_arrived(batch)
        if len(batch) < BATCH_SIZE and self._next is None:
            await asyncio.sleep(BATCH_WINDOW)
            self._take_arrived(batch)
        return batch

    def _take_arrived(self, batch: list[Delivery]) -> None:
        weight = sum(len(d.message.body) for d in batch)
        while self._next is None and len(batch) < BATCH_SIZE and not self._inbox.empty():
            delivery = self._inbox.get_nowait()
            weight += len(delivery.message.body)
            if weight > BATCH_BYTES:
                self._next = delivery  # the next batch's first: arrived after this one's
                return
            batch.append(delivery)

    async def process(self, batch: list[Delivery]) -> None:
        """Applies a batch, waiting out database outages, then acks it. Never raises: a
        batch that fails for an unexpected reason is handed back to the broker. What came on
        a replaced or closed channel is skipped: the broker gives it again on the current one
        (applied and moved on from there, a left-behind submission is published to its new
        queue once, unless its channel closes while the batch is applied)."""
        async with self._applying:
            current = [d for d in batch if d.channel == self._generation and _open(d.message)]
            if current:
                await self._process(current)

    async def _process(self, batch: list[Delivery]) -> None:
        given_back: set[int] = set()  # published again already: not twice on a retry
        started = time.time_ns()
        self._ended.clear()
        try:
            retrying = AsyncRetrying(
                retry=retry_if_exception(_transient),
                wait=wait_exponential(multiplier=0.5, max=10.0),
                stop=_time_to_release,
                before_sleep=self._unavailable,
            )
            async for attempt in retrying:
                with attempt:
                    self._held = []
                    given_back |= await self._move_on(
                        [d for d in batch if d.left_behind and id(d) not in given_back]
                    )
                    given_back |= await self._give_back(
                        [d for d in batch if id(d) not in given_back]
                    )
                    callbacks = await self._apply([d for d in batch if id(d) not in given_back])
        except RetryError as failed:
            await self._release(batch, given_back, failed.last_attempt.exception())
            return
        except Exception:
            log.exception("batch not applied; handed back", extra={"size": len(batch)})
            metrics.BATCHES_HANDED_BACK.inc()
            for delivery in batch:
                await _settle(delivery.message.nack, requeue=True)
            return
        applied = time.time_ns()
        self.hearing.heard()
        held = {id(delivery) for delivery in self._held}
        for delivery in self._held:  # back to the queue, to be applied once its row is free
            await _settle(delivery.message.nack, requeue=True)
        if held:
            metrics.RESULTS_HELD.inc(len(held))
            log.warning("results of locked tasks put back to wait", extra={"count": len(held)})
        for message in last_per_channel([d for d in batch if id(d) not in held]):
            await _settle(message.ack, multiple=True)
        if self._ended:
            self._trace_results(started, applied)
        if callbacks:
            self.on_finished()

    async def _release(
        self, batch: list[Delivery], given_back: set[int], error: BaseException | None
    ) -> None:
        """The database has refused this batch for RELEASE_AFTER: every result this replica
        holds goes back to the broker (its channel closed) for the replicas that can write
        them, and none is taken until a refresh reads the database again. Held instead, they
        would be silence to the other replicas' watchdogs, which would fail tasks whose
        results were waiting here (found by a black-box test: a replica's database link
        stalled for 70 s). What was published again already is acked, not published twice."""
        for delivery in batch:
            if id(delivery) in given_back:
                await _settle(delivery.message.ack)
        await self._stop_taking()
        metrics.RESULTS_RELEASED.inc()
        log.warning(
            "database unavailable; results handed back to the broker until it answers",
            extra={"size": len(batch), "error": logs.describe(error)},
        )

    async def _stop_taking(self) -> None:
        """Every result held goes back to the broker (the channel closed), and none is taken
        until a refresh finds the database answering with this code's schema."""
        self.hearing.lost()  # the watchdog waits: the results wait in the broker
        self._released = True
        self._releases += 1
        await self._replace_channel(None)

    def _unavailable(self, state: RetryCallState) -> None:
        self.hearing.lost()  # the watchdog waits: what silence there is proves nothing
        log.warning(
            "database unavailable; batch retried",
            extra={"error": logs.describe(state.outcome.exception() if state.outcome else None)},
        )

    def _note(self, change: lifecycle.Transition, outcome: lifecycle.Outcome) -> None:
        finished = outcome.finished
        if tracing.enabled and finished is not None and finished.traceparent:
            self._ended.append((change.task_id, finished))

    def _trace_results(self, started: int, applied: int) -> None:
        """A `result` span per task the batch ended, in the task's trace (the terminal
        statement returned it): the batch's time, as the batch is what applied it."""
        ended, self._ended = self._ended, []
        for task_id, finished in ended:
            attributes = {"conveyor.task_id": str(task_id), "conveyor.status": finished.status}
            tracing.record("result", finished.traceparent, started, applied, attributes, "consumer")

    async def _move_on(self, batch: list[Delivery]) -> set[int]:
        """Submissions left in the `-in` of a queue name their service moved away from: no
        dispatcher of the service consumes it any longer, so each unfinished task's goes to
        the queue the service has now, in its format, expiring with its task and with its
        deliveries counted (X-Conveyor-Attempt goes on from them). A finished task's and a
        deleted service's are dropped: nothing would ever run them. An unreadable one is
        set aside in `poison_messages`, as on the other queues."""
        left: dict[uuid.UUID, tuple[Delivery, Submission]] = {}
        unreadable: list[tuple[Delivery, str]] = []
        for delivery in batch:
            try:
                submission = decode_submission(delivery.wire())
                left[uuid.UUID(submission.task_id)] = (delivery, submission)
            except (WireError, ValueError) as exc:
                unreadable.append((delivery, f"unreadable submission: {exc}"))
        if left or unreadable:
            async with self.pool.connection() as conn:
                for delivery, reason in unreadable:
                    await _set_aside(conn, delivery, reason)
                cursor = await conn.execute(_WHERE_NOW, {"ids": list(left)})
                rows = await cursor.fetchall()
            for task_id, service, queue_name, message_format, expires_at in rows:
                delivery, submission = left[task_id]
                now = replace(
                    submission,
                    service=service,
                    message_format=MessageFormat(message_format),
                    expires_at=expires_at,
                )
                await self.broker.publish(
                    _counted_deliveries(encode_submission(now), delivery.message),
                    topology.in_queue(queue_name),
                )
                log.info(
                    "submission moved to its service's queue",
                    extra={"task_id": str(task_id), "queue": queue_name},
                )
                if topology.in_queue(queue_name) == delivery.queue:
                    await self._stop_retired(queue_name)
        return {id(delivery) for delivery in batch}

    async def _stop_retired(self, queue_name: str) -> None:
        """A service moved back to a queue name it had left: its `-in` is the service's own
        again, and until the next refresh said so, each submission taken there as left behind
        was "moved" into it and taken again (136 times in 2.4 s for one). Its consumers as a
        queue left behind end now; the next refresh consumes the rest as the service's."""
        for queue, tag in self._retired.pop(queue_name, []):
            try:
                await queue.cancel(tag)
            except Exception as exc:  # a channel closed meanwhile took the consumer with it
                log.debug("consumer not cancelled", extra={"error": logs.describe(exc)})

    async def _give_back(self, batch: list[Delivery]) -> set[int]:
        """Dead letters the broker returned without a crash, published to `-in` again."""
        candidates: dict[uuid.UUID, Delivery] = {}
        for delivery in batch:
            headers = dict(delivery.message.headers or {})
            if not delivery.dead_lettered or _death_reason(headers) != "delivery_limit":
                continue
            if _count(headers.get(h.RETURNS)) >= MAX_RETURNS:
                continue
            try:
                candidates[uuid.UUID(decode_submission(delivery.wire()).task_id)] = delivery
            except Exception:
                continue  # poison: _plan says why
        if not candidates:
            return set()
        async with self.pool.connection() as conn:
            cursor = await conn.execute(_ATTEMPTS, {"ids": list(candidates)})
            attempts = dict(await cursor.fetchall())
        given: set[int] = set()
        for task_id, delivery in candidates.items():
            started = attempts.get(task_id)
            if started is None or started >= self.delivery_limit:
                continue  # finished already, or its workers crashed: FAILURE as usual
            queue = topology.in_queue(topology.queue_name_of(delivery.queue))
            await self.broker.publish(_returned(delivery.wire(), self.delivery_limit), queue)
            metrics.RETURNED.inc()
            log.info(
                "submission returned by the broker, not by crashes: published again",
                extra={"task_id": str(task_id), "attempts_started": started},
            )
            given.add(id(delivery))
        return given

    async def _apply(self, batch: list[Delivery]) -> bool:
        try:
            return await self._apply_together(batch)
        except Exception as exc:
            if _transient(exc) and not _locked(exc):
                raise
            return await self._apply_alone(batch)

    async def _apply_together(self, batch: list[Delivery]) -> bool:
        """The batch in one transaction and one round trip (`Pool.batch()`): the
        statements are sent back to back and their answers read after the commit. The
        terminal events of tasks the batch mentions once share one statement
        (`lifecycle.Finishes`); the others keep their own, in the batch's order."""
        planned = [self._plan(d) for d in batch]
        kinds = {id(plan.change): plan.kind for plan in planned if plan.change is not None}
        changes = [plan.change for plan in planned if plan.change is not None]
        finishes = lifecycle.Finishes(lifecycle.together(changes))
        shared = {id(change) for change in finishes.changes}
        sent: list[tuple[lifecycle.Transition, psycopg.AsyncCursor[Any], str]] = []
        async with self.pool.batch() as conn:
            await conn.execute(_LOCK_WAIT, {"ms": lock_waits(self.pool.use_timeout)[0]})
            await conn.execute(_LOCK_TASKS, {"ids": list({c.task_id for c in changes})})
            for delivery, plan in zip(batch, planned, strict=True):
                if plan.aside is not None:
                    await _set_aside(conn, delivery, plan.aside)
                if (change := plan.change) is not None and id(change) not in shared:
                    sent.append((change, await conn.execute(change.sql, change.params), plan.kind))
            many = await conn.execute(finishes.sql, finishes.params) if shared else None
        callbacks = False
        for change, cursor, kind in sent:
            outcome = change.outcome(await cursor.fetchone())
            self._note(change, outcome)
            callbacks |= _counted(kind, outcome)
        if many is not None:
            outcomes = finishes.outcomes(await many.fetchall())
            for change, outcome in zip(finishes.changes, outcomes, strict=True):
                self._note(change, outcome)
                callbacks |= _counted(kinds[id(change)], outcome)
        return callbacks

    async def _apply_alone(self, batch: list[Delivery]) -> bool:
        """One message at a time, after the database refused the batch as a whole; one it
        still refuses is set aside, saying so (`_refused`)."""
        callbacks = False
        for delivery in batch:
            plan = self._plan(delivery)
            try:
                callbacks |= await self._apply_one(delivery, plan)
            except Exception as exc:
                if _locked(exc):  # its row is locked (a long transaction): it waits, alone
                    self._held.append(delivery)
                    continue
                if _transient(exc):
                    raise
                callbacks |= await self._apply_one(delivery, _refused(plan, exc))
        return callbacks

    async def _apply_one(self, delivery: Delivery, plan: Plan) -> bool:
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute(_LOCK_WAIT, {"ms": lock_waits(self.pool.use_timeout)[1]})
            if plan.aside is not None:
                await _set_aside(conn, delivery, plan.aside)
            if plan.change is None:
                return False
            await conn.execute(_LOCK_TASKS, {"ids": [plan.change.task_id]})
            outcome = await lifecycle.apply(conn, plan.change)
        self._note(plan.change, outcome)
        return _counted(plan.kind, outcome)

    def _plan(self, delivery: Delivery) -> Plan:
        """The transition a message asks for, or why it is poison (and the task that ends
        FAILURE for it, when it was a terminal event whose task can still be read)."""
        # Whatever a message asks applies only to a task of a service that has (or had)
        # the queue name it came from: a worker cannot end another service's task.
        queue = topology.queue_name_of(delivery.queue)
        try:
            if delivery.dead_lettered:
                return Plan(DEAD_LETTERED, self._dead_lettered(delivery, queue))
            event = decode_event(delivery.wire())
            return Plan(event.kind.value, lifecycle.transition(event, queue))
        except Exception as exc:  # whatever a message makes a reader raise, it is set aside
            reason = str(exc) if isinstance(exc, WireError | Poison) else repr(exc)[:200]
            terminal = None if delivery.dead_lettered else _terminal(delivery)
            return _unusable(reason, terminal, queue)

    def _dead_lettered(self, delivery: Delivery, queue: str) -> lifecycle.Transition:
        wire = delivery.wire()
        # What a dispatcher refused a submission for (no attempt allowed, an unreadable
        # expiry) says nothing against finding its task, which fails for it.
        found = {k: v for k, v in wire.headers.items() if k not in _NOT_NEEDED_TO_FIND_A_TASK}
        try:
            submission = decode_submission(replace(wire, headers=found))
        except WireError as exc:
            raise Poison(f"dead-lettered message is not a submission: {exc}") from None
        message = _dead_letter_message(wire.headers, _expiry(wire))
        return lifecycle.failure(uuid.UUID(submission.task_id), message, queue)


_NOT_NEEDED_TO_FIND_A_TASK = (h.CE_MAX_ATTEMPTS, h.CE_EXPIRES)


def _expiry(wire: WireMessage) -> datetime | None:
    """The task's expiry the submission carries, if it can be read."""
    try:
        return decode_submission(wire).expires_at
    except WireError:
        return None


def _unusable(reason: str, terminal: tuple[str, uuid.UUID] | None, queue: str | None) -> Plan:
    """A message set aside for `reason`; a terminal event's (kind, task) still ends the task."""
    if terminal is None:
        return Plan(POISON, None, reason)
    kind, task_id = terminal
    message = f"The function's result could not be stored ({reason})."
    return Plan(kind, lifecycle.failure(task_id, message, queue), reason)


def _refused(plan: Plan, exc: Exception) -> Plan:
    """A message the database refuses alone, set aside instead."""
    reason = f"database refused it: {logs.describe(exc, 240)}"
    change = plan.change
    terminal = (plan.kind, change.task_id) if change and change.terminal else None
    return _unusable(reason, terminal, change.params.get("queue") if change else None)


def _terminal(delivery: Delivery) -> tuple[str, uuid.UUID] | None:
    """The kind and task of a terminal event that cannot be read whole. A CloudEvent names
    them in its attributes (headers), whatever its data; a legacy message in its outer
    fields, read without the deep parts (`_shallow`) that may be what no parser here takes.
    None for any other message."""
    wire = delivery.wire()
    if is_cloudevent(wire.headers):  # its data and its times may be what cannot be read
        unread = (h.CE_TIME, h.CE_STARTED)
        headers = {k: v for k, v in wire.headers.items() if k not in unread}
        wire = replace(wire, body=b"{}", content_type="application/json", headers=headers)
    else:
        wire = replace(wire, body=_shallow(wire.body))
    try:
        event = decode_event(wire)
    except Exception:
        return None
    return (event.kind.value, uuid.UUID(event.task_id)) if event.kind.terminal else None


# What lies before the next run of brackets, skipped whole (a string to its end, or the
# body's: none is read twice), then that run, or the end of the body.
_BRACKETS = re.compile(
    rb'(?:[^"\[\]{}]++|"(?:[^"\\]++|\\.)*+(?:"|\\?\Z))*+([\[{]++|[\]}]++|\Z)', re.DOTALL
)
SHALLOW_DEPTH = 2  # a legacy response is a member of `data`, a member of the message


def _shallow(body: bytes, depth: int = SHALLOW_DEPTH) -> bytes:
    """The JSON document with each value nested `depth` containers deep replaced by null.
    One pass, without recursion, stepping from one run of brackets to the next (those in
    strings are not nesting): about what the parser that refused the body spent on it."""
    parts: list[bytes] = []
    level = start = kept = 0
    for match in _BRACKETS.finditer(body):
        run, at = match.group(1), match.start(1)
        if not run:
            break
        if run[0] in b"[{":
            if level <= depth < level + len(run):  # one of them opens a value that deep
                start = at + depth - level
            level += len(run)
        else:
            closed = level - len(run)
            if closed <= depth < level:  # one of them closes it
                parts += [body[kept:start], b"null"]
                kept = at + level - depth
            level = closed
    parts.append(body[kept:])
    return b"".join(parts)


def _result_queues(queue_name: str) -> list[tuple[str, bool]]:
    """A queue name's `-out` and `-dlq`, each with whether it carries dead letters."""
    return [(topology.out_queue(queue_name), False), (topology.dead_letter_queue(queue_name), True)]


async def _consumer_tags(channel: AbstractChannel) -> set[str]:
    """The consumers the broker still delivers to on the channel: it cancels the consumers
    of a deleted queue, and a channel reopened after a reconnection has none of ours."""
    underlay = await asyncio.wait_for(channel.get_underlay_channel(), CONSUMER_LIMIT)
    return set(cast(aiormq.Channel, underlay).consumers)


def _counted(kind: str, outcome: lifecycle.Outcome) -> bool:
    """Counts the outcome; True when a callback is now due."""
    if kind == DEAD_LETTERED:
        metrics.DEAD_LETTERED.inc()
    else:
        metrics.child(metrics.EVENTS, kind, outcome.applied.value).inc()
    if (done := outcome.finished) is not None:
        metrics.task_finished(done.service, done.status, done.waited, done.ran)
    return outcome.callback_due


def _death_reason(headers: dict[str, Any]) -> str | None:
    """Why the broker dead-lettered a message, from its `x-death` header (or a dispatcher,
    from its own header: crashes past the limit, counted through graceful requeues)."""
    reason = headers.get(h.DEAD_LETTERED) or headers.get("x-first-death-reason")
    deaths = headers.get("x-death")
    for death in deaths if isinstance(deaths, list | tuple) else []:
        if isinstance(death, dict) and death.get("reason") is not None:
            reason = death["reason"]
            break
    if isinstance(reason, bytes):
        reason = reason.decode(errors="replace")
    return None if reason is None else str(reason)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _counted_deliveries(wire: WireMessage, message: AbstractIncomingMessage) -> WireMessage:
    """`wire` carrying the deliveries `message` had used, and its crashes, as a dispatcher
    counts them."""
    headers = dict(message.headers or {})
    returns = _count(headers.get(h.DELIVERY_COUNT))
    if not returns and h.DELIVERY_COUNT not in headers and message.redelivered:
        returns = 1  # a classic queue has no count: its flag says one at least
    used = returns + _count(headers.get(h.REQUEUES))
    crashes = returns + _count(headers.get(h.CRASHES))
    counted = {h.REQUEUES: used} if used else {}
    if crashes:
        counted[h.CRASHES] = crashes
    return replace(wire, headers={**wire.headers, **counted}) if counted else wire


def _returned(wire: WireMessage, delivery_limit: int) -> WireMessage:
    """The submission as a new message: no trace of its death, its deliveries counted.

    The broker dead-letters a message when it comes back once more than `x-delivery-limit`:
    its first delivery and `delivery_limit` redeliveries were used, and the dispatcher numbers
    the next one (X-Conveyor-Attempt) after them all."""
    headers = {
        k: v
        for k, v in wire.headers.items()
        if k not in (*h.DEATH_HEADERS, h.DELIVERY_COUNT, h.CRASHES)  # its returns were no crashes
    }
    headers[h.RETURNS] = _count(headers.get(h.RETURNS)) + 1
    headers[h.REQUEUES] = _count(headers.get(h.REQUEUES)) + delivery_limit + 1
    return WireMessage(wire.body, headers, wire.content_type, wire.message_id)


# How early an `expired` dead letter may come before its task's own expiry and still be
# that expiry's (the message's TTL is counted from its publish, on the broker's clock).
EXPIRY_SLACK = timedelta(minutes=1)
QUEUE_TTL = (
    "The task was dead-lettered by the broker before its time to live: its queue's message TTL"
    " (x-message-ttl, set by a policy) expired it."
)


def _dead_letter_message(headers: dict[str, Any], expires_at: datetime | None = None) -> str:
    """Why the broker gave up on the submission, from its `x-death` header.

    RabbitMQ's dead-lettered copy carries no `x-delivery-count`, and `x-death`'s
    `count` is how many times the message was dead-lettered, not delivered: the
    reason is what can be said reliably. `expired` is the task's time to live only once it
    has passed (`expires_at`, carried by the message): before, a message TTL an operator put
    on the queue ended it, and the task's failure said it stayed PENDING past its time to
    live after less than a second (found by a sweep).
    """
    reason = _death_reason(headers)
    if reason == "delivery_limit":
        return (
            "The task was dead-lettered: its workers crashed or gave it back every time"
            " until its queue's delivery limit (x-delivery-limit) was reached."
        )
    if reason == "rejected":
        return "The task was dead-lettered: its worker rejected the message."
    if reason == "expired":
        early = expires_at is not None and expires_at - EXPIRY_SLACK > datetime.now(UTC)
        return QUEUE_TTL if early else lifecycle.EXPIRED
    return f"The task was dead-lettered by the broker (reason: {str(reason or 'unknown')[:100]})."


def _json_safe_headers(headers: dict[str, Any]) -> dict[str, str]:
    """Kept as text jsonb takes (a NUL in a header's name refused the row, and the message
    was handed back for ever)."""
    return {storable.text(str(k)[:200]): repr(v)[:500] for k, v in list(headers.items())[:50]}


async def _set_aside(conn: psycopg.AsyncConnection[Any], delivery: Delivery, reason: str) -> None:
    body = delivery.message.body or b""
    await conn.execute(
        _POISON,
        {
            "queue": delivery.queue,
            "reason": storable.text(reason[:1000]),
            "headers": Jsonb(_json_safe_headers(dict(delivery.message.headers or {}))),
            "body": body[:POISON_BODY_LIMIT],
            "body_size": len(body),
        },
    )
    kind = "in" if delivery.left_behind else "dlq" if delivery.dead_lettered else "out"
    metrics.child(metrics.POISON, kind).inc()
    log.warning(
        "message set aside",
        extra={"queue": delivery.queue, "reason": reason[:200], "size": len(body)},
    )


def last_per_channel(batch: list[Delivery]) -> list[AbstractIncomingMessage]:
    """The message whose `multiple` ack settles the whole batch on its channel: the one with
    the highest tag. One ack frame per batch instead of one per event. Safe because a batch is
    a prefix of the inbox, which receives each channel's deliveries in tag order, and every
    earlier batch was settled whole: every tag up to that one on the channel is in this
    batch. A channel that closed since (its tags mean nothing now) refuses the ack, as it
    refused each one before."""
    last: dict[int, AbstractIncomingMessage] = {}
    for delivery in batch:
        message = delivery.message
        if not _open(message):
            continue  # closed since (a reconnection): the broker gives its messages again
        key = id(message.channel)
        if key not in last or (message.delivery_tag or 0) > (last[key].delivery_tag or 0):
            last[key] = message
    return list(last.values())


def _open(message: AbstractIncomingMessage) -> bool:
    """Whether the channel `message` came on is still open. Closed since (a reconnection, or
    a channel error: aio-pika reopens the same robust channel), the broker gives the message
    again on the new one: applied (or moved on) now, it would be twice."""
    try:
        message.channel  # noqa: B018 - aio-pika raises for a closed channel
    except aiormq.exceptions.ChannelInvalidStateError:
        return False
    return True


async def _settle(action: Callable[..., Any], **options: Any) -> None:
    try:
        await action(**options)
    except Exception:
        # The channel died since delivery: the broker has already requeued it and will
        # redeliver; applying it again is a no-op.
        log.debug("settling on a closed channel skipped")


async def _nothing_to_restore(missing: dict[str, MessageFormat]) -> None:
    """Without an outbox (tests of the consumer alone): `-in` is declared as it was."""


async def _leave_unacked(message: AbstractIncomingMessage) -> None:
    """A probe's consumer: what it is given goes back to its queue when its channel closes."""
