"""Publishing without losing tasks: the transactional outbox.

A submission commits its task row and an outbox row together, then publishes
*after* the commit (nothing is ever published inside a transaction). Two paths
empty the outbox:

* the fast path: the API publishes at once and, once the broker confirms,
  queues the outbox id for deletion; deletions are batched into one statement;
* the relay: a background loop that claims rows older than a grace period
  (their fast path failed, or the gateway died between commit and publish),
  publishes them and deletes them. Claims are leases taken with
  `FOR UPDATE SKIP LOCKED`, so several gateway replicas never publish the same
  row at the same time, and a replica that dies mid-publish only delays a row
  until its lease expires. A row whose service was deleted is resolved on
  the spot: its task fails with "Service deleted." and the row goes.

The grace is longer than a fast-path publish can take (see
`GatewaySettings.outbox_grace`), so the relay does not publish a second copy of
a submission whose confirm is merely slow. A relay pass that publishes nothing
(the broker is unreachable) makes the relay back off, up to `max_backoff`,
instead of cycling through the whole backlog at every row's lease expiry.

At worst a task is published twice (confirm received, deletion lost): delivery
is at-least-once end to end, and the state machine absorbs duplicates.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from conveyor import topology, tracing
from conveyor.events import MessageFormat, Submission, encode_submission, now
from gateway import lifecycle, metrics
from gateway.broker import Broker, PublishError
from gateway.catalog import Service
from gateway.pgpool import Pool

log = logging.getLogger("conveyor.gateway.outbox")

# Every statement stands alone: run in autocommit, each is its own transaction.
_DELETE = "DELETE FROM outbox WHERE id = ANY(%(ids)s)"
_CLAIM = """
    UPDATE outbox o
       SET claimed_until = now() + make_interval(secs => %(lease)s), attempts = o.attempts + 1
      FROM tasks t LEFT JOIN services s ON s.name = t.service
     WHERE o.id IN ({rows})
       AND t.task_id = o.task_id
    RETURNING o.id, t.task_id, t.status, t.request, t.service, s.name IS NULL AS orphan,
              s.queue_name, s.message_format, s.max_attempts, s.task_timeout,
              t.submission_date, t.not_before, s.retention_seconds, t.traceparent
    """
_UNCLAIMED = "(claimed_until IS NULL OR claimed_until < now())"
# Rows to publish now, past the grace (ix_outbox_now); rows that waited for their time and are
# due (ix_outbox_later, run later): two claims, each on its own index.
_CLAIM_NOW = _CLAIM.format(
    rows=f"""SELECT id FROM outbox
              WHERE not_before IS NULL AND created_at < now() - make_interval(secs => %(grace)s)
                AND {_UNCLAIMED}
              ORDER BY id LIMIT %(limit)s
              FOR UPDATE SKIP LOCKED"""
)
_CLAIM_DUE = _CLAIM.format(
    rows=f"""SELECT id FROM outbox
              WHERE not_before IS NOT NULL AND not_before <= now() AND {_UNCLAIMED}
              ORDER BY not_before, id LIMIT %(limit)s
              FOR UPDATE SKIP LOCKED"""
)
# A failed publish gives its lease back after a short, growing pause (capped at 10 s): the
# row must not wait out the whole 30 s lease, meant for a relay that died mid-publish.
_NOTE_ERRORS = """
    UPDATE outbox o SET last_error = f.error,
           claimed_until = now() + make_interval(secs => LEAST(o.attempts, 10))
      FROM unnest(CAST(%(ids)s AS bigint[]), CAST(%(errors)s AS text[])) AS f(id, error)
     WHERE o.id = f.id
    """
SERVICE_DELETED = "Service deleted."


class RelayStalled(Exception):
    """A relay pass claimed rows and published none of them: the broker is unreachable."""


@dataclass(frozen=True, slots=True)
class RelayPass:
    claimed: int
    published: int  # confirmed by the broker, or nothing left to send for the task


def expiry(submitted: datetime, ttl: float, retention: float) -> datetime:
    """When a PENDING task fails (the reaper's rule): its message is worth nothing after."""
    return submitted + timedelta(seconds=min(ttl, retention))


def submission_for(
    task_id: Any,
    service: Service,
    body: dict[str, Any],
    ttl: float,
    traceparent: str | None = None,
) -> Submission:
    """A task just accepted, as published on `-in`."""
    return Submission(
        task_id=str(task_id),
        service=service.name,
        body=body,
        message_format=service.message_format,
        max_attempts=service.max_attempts,
        timeout=float(service.task_timeout),
        traceparent=traceparent,
        expires_at=expiry(now(), ttl, service.retention_seconds),
    )


class Outbox:
    def __init__(
        self,
        pool: Pool,
        broker: Broker,
        grace: float,
        ttl: float,
        interval: float = 1.0,
        batch: int = 200,
        flush_every: float = 0.2,
        max_backoff: float = 5.0,
        keep_confirmed: float = 5.0,
    ) -> None:
        self.pool = pool
        self.broker = broker
        self.grace = grace
        self.ttl = ttl  # the reaper's time to live of a PENDING task
        self.interval = interval
        self.batch = batch
        self.max_backoff = max_backoff
        self.flush_every = flush_every
        # A confirmed row is deleted only `keep_confirmed` seconds later (less than `grace`:
        # the relay never sees it meanwhile). A broker that crashes within that time may lose
        # what it confirmed (seen with a RabbitMQ 3.10 quorum queue declared seconds before a
        # crash of its one node): when the
        # connection drops, the rows still kept are left to the relay, which publishes them
        # again. A duplicate is harmless; a lost submission would leave its task PENDING.
        self.keep_confirmed = keep_confirmed
        self._confirmed: list[tuple[float, int]] = []  # (when confirmed, outbox row id)
        self._flush_wakeup = asyncio.Event()
        broker.on_reconnect(self._distrust_recent)

    def _distrust_recent(self) -> None:
        if self._confirmed:
            log.warning(
                "broker connection lost: recently confirmed submissions will be published again",
                extra={"count": len(self._confirmed)},
            )
        self._confirmed.clear()

    def _note_confirmed(self, ids: list[int]) -> None:
        at = time.monotonic()
        self._confirmed.extend((at, outbox_id) for outbox_id in ids)
        if len(self._confirmed) >= self.batch:
            self._flush_wakeup.set()

    # -- fast path ---------------------------------------------------------

    async def publish_now(self, outbox_id: int, submission: Submission, queue_name: str) -> bool:
        """Publishes right after the commit; False leaves the task to the relay."""
        if not self.broker.connected:
            return False
        try:
            await self._send(submission, queue_name, "fast")
        except PublishError as exc:
            log.warning("fast-path publish failed; relay will retry", extra={"error": str(exc)})
            return False
        metrics.PUBLISHED.labels(path="fast").inc()
        self._note_confirmed([outbox_id])
        return True

    async def _send(self, submission: Submission, queue_name: str, path: str) -> None:
        """One confirmed publish; with tracing on, in a `publish` span of the task's trace,
        whose context the message carries on (the dispatcher's spans are its children)."""
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
        """Deletes confirmed outbox rows in batches: one statement, not one per task."""
        while True:
            try:
                await asyncio.wait_for(self._flush_wakeup.wait(), self.flush_every)
            except TimeoutError:
                pass
            self._flush_wakeup.clear()
            await self.flush()

    async def flush(self, everything: bool = False) -> None:
        """Deletes the rows confirmed long enough ago (all of them with `everything`)."""
        if not everything and not self.broker.connected:
            return  # the broker may have crashed: what it confirmed last is not trusted yet
        trusted = time.monotonic() - self.keep_confirmed
        ripe = [entry for entry in self._confirmed if everything or entry[0] <= trusted]
        if not ripe:
            return
        self._confirmed = self._confirmed[len(ripe) :]
        ids = [outbox_id for _, outbox_id in ripe]
        try:
            async with self.pool.connection() as conn:
                await conn.execute(_DELETE, {"ids": ids})
        except Exception as exc:
            # The rows stay; the relay republishes them later (a harmless duplicate).
            log.warning("could not delete confirmed outbox rows", extra={"error": repr(exc)})

    # -- relay -------------------------------------------------------------

    async def relay_loop(self) -> None:
        while True:
            retrying = AsyncRetrying(
                wait=wait_exponential(multiplier=self.interval, max=self.max_backoff),
                retry=retry_if_exception_type(Exception),
                before_sleep=_log_backoff,
            )
            async for attempt in retrying:
                with attempt:
                    await self._drain()
            await asyncio.sleep(self.interval)

    async def _drain(self) -> None:
        """Passes back to back while whole batches get published (a backlog that flows)."""
        while True:
            done = await self.relay_once()
            if done.claimed and not done.published:
                raise RelayStalled(f"{done.claimed} claimed, none published")
            if done.published < self.batch:
                return

    async def relay_once(self) -> RelayPass:
        """Claims up to a batch of rows past the grace and settles each one."""
        params = {"lease": 30.0, "grace": self.grace, "limit": self.batch}
        async with self.pool.connection() as conn:
            rows = await (await conn.execute(_CLAIM_NOW, params)).fetchall()
            rows += await (await conn.execute(_CLAIM_DUE, params)).fetchall()
        if not rows:
            return RelayPass(0, 0)
        orphans = [row for row in rows if row.orphan]
        if orphans:
            await self._end_orphans(orphans)
        live = [row for row in rows if not row.orphan]
        errors = await asyncio.gather(*(self._relay_row(row) for row in live))
        done = [row.id for row, error in zip(live, errors, strict=True) if error is None]
        failed = [(row.id, error) for row, error in zip(live, errors, strict=True) if error]
        self._note_confirmed(done)  # deleted once the broker has had time to keep them
        if failed:
            ids, messages = zip(*failed, strict=True)
            async with self.pool.connection() as conn:
                await conn.execute(_NOTE_ERRORS, {"ids": list(ids), "errors": list(messages)})
        return RelayPass(len(rows), len(done) + len(orphans))

    async def _end_orphans(self, rows: list[Any]) -> None:
        """Tasks whose service was deleted: nothing can run them, so they fail and leave."""
        changes = [lifecycle.failure(row.task_id, SERVICE_DELETED) for row in rows]
        async with self.pool.connection() as conn, conn.pipeline(), conn.transaction():
            for change in changes:
                await conn.execute(change.sql, change.params)
            await conn.execute(_DELETE, {"ids": [row.id for row in rows]})
        log.info("ended tasks of a deleted service", extra={"count": len(rows)})

    async def _relay_row(self, row: Any) -> str | None:
        """None once the row needs nothing more; otherwise why its publish failed."""
        if row.status != "PENDING":
            return None  # finished or failed meanwhile (e.g. by the reaper): nothing to send
        submission = Submission(
            task_id=str(row.task_id),
            service=row.service,
            body=row.request,
            message_format=MessageFormat(row.message_format),
            max_attempts=row.max_attempts,
            timeout=float(row.task_timeout),
            expires_at=expiry(
                row.not_before or row.submission_date, self.ttl, row.retention_seconds
            ),
            traceparent=row.traceparent,
        )
        try:
            await self._send(submission, row.queue_name, "relay")
        except PublishError as exc:
            return str(exc)[:500] or exc.__class__.__name__
        metrics.PUBLISHED.labels(path="relay").inc()
        return None


def _log_backoff(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    log.warning(
        "outbox relay backs off",
        extra={
            "error": repr(error),
            "seconds": round(state.upcoming_sleep, 2),
        },
    )
