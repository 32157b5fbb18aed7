"""Publishing without losing tasks: the task row is the outbox.

A submission commits its task row with `publish_at` set (when the relay may
publish it), then publishes *after* the commit (nothing is ever published inside
a transaction). The row stops being an outbox entry when `publish_at` goes back
to NULL, which happens in one of three ways:

* the fast path: the API publishes at once and, once the broker confirms,
  queues the row for marking; marks are batched into one statement, made within
  `MARK_AFTER` of the confirm;
* the task's first event: `started`, or a terminal state however reached,
  clears it in the update the state machine makes anyway (`lifecycle`), so most
  tasks are marked at no cost and the fast path's mark finds nothing to do;
* the relay: a background loop that claims rows whose `publish_at` has passed
  (their fast path failed, the gateway died between commit and publish, or a
  run-later task is due), publishes them and marks them. A claim is a lease
  (`publish_at` moves 30 s ahead) taken with `FOR UPDATE SKIP LOCKED`, so several
  gateway replicas never publish the same row at the same time, and a replica that
  dies mid-publish only delays a row until its lease expires. A row whose service
  was deleted is resolved on the spot: its task fails with "Service deleted.".

Only unpublished rows are in the partial index `ix_tasks_unpublished`, so the
claim never reads the history. The fast path's grace (the first `publish_at`) is
longer than a fast-path publish can take (see `GatewaySettings.outbox_grace`), so
the relay does not publish a second copy of a submission whose confirm is merely
slow. A relay pass that publishes nothing (the broker is unreachable) makes the
relay back off, up to `max_backoff`, instead of cycling through the whole backlog
at every row's lease expiry.

A service's `-in` deleted under a running platform (by an operator, or lost with a node)
returns every publish to it (`QueueMissing`). The gateway declares a service's queues when it
subscribes the service, not again, so the publish that finds the queue missing declares the
service's queues again (`_restore`, at most once per service per `REDECLARE_EVERY`) and is
tried once more; the messages that went down with the queue are found from their rows: every
PENDING task of that service already published (and due) is marked unpublished, so the relay
publishes it again. A service that gets no new submission would never find it so: the gateway
also looks for the `-in` of every service with PENDING tasks every `QUEUE_CHECK_INTERVAL`
(`queue_check_loop`), and restores a missing one the same way. So does a gateway about to
subscribe a service whose `-in` is missing while some of its PENDING tasks are marked
published (`restore_lost`): declared as a subscription declares it, at once, the queue would
be there for the next publish and the next check, and the loss found by nobody.

A broker that crashes may lose what it confirmed just before (a RabbitMQ 3.10 node SIGKILLed
seconds after a quorum queue was declared brought it back empty): the rows confirmed in the
last `keep_confirmed` seconds, marked or not, are given back to the relay when the connection
drops (`_distrust_recent`). A gateway that dies loses only its marks not made yet: those of
about the last second.

At worst a task is published twice (confirm received, mark lost; or published again after a
lost `-in` or a dropped connection while its message had already been delivered): delivery
is at-least-once end to end, and the state machine absorbs duplicates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from conveyor import logs, topology, tracing
from conveyor.connection import CONNECTION_ERRORS as BROKER_AWAY
from conveyor.connection import TRANSPORT_ERRORS as BROKER_GONE
from conveyor.events import MessageFormat, Submission, encode_submission
from gateway import lifecycle, metrics, supervisor
from gateway.broker import Broker, PublishError, PublishTimeout, QueueMissing
from gateway.catalog import Service
from gateway.pgpool import CONNECTION_ERRORS as DATABASE_AWAY
from gateway.pgpool import Pool

log = logging.getLogger("conveyor.gateway.outbox")

# The database or the broker away: a pass of `queue_check_loop` fails, the next tries again.
_AWAY: tuple[type[BaseException], ...] = (*DATABASE_AWAY, *BROKER_AWAY)

# Every statement stands alone: run in autocommit, each is its own transaction.
_MARK_PUBLISHED = (
    "UPDATE tasks SET publish_at = NULL WHERE id = ANY(%(ids)s) AND publish_at IS NOT NULL"
)
# A confirmed publish marks its row only if no publish of the row began since (its
# `publish_attempts` unchanged): a row given back to the relay after its queue was lost
# (`_REPUBLISH` counts an attempt) stays unpublished whatever a publish into the lost queue,
# by any replica, marks later.
_MARK_CONFIRMED = """
    UPDATE tasks t SET publish_at = NULL
      FROM unnest(CAST(%(ids)s AS bigint[]), CAST(%(attempts)s AS int[])) AS m(id, attempts)
     WHERE t.id = m.id AND t.publish_attempts = m.attempts AND t.publish_at IS NOT NULL
    """
# Due rows (ix_tasks_unpublished), leased: `publish_at` moves past the lease. Published in
# the order they entered their queue (a run-later task when due), as their places count them:
# RETURNING keeps no order, and 200 tasks due at once ran up to 199 places out of turn.
_CLAIM = """
    WITH claimed AS (
        UPDATE tasks t
           SET publish_at = now() + make_interval(secs => %(lease)s),
               publish_attempts = t.publish_attempts + 1,
               -- the watchdog's wait, from the figures this publish puts in the message
               time_limit = COALESCE((SELECT s.task_timeout * s.max_attempts FROM services s
                                       WHERE s.name = t.service), t.time_limit)
         WHERE t.id IN (SELECT id FROM tasks
                         WHERE publish_at IS NOT NULL AND publish_at <= now()
                         ORDER BY publish_at, id LIMIT %(limit)s
                         FOR UPDATE SKIP LOCKED)
        -- the body as accepted (`jsonb` rewrites numbers: 1e308 in 309 digits), or an older
        -- row's `request`
        RETURNING t.id, t.task_id, t.status, COALESCE(t.request_json, t.request::json) AS request,
                  t.service, t.submission_date,
                  t.not_before, t.traceparent, t.expires_at, t.publish_attempts
    )
    SELECT c.id, c.task_id, c.status, c.request, c.service, s.name IS NULL AS orphan,
           c.publish_attempts,
           s.queue_name, s.message_format, s.max_attempts, s.task_timeout,
           c.submission_date, c.not_before, s.retention_seconds, c.traceparent, c.expires_at
      FROM claimed c LEFT JOIN services s ON s.name = c.service
     ORDER BY COALESCE(c.not_before, c.submission_date), c.id
    """
# A failed publish gives its lease back after a short, growing pause (capped at 10 s): the
# row must not wait out the whole 30 s lease, meant for a relay that died mid-publish.
_NOTE_ERRORS = """
    UPDATE tasks t SET publish_error = f.error,
           publish_at = now() + make_interval(secs => LEAST(t.publish_attempts, 10))
      FROM unnest(CAST(%(ids)s AS bigint[]), CAST(%(errors)s AS text[])) AS f(id, error)
     WHERE t.id = f.id AND t.publish_at IS NOT NULL
    """
# The rows this relay failed that still wait for a publish (neither published nor ended since).
_STILL_UNPUBLISHED = "SELECT id FROM tasks WHERE id = ANY(%(ids)s) AND publish_at IS NOT NULL"
# A service's `-in` was found missing: the messages it held are lost with it. Its tasks still
# PENDING (IN_PROGRESS ones are the watchdog's; ended ones need nothing) that are marked
# published, and those this gateway confirmed before it found the queue missing but has not
# marked yet (`kept`), go back to the relay, an attempt counted so that no mark of an earlier
# publish undoes it (`_MARK_CONFIRMED`). Not every row being published: those confirmed into
# the queue declared again (a new service's first submissions find its queue not declared
# yet) would be published twice. By id, a page at a time (ix_tasks_pending: the service's
# PENDING rows), each statement well within the statement timeout.
_REPUBLISH = """
    WITH lost AS (
        SELECT id FROM tasks
         WHERE service IN (SELECT name FROM services WHERE queue_name = %(queue)s)
           AND status = 'PENDING' AND id > %(after)s
           AND (publish_at IS NULL OR id = ANY(%(kept)s))
         ORDER BY id LIMIT %(page)s
    )
    UPDATE tasks t SET publish_at = now(), publish_attempts = t.publish_attempts + 1
      FROM lost WHERE t.id = lost.id
    RETURNING t.id
    """
REPUBLISH_PAGE = 5000
# The rows confirmed just before the broker connection dropped, still PENDING, marked or not:
# due for the relay now, an attempt counted so that no mark of an earlier publish undoes it.
_DISTRUSTED = """
    UPDATE tasks SET publish_at = now(), publish_attempts = publish_attempts + 1
     WHERE id = ANY(%(ids)s) AND status = 'PENDING'
    """
# A confirmed publish is marked within this time (plus a flush interval), not at once: a task
# taken at once is marked by its `started` at no cost. Its mark used to wait the whole
# `keep_confirmed`: a gateway SIGKILLed within those 5 s lost every mark it held, and behind a
# backlog the relays published those tasks again, each function called twice (found by a
# black-box sweep).
MARK_AFTER = 1.0
# Of these queue names, those of a service with a PENDING task marked published since it last
# moved: a `-in` found missing lost that message. A service's first subscription finds its
# `-in` missing too, and has none (a publish to it would have been returned); so does the
# first subscription after a move, whose earlier tasks wait in the old `-in`, to be moved on.
_LOST_WITH = """
    SELECT s.queue_name FROM services s
     WHERE s.queue_name = ANY(%(queues)s)
       AND EXISTS (
           SELECT 1 FROM tasks t
            WHERE t.service = s.name AND t.status = 'PENDING' AND t.publish_at IS NULL
              AND greatest(t.submission_date, t.not_before) > coalesce(
                  (SELECT max(m.moved_at) FROM moved_queues m WHERE m.service = s.name),
                  '-infinity'))
    """
# The services whose `-in` should hold something: PENDING tasks (the triggers' counts).
_WAITING = """
    SELECT s.queue_name, s.message_format FROM services s
     WHERE (SELECT sum(b.pending) FROM task_backlog b WHERE b.service = s.name) > 0
    """

# A service whose `-in` is missing has its queues declared again at most this often: a storm
# of submissions finding it missing makes one declaration, not one each.
REDECLARE_EVERY = 2.0
# How long a missing `-in` is left missing before it is declared again. RabbitMQ 3.10 tells a
# deleted quorum queue's consumers only if no queue of the same name is declared before their
# channels have handled the deletion: one declared again within ~20 ms (a busy service's next
# submission) kept the dispatchers' consumers attached to it without delivering to them, for
# ever, every check green; 200 ms was enough here.
QUEUE_SETTLE = 1.0
# The failed rows the relay watches at most (`_failed`): a few suffice to tell it still fails.
FAILED_KEPT = 1000


class QueuesNotChecked(Exception):
    """A pass of the queue check could not look for some services' `-in` (queue -> why)."""

    def __init__(self, unchecked: dict[str, str]) -> None:
        names = ", ".join(topology.in_queue(q) for q in sorted(unchecked))
        super().__init__(f"{len(unchecked)} queues not checked: {names}")
        self.unchecked = unchecked


class RelayStalled(Exception):
    """A relay pass claimed rows and published none of them: the broker is unreachable."""


@dataclass(frozen=True, slots=True)
class RelayPass:
    claimed: int
    published: int  # confirmed by the broker, or nothing left to send for the task


def expiry(submitted: datetime, ttl: float, retention: float) -> datetime:
    """When a PENDING task fails, for a row from before migration 0012 that has no expiry of
    its own yet (the reaper's rule for those, `lifecycle._GIVE_EXPIRY`)."""
    return submitted + timedelta(seconds=min(ttl, retention))


def submission_for(
    task_id: Any,
    service: Service,
    body: dict[str, Any],
    expires_at: datetime,
    traceparent: str | None = None,
) -> Submission:
    """A task just accepted, as published on `-in`, expiring when its row says."""
    return Submission(
        task_id=str(task_id),
        service=service.name,
        body=body,
        message_format=service.message_format,
        max_attempts=service.max_attempts,
        timeout=float(service.task_timeout),
        traceparent=traceparent,
        expires_at=expires_at,
    )


class Outbox:
    def __init__(
        self,
        pool: Pool,
        broker: Broker,
        ttl: float,
        delivery_limit: int | None = None,
        interval: float = 1.0,
        batch: int = 200,
        flush_every: float = 0.2,
        max_backoff: float = 5.0,
        keep_confirmed: float = 5.0,
    ) -> None:
        self.pool = pool
        self.broker = broker
        self.ttl = ttl  # the reaper's time to live of a PENDING task
        # Stamped on every CloudEvents submission: `-in`'s x-delivery-limit, for the dispatcher
        # to go on counting crashes through a graceful requeue (conveyor.headers.DELIVERY_LIMIT);
        # a legacy `-in` is a classic queue without a limit.
        self.delivery_limit = delivery_limit
        self.interval = interval
        self.batch = batch
        self.max_backoff = max_backoff
        self.flush_every = flush_every
        # A confirmed row is marked within `MARK_AFTER` (less than the grace: the relay never
        # sees it meanwhile), and remembered for `keep_confirmed` seconds: a broker that
        # crashes within that time may lose what it confirmed (seen with a RabbitMQ 3.10
        # quorum queue declared seconds before a crash of its one node), so when the
        # connection drops, the rows remembered are given back to the relay, which publishes
        # them again. A duplicate is harmless; a lost submission would leave its task PENDING.
        self.keep_confirmed = keep_confirmed
        self.mark_after = min(MARK_AFTER, keep_confirmed)
        # (when confirmed, task row id, its publish_attempts then), oldest first: the ripe
        # ones are a prefix. Those not marked yet; those confirmed within `keep_confirmed`.
        self._unmarked: deque[tuple[float, int, int]] = deque()
        self._recent: deque[tuple[float, int]] = deque()
        # Per queue, until when the fast path leaves its submissions to the relay (`publish_now`),
        # and the queues whose one submission tries it again now.
        self._fast_path_resumes: dict[str, float] = {}
        self._fast_path_trying: set[str] = set()
        # Per queue name, the last declaration after its `-in` was found missing: when it
        # started, and the declaration (under way, or its outcome) (`_restore`).
        self._restores: dict[str, tuple[float, asyncio.Task[bool]]] = {}
        self._background: set[asyncio.Task[None]] = set()
        # Rows this relay failed to publish, as far as it knows still waiting in their backoff:
        # a pass that finds nothing due meanwhile is no success (`_nothing_failed_waits`).
        self._failed: set[int] = set()
        broker.on_reconnect(self._distrust_recent)

    def _distrust_recent(self) -> None:
        """The broker connection dropped: what it confirmed in the last `keep_confirmed`
        seconds is given back to the relay, in the background, whether marked yet or not."""
        self._forget_old(time.monotonic())
        ids = [row_id for _, row_id in self._recent]
        self._unmarked.clear()
        self._recent.clear()
        if ids:
            log.warning(
                "broker connection lost: recently confirmed submissions will be published again",
                extra={"count": len(ids)},
            )
            self._in_background(self._give_back_distrusted(ids))

    async def _give_back_distrusted(self, ids: list[int]) -> None:
        """`_DISTRUSTED`, the database retried until it answers."""
        async for attempt in self._until_answered():
            with attempt:
                async with self.pool.connection() as conn:
                    await conn.execute(_DISTRUSTED, {"ids": ids})

    def _until_answered(self) -> AsyncRetrying:
        """Retries of a statement in the background, however long the database is away."""
        return AsyncRetrying(
            wait=wait_exponential(multiplier=self.interval, max=self.max_backoff),
            retry=retry_if_exception_type(Exception),
        )

    def _note_confirmed(self, rows: list[tuple[int, int]]) -> None:
        """(row id, its publish_attempts when published) of confirmed publishes."""
        at = time.monotonic()
        self._unmarked.extend((at, row_id, attempts) for row_id, attempts in rows)
        if self.keep_confirmed > 0:
            self._recent.extend((at, row_id) for row_id, _ in rows)

    def _forget_old(self, now: float) -> None:
        """Confirms older than `keep_confirmed` are trusted: no dropped connection gives
        their rows back any more."""
        while self._recent and self._recent[0][0] <= now - self.keep_confirmed:
            self._recent.popleft()

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- fast path ---------------------------------------------------------

    async def publish_now(self, row_id: int, submission: Submission, queue_name: str) -> bool:
        """Publishes right after the commit; False leaves the task to the relay.

        A publish to a queue that timed out leaves that queue's next ones to the relay for a
        publish timeout: a broker that takes publishes and confirms none (a memory or disk
        alarm blocks every publishing connection) made each submission wait out the timeout
        for as long as the alarm lasted, where the relay waits in the background. Only that
        queue, and only a timeout: the other services' submissions keep their fast path. Once
        the pause ends, one submission tries it while the others still go to the relay, until
        it is answered: resumed for all at once, every submission in the next timeout waited
        it out (a sweep: a third of them, for as long as an alarm lasted)."""
        if not self.broker.connected:
            return False
        if queue_name in self._fast_path_resumes:
            paused = time.monotonic() < self._fast_path_resumes[queue_name]
            if paused or queue_name in self._fast_path_trying:
                return False
            self._fast_path_trying.add(queue_name)
        try:
            # a missing queue declared again and the publish retried, all within one timeout
            await self._send_or_restore(submission, queue_name, "fast", self.broker.publish_timeout)
        except PublishError as exc:
            if isinstance(exc, PublishTimeout):
                self._fast_path_resumes[queue_name] = time.monotonic() + self.broker.publish_timeout
            log.warning("fast-path publish failed; relay will retry", extra={"error": str(exc)})
            return False
        finally:
            self._fast_path_trying.discard(queue_name)
        self._fast_path_resumes.pop(queue_name, None)
        metrics.child(metrics.PUBLISHED, "fast").inc()
        self._note_confirmed([(row_id, 0)])  # not claimed by a relay: no attempt counted yet
        return True

    async def _send_or_restore(
        self, submission: Submission, queue_name: str, path: str, within: float | None = None
    ) -> None:
        """`_send`; when the queue is missing, the service's queues are declared again
        (`_restore`) and the publish is tried once more, all within `within` seconds if given
        (else PublishError): the fast path must end within the outbox's grace."""
        started = time.monotonic()
        try:
            await self._send(submission, queue_name, path)
        except QueueMissing:
            left = None if within is None else max(0.0, started + within - time.monotonic())
            try:
                async with asyncio.timeout(left):
                    if not await self._restore(queue_name, submission.message_format):
                        raise
                    await self._send(submission, queue_name, path)
            except TimeoutError:
                raise PublishError(f"{queue_name} declared again, not in time") from None

    async def _restore(self, queue_name: str, message_format: MessageFormat) -> bool:
        """Whether the service's queues were declared again just now (or by a declaration
        started less than REDECLARE_EVERY ago): worth publishing once more. One declaration
        at a time per queue, shared by every publish that found it missing, and shielded: a
        caller that gives up (its timeout) does not cut the declaration short."""
        now = time.monotonic()
        last = self._restores.get(queue_name)
        if last is None or (last[1].done() and now - last[0] >= REDECLARE_EVERY):
            last = (now, asyncio.create_task(self._redeclare(queue_name, message_format, now)))
            self._restores[queue_name] = last
        return await asyncio.shield(last[1])

    async def restore_lost(self, missing: dict[str, MessageFormat]) -> None:
        """The queue names whose `-in` the caller found missing and is about to declare (the
        results consumer subscribing a service: at start, after a reconnection, or a service
        another replica made): those that lost messages are restored first, all at once, so
        that their tasks are published again. Declared at once, `-in` would leave the loss
        for nobody to find: the next publish and the queue check see the queue there."""
        started = time.monotonic()
        async with self.pool.connection() as conn:
            rows = await (await conn.execute(_LOST_WITH, {"queues": list(missing)})).fetchall()
        lost = [row.queue_name for row in rows]
        declared = await asyncio.gather(*(self._restore(q, missing[q]) for q in lost))
        for queue_name, again in zip(lost, declared, strict=True):
            if not again:
                # Refused or not in time, the declaration may still have made `-in` (its
                # queues are declared one by one; the broker finishes what it began): the
                # caller's subscription then would, and nothing would find the loss again.
                # The relay's publishes restore a queue still missing.
                self._give_back(queue_name, started)

    async def _redeclare(
        self, queue_name: str, message_format: MessageFormat, started: float
    ) -> bool:
        """The service's queues, declared as the gateway declares them when it subscribes the
        service; then, in the background, its tasks published before `started` are given back
        to the relay (their messages were in the queue that is gone)."""
        limit = self.delivery_limit
        if limit is None and message_format is MessageFormat.CLOUDEVENTS:
            return False  # not as the gateway declares them
        declare = partial(
            topology.declare_service,
            queue_name=queue_name,
            message_format=message_format,
            delivery_limit=limit or 0,
        )
        try:
            await asyncio.sleep(QUEUE_SETTLE)
            await self.broker.declare(topology.in_queue(queue_name), declare)
        except PublishError as exc:
            log.warning(
                "a service's queue is missing and could not be declared again",
                extra={"queue": queue_name, "error": str(exc)},
            )
            return False
        log.warning(
            "a service's queue was missing: declared again; its pending tasks are published again",
            extra={"queue": topology.in_queue(queue_name)},
        )
        self._give_back(queue_name, started)
        return True

    def _give_back(self, queue_name: str, started: float) -> None:
        """The service's tasks published before `started` given back to the relay, in the
        background (`_republish_lost`): their messages were in a queue that is gone."""
        kept = [row_id for at, row_id, _ in self._unmarked if at < started]  # others: marked
        self._in_background(self._republish_lost(queue_name, kept))

    async def _republish_lost(self, queue_name: str, kept: list[int]) -> None:
        """Gives the relay back the service's PENDING tasks whose messages may have been in
        the lost queue, a page at a time, the database retried until it answers: once `-in`
        exists again nothing would find these messages missing any more."""
        after, count = 0, 0
        while True:
            async for attempt in self._until_answered():
                with attempt:
                    async with self.pool.connection() as conn:
                        params = {
                            "queue": queue_name,
                            "kept": kept,
                            "after": after,
                            "page": REPUBLISH_PAGE,
                        }
                        cursor = await conn.execute(_REPUBLISH, params)
                        ids = [row.id for row in await cursor.fetchall()]
            count += len(ids)
            if len(ids) < REPUBLISH_PAGE:
                break
            after = max(ids)
        log.info(
            "tasks published before their queue was lost are published again",
            extra={"queue": topology.in_queue(queue_name), "count": count},
        )

    async def queue_check_loop(self, interval: float) -> None:
        """Every `interval`, `-in` looked for wherever tasks wait (`check_queues`). A pass the
        database or the broker fails, or that could not check a service, is tried again at the
        next, named under `failing`."""
        while True:
            await asyncio.sleep(interval)
            with supervisor.one_pass(log, "queues not checked", (*_AWAY, QueuesNotChecked)):
                await self.check_queues()

    async def check_queues(self) -> list[str]:
        """The queue names whose `-in` was missing and is declared again (its lost tasks given
        back to the relay), of the services with PENDING tasks. One service that cannot be
        checked (a broker error on its queue, a declaration refused) holds up no other: the
        pass goes on, then raises QueuesNotChecked naming it."""
        async with self.pool.connection() as conn:
            rows = await (await conn.execute(_WAITING)).fetchall()
        restored: list[str] = []
        unchecked: dict[str, str] = {}
        for queue_name, message_format in sorted({(r.queue_name, r.message_format) for r in rows}):
            try:
                if await self.broker.queue_exists(topology.in_queue(queue_name)):
                    continue
                if await self._restore(queue_name, MessageFormat(message_format)):
                    restored.append(queue_name)
            except BROKER_GONE:
                raise  # the connection lost (or frozen): the pass fails, the next tries them all
            except Exception as exc:  # this queue's own (a channel error): the next queue
                unchecked[queue_name] = logs.describe(exc)
                log.warning(
                    "a service's queue could not be checked",
                    extra={"queue": topology.in_queue(queue_name), "error": unchecked[queue_name]},
                )
        if unchecked:
            raise QueuesNotChecked(unchecked)
        return restored

    async def _send(self, submission: Submission, queue_name: str, path: str) -> None:
        """One confirmed publish; with tracing on, in a `publish` span of the task's trace,
        whose context the message carries on (the dispatcher's spans are its children)."""
        if submission.message_format is MessageFormat.CLOUDEVENTS:  # a legacy -in has no limit
            submission = replace(submission, delivery_limit=self.delivery_limit)
        if not tracing.enabled:
            await self.broker.publish(encode_submission(submission), topology.in_queue(queue_name))
            return
        attributes = {
            "conveyor.task_id": submission.task_id,
            "conveyor.publish_path": path,
            "messaging.destination.name": topology.in_queue(queue_name),
        }
        with tracing.span("publish", submission.traceparent, attributes, kind="producer"):
            traced = replace(submission, traceparent=tracing.current())
            await self.broker.publish(encode_submission(traced), topology.in_queue(queue_name))

    async def flush_loop(self) -> None:
        """Marks confirmed rows published in batches: one statement, not one per task. No
        wakeup on a full batch: nothing ripens before `mark_after` has passed anyway."""
        while True:
            await asyncio.sleep(self.flush_every)
            await self.flush()

    async def flush(self, everything: bool = False) -> None:
        """Marks the rows confirmed long enough ago (all of them with `everything`)."""
        if not everything and not self.broker.connected:
            return  # the broker may have crashed: what it confirmed last is not trusted yet
        now = time.monotonic()
        self._forget_old(now)
        ripe = now - self.mark_after
        confirmed = self._unmarked
        ids, attempts = [], []
        while confirmed and (everything or confirmed[0][0] <= ripe):
            _, row_id, attempt = confirmed.popleft()
            ids.append(row_id)
            attempts.append(attempt)
        if not ids:
            supervisor.pass_succeeded()  # nothing left to mark: a failed pass is behind us
            return
        try:
            async with self.pool.connection() as conn:
                await conn.execute(_MARK_CONFIRMED, {"ids": ids, "attempts": attempts})
            supervisor.pass_succeeded()
        except Exception as exc:
            supervisor.pass_failed(exc)
            # The rows stay unpublished; the relay republishes them later (a harmless duplicate).
            log.warning(
                "could not mark confirmed tasks published", extra={"error": logs.describe(exc)}
            )

    # -- relay -------------------------------------------------------------

    async def relay_loop(self) -> None:
        while True:
            retrying = AsyncRetrying(
                wait=wait_exponential(multiplier=self.interval, max=self.max_backoff),
                retry=retry_if_exception_type(Exception),
                before_sleep=_log_backoff,
            )
            settled = False
            async for attempt in retrying:
                with attempt:
                    settled = await self._drain()
            if settled:
                supervisor.pass_succeeded()
            await asyncio.sleep(self.interval)

    async def _drain(self) -> bool:
        """Passes back to back while whole batches get published (a backlog that flows);
        whether no row this relay failed to publish still waits (see `_nothing_failed_waits`)."""
        while True:
            done = await self.relay_once()
            if done.claimed and not done.published:
                raise RelayStalled(f"{done.claimed} claimed, none published")
            if done.published < self.batch:
                return await self._nothing_failed_waits()

    async def _nothing_failed_waits(self) -> bool:
        """A pass that found nothing due while the rows it failed wait out their backoff
        succeeded at nothing: counted a success, it cleared `failing` in /readyz between every
        two failed passes of a relay stalled for good. A row another replica published, or
        whose task ended meanwhile, no longer counts."""
        if self._failed:
            async with self.pool.connection() as conn:
                cursor = await conn.execute(_STILL_UNPUBLISHED, {"ids": list(self._failed)})
                self._failed = {row.id for row in await cursor.fetchall()}
        return not self._failed

    async def relay_once(self) -> RelayPass:
        """Claims up to a batch of due rows and settles each one."""
        params = {"lease": 30.0, "limit": self.batch}
        async with self.pool.lease() as conn:
            rows = await (await conn.execute(_CLAIM, params)).fetchall()
        if not rows:
            return RelayPass(0, 0)
        orphans = [row for row in rows if row.orphan]
        if orphans:
            await self._end_orphans(orphans)
        live = [row for row in rows if not row.orphan]
        errors = await asyncio.gather(*(self._relay_row(row) for row in live))
        done = [row for row, error in zip(live, errors, strict=True) if error is None]
        failed = [(row.id, error) for row, error in zip(live, errors, strict=True) if error]
        self._note_failed({row.id for row in rows}, [row_id for row_id, _ in failed])
        if failed:
            ids, messages = zip(*failed, strict=True)
            async with self.pool.connection() as conn:
                await conn.execute(_NOTE_ERRORS, {"ids": list(ids), "errors": list(messages)})
        return RelayPass(len(rows), len(done) + len(orphans))

    def _note_failed(self, claimed: set[int], failed: list[int]) -> None:
        """The rows of a pass: those published or ended need nothing more; those failed wait."""
        self._failed -= claimed
        self._failed.update(failed[: max(0, FAILED_KEPT - len(self._failed))])

    async def _end_orphans(self, rows: list[Any]) -> None:
        """Tasks whose service was deleted: nothing can run them, so they fail (which ends
        their publishing too)."""
        changes = [lifecycle.failure(row.task_id, lifecycle.SERVICE_DELETED) for row in rows]
        async with self.pool.batch() as conn:
            for change in changes:
                await conn.execute(change.sql, change.params)
            await conn.execute(_MARK_PUBLISHED, {"ids": [row.id for row in rows]})
        log.info("ended tasks of a deleted service", extra={"count": len(rows)})

    async def _relay_row(self, row: Any) -> str | None:
        """None once the row needs nothing more; otherwise why its publish failed."""
        if row.status != "PENDING":
            self._note_confirmed([(row.id, row.publish_attempts)])  # leaves the outbox
            return None  # finished or failed meanwhile (e.g. by the reaper): nothing to send
        submission = Submission(
            task_id=str(row.task_id),
            service=row.service,
            body=row.request,
            message_format=MessageFormat(row.message_format),
            max_attempts=row.max_attempts,
            timeout=float(row.task_timeout),
            # rows from before migration 0012 may have none yet: the reaper's own rule
            expires_at=row.expires_at
            or expiry(row.not_before or row.submission_date, self.ttl, row.retention_seconds),
            traceparent=row.traceparent,
        )
        try:
            await self._send_or_restore(submission, row.queue_name, "relay")
        except PublishError as exc:
            return str(exc)[:500] or exc.__class__.__name__
        metrics.child(metrics.PUBLISHED, "relay").inc()
        # Noted as confirmed now, not when the pass ends: a queue found lost by a later row
        # of this pass gives this one back (`_republish_lost` takes those confirmed before).
        self._note_confirmed([(row.id, row.publish_attempts)])
        return None


def _log_backoff(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    if error is not None:
        supervisor.pass_failed(error)
    log.warning(
        "outbox relay backs off",
        extra={
            "error": logs.describe(error),
            "seconds": round(state.upcoming_sleep, 2),
        },
    )
