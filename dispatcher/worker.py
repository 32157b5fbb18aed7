"""What happens to one message taken from `<q>-in`, top to bottom (SPEC §7).

    decode            unreadable -> reject without requeue: `-dlq` (poison)
    started           published once the call has run STARTED_DELAY_MS (or at its first
                      progress report); a shorter call's terminal event carries the host
                      and start time instead: one confirmed publish fewer per short task
    call the function with retries (retry.py), progress coalesced meanwhile
    terminal event    succeeded / failed, confirmed by the broker
    ack               only now, and only on the channel that delivered it

A cancel aborts the call too (cancels.py): the message is then acked, nothing more.
A shutdown aborts the call instead (shutdown.py). A `requeued` event tells the
gateway the task waits in the queue again, and the message is handed
back: republished to `<q>-in` with confirms, with `x-conveyor-requeues` set to
the number of deliveries used so far, and only then acked. Not a
`basic.nack(requeue=true)`: on a quorum queue that would count toward
`x-delivery-limit`, and a long task interrupted by repeated scale-ins would be
dead-lettered as poison. A crash, on the other hand, leaves the message
unacked; the broker returns it and increments `x-delivery-count`, so only
crashes spend the delivery limit. X-Conveyor-Attempt = requeues header +
`x-delivery-count` + 1 counts both.

Trade-offs of the republish: the copy goes to the tail of the queue, and a
crash between the confirm and the ack leaves two copies (at least once; the
gateway ignores duplicate events). Delivery is at least once in any case: the
function may be called again for a task after a crash or a broker outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from conveyor import headers as h
from conveyor import strict_json, tracing
from conveyor.dispatcher_settings import DispatcherSettings
from conveyor.events import (
    SUBMITTED,
    EventKind,
    MessageFormat,
    Submission,
    TaskEvent,
    WireError,
    decode_submission,
    expiry_of,
)
from dispatcher.cancels import Cancels
from dispatcher.consumer import BROKER_ERRORS, Delivery
from dispatcher.inflight import InFlight, Orphans
from dispatcher.invoker import Failure, Invocation, Invoker, Outcome, Success
from dispatcher.metrics import Metrics
from dispatcher.progress import ProgressBoard, ProgressReporter
from dispatcher.publisher import Publisher
from dispatcher.retry import Budget, RetryPolicy, call_with_retries
from dispatcher.shutdown import Aborted, AbortToken

log = logging.getLogger(__name__)

# How long the terminal event may wait for the broker (e.g. through a restart)
# before the message is handed back for another delivery instead.
TERMINAL_PATIENCE = 30.0
REPUBLISH_TIMEOUT = 3.0
DEAD_LETTER_PAUSE = 1.0  # before a message whose dead letter failed goes back to the queue
# `started` and progress are informative: bounded, never retried.
EVENT_TIMEOUT = 10.0


@dataclass(eq=False, slots=True)
class Attempt:
    """One delivery of one task to this dispatcher."""

    delivery: Delivery
    submission: Submission
    attempt_id: str  # fresh per delivery: the `conveyorattempt` extension of its events
    invocation: Invocation
    budget: Budget
    abort: AbortToken
    started_at: float
    began: datetime  # wall clock, for a terminal event that stands in for `started`
    progress_token: str  # what its progress URL carries: this attempt's alone
    traceparent: str | None = None  # its events': the `consume` span's, or the submission's
    confirmed: bool = False  # its terminal event was confirmed by the broker
    started: asyncio.Task[None] | None = None  # its `started` going out: the task is IN_PROGRESS
    started_timer: asyncio.TimerHandle | None = None  # until STARTED_DELAY_MS have passed
    holds_slot: bool = True  # one of the CONCURRENCY slots, until the function has answered
    # A call may have reached the function: only then does a requeue spend a delivery (one
    # that could not connect is not an attempt of the task).
    reached: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def task_id(self) -> str:
        return self.submission.task_id

    @property
    def started_sent(self) -> bool:
        return self.started is not None

    def event(self, kind: EventKind, **fields: Any) -> TaskEvent:
        return TaskEvent(
            kind=kind,
            task_id=self.task_id,
            attempt=self.attempt_id,
            traceparent=self.traceparent,
            **fields,
        )


class Worker:
    def __init__(
        self,
        settings: DispatcherSettings,
        publisher: Publisher,
        invoker: Invoker,
        board: ProgressBoard,
        metrics: Metrics,
        in_flight: InFlight,
        cancels: Cancels,
        stopping: asyncio.Event,
    ) -> None:
        self.settings = settings
        # CONCURRENCY calls at most; a message beyond them (PREFETCH_BUFFER) waits here.
        self.slots = asyncio.Semaphore(settings.concurrency)
        self.stopping = stopping
        self.cancels = cancels
        self.publisher = publisher
        self.invoker = invoker
        self.board = board
        self.metrics = metrics
        self.in_flight = in_flight
        self.orphans = Orphans()
        self.policy = RetryPolicy(settings.retry_backoff, settings.retry_backoff_max)
        self.progress_base = f"http://127.0.0.1:{settings.dispatcher_port}/tasks"
        # Knative mode: the function is in another pod; it reports on the pod IP, with a token.
        self.remote_base = (
            f"http://{_url_host(settings.pod_ip or '127.0.0.1')}:{settings.progress_port}/tasks"
            if settings.progress_port
            else None
        )

    # -- the pipeline ---------------------------------------------------------

    async def handle(self, delivery: Delivery) -> None:
        try:
            try:
                submission = decode_submission(delivery.wire(), self.settings.queue)
            except WireError as exc:
                await self._reject_poison(delivery, str(exc))
                return
            attributes = (
                {"conveyor.task_id": submission.task_id, "conveyor.queue": self.settings.queue}
                if tracing.enabled
                else None
            )
            with tracing.span("consume", submission.traceparent, attributes, kind="consumer"):
                await self._handle(delivery, submission)
        except Exception:
            # A bug, not a bad message: hand it back; the delivery limit ends a loop.
            log.exception("unexpected error", extra={"delivery_tag": delivery.tag})
            await delivery.nack_requeue()

    async def _handle(self, delivery: Delivery, submission: Submission) -> None:
        await self.cancels.up_to_date()  # after an outage: the cancels missed, read first
        if not delivery.valid:
            return  # its channel closed meanwhile: the broker delivers it again, elsewhere
        if await self.orphans.finished_here(submission.task_id):
            await self._ack_finished_redelivery(delivery)
            return
        if await self._ended_already(delivery, submission):
            return
        limit = submission.delivery_limit
        if limit is not None and delivery.crashes() > limit:
            await self._dead_letter(delivery, submission)
            return
        abort = self.in_flight.token()
        try:
            if not await self._take_slot(abort, delivery):
                await self._requeue(delivery, attempted=False)  # nothing if its channel died
                return
            attempt = await self._attempt(submission, delivery, abort)
            if attempt is None:
                return
            try:
                self.orphans.started(attempt)
                self.cancels.running(attempt.task_id, attempt.abort)
                await self._run(attempt)
            finally:
                self._free_slot(attempt)
                self.cancels.finished(attempt.task_id, attempt.abort)
                self.orphans.ended(attempt)
        finally:
            self.in_flight.forget(abort)

    async def _attempt(
        self, submission: Submission, delivery: Delivery, abort: AbortToken
    ) -> Attempt | None:
        """The attempt that holds the slot just taken from now on, or None with the slot given
        back. Given back on an error too: each error that kept one left a call fewer, until the
        dispatcher took nothing more while it still said it was ready."""
        try:
            # A message may wait for a slot (PREFETCH_BUFFER): its task cancelled or expired
            # meanwhile is not called.
            if await self._ended_already(delivery, submission):
                self.slots.release()
                return None
            return self._begin(submission, delivery, abort)
        except BaseException:
            self.slots.release()
            raise

    async def _take_slot(self, abort: AbortToken, delivery: Delivery) -> bool:
        """False when a buffered message must go back: a shutdown came while it waited (a
        drain finishes the calls under way and starts no new one), or its channel died (the
        broker has it again)."""
        if not self.slots.locked():
            await self.slots.acquire()  # free now: taken without yielding to another delivery
            return True
        try:
            await abort.guard(self.slots.acquire())
        except Aborted:
            return False
        if self.stopping.is_set() or not delivery.valid:
            self.slots.release()
            return False
        return True

    def _free_slot(self, attempt: Attempt) -> None:
        if attempt.holds_slot:
            attempt.holds_slot = False
            self.slots.release()

    async def _run(self, attempt: Attempt) -> None:
        if attempt.delivery.crashes():
            await self._started_first(attempt)
        else:
            self._schedule_started(attempt)
        try:
            await self._call_and_finish(attempt)
        finally:  # an unexpected error too: no `started` may go out after the attempt
            if attempt.started_timer is not None:
                attempt.started_timer.cancel()

    async def _call_and_finish(self, attempt: Attempt) -> None:
        reporter = ProgressReporter(
            partial(self._publish_progress, attempt), self.settings.progress_interval
        )
        self.board.open(attempt.task_id, reporter, attempt.progress_token)
        try:
            outcome = await call_with_retries(
                partial(self._call, attempt),
                self.policy,
                attempt.budget,
                attempt.abort,
                on_retry=partial(self._on_retry, attempt),
            )
        except Aborted:
            await reporter.close(flush=False)
            await self._settle_started(attempt)
            if self.cancels.cancelled(attempt.task_id):
                await self._ack_cancelled(attempt.delivery, attempt.task_id, called=True)
            else:
                renewed = self._says_requeued(attempt)
                requeue = self._requeue(attempt.delivery, attempt.reached, renewed)
                if renewed:
                    await asyncio.gather(self._say_requeued(attempt), requeue)
                else:
                    await requeue
            return
        finally:
            self.board.remove(attempt.task_id, reporter)
        # The function has answered: the next message may be called while this one's
        # terminal event is confirmed and its message acked (never the ack first).
        self._free_slot(attempt)
        # Progress still waiting to go out only matters if `started` did: otherwise the
        # terminal event, next, says it all.
        await self._settle_started(attempt)
        await reporter.close(flush=attempt.started_sent)
        await self._finish(attempt, outcome)

    async def _settle_started(self, attempt: Attempt) -> None:
        """A `started` still in its delay is not sent at all; one going out is waited for."""
        if attempt.started_timer is not None:
            attempt.started_timer.cancel()
        if attempt.started is not None:
            await asyncio.wait((attempt.started,))

    async def _call(self, attempt: Attempt, number: int, time_left: float) -> Outcome:
        began = time.perf_counter()
        label = "error"  # unless the invoker answers: an exception escaped it
        try:
            outcome = await self._invoke(attempt, number - 1, time_left)
            label = outcome.label
            if not (isinstance(outcome, Failure) and outcome.unreachable):
                attempt.reached = True
            return outcome
        except asyncio.CancelledError:
            label = "aborted"  # the task was cancelled or the dispatcher shuts down
            attempt.reached = True  # cut under way: the function may have it
            raise
        finally:
            self.metrics.call_seconds.observe(time.perf_counter() - began)
            self.metrics.calls.labels(outcome=label).inc()

    async def _invoke(self, attempt: Attempt, retry: int, time_left: float) -> Outcome:
        """The HTTP call; with tracing on, in a `call` span whose context the function gets in
        its `traceparent` header (its own spans then join the task's trace)."""
        if not tracing.enabled:
            return await self.invoker.call(attempt.invocation, retry, time_left)
        attributes: tracing.Attributes = {
            "conveyor.task_id": attempt.task_id,
            "conveyor.retry": retry,
        }
        with tracing.span("call", None, attributes, kind="client"):
            invocation = replace(attempt.invocation, traceparent=tracing.current())
            outcome = await self.invoker.call(invocation, retry, time_left)
            if isinstance(outcome, Failure):
                tracing.failed(outcome.error)
            return outcome

    async def _finish(self, attempt: Attempt, outcome: Outcome) -> None:
        # Without a `started` of its own, the terminal event says who ran the task and when.
        stand_in: dict[str, Any] = (
            {}
            if attempt.started_sent
            else {"host": self.settings.hostname, "started": attempt.began}
        )
        if isinstance(outcome, Success):
            event = attempt.event(EventKind.SUCCEEDED, response=outcome.response, **stand_in)
        else:
            event = attempt.event(EventKind.FAILED, error_message=outcome.error, **stand_in)
        fmt = attempt.submission.message_format
        delivery = attempt.delivery
        if not await self.publisher.publish_reliably(event, fmt, TERMINAL_PATIENCE):
            # Never ack without a confirmed terminal event: let it come back.
            await delivery.nack_requeue()
            return
        attempt.confirmed = True
        (self.metrics.succeeded if isinstance(outcome, Success) else self.metrics.failed).inc()
        acked = await delivery.ack()
        # One line per task costs throughput; successes are for debugging only
        # (the gateway keeps the attempt history in its database).
        level = logging.DEBUG if isinstance(outcome, Success) and acked else logging.INFO
        log.log(
            level,
            "task %s",
            event.kind.value,
            extra={
                "task_id": attempt.task_id,
                "attempt": attempt.invocation.attempt,
                "duration_ms": round((time.monotonic() - attempt.started_at) * 1000, 1),
                "acked": acked,
            },
        )

    # -- set-up ---------------------------------------------------------------

    def _begin(self, submission: Submission, delivery: Delivery, abort: AbortToken) -> Attempt:
        timeout = submission.timeout or self.settings.task_timeout
        max_attempts = max(1, submission.max_attempts or self.settings.max_attempts)
        deadline = time.monotonic() + timeout  # from the call, not from a wait in the buffer
        wall_deadline = datetime.now(UTC) + timedelta(seconds=deadline - time.monotonic())
        headers = delivery.headers
        legacy = submission.message_format is MessageFormat.LEGACY
        # Every attempt's progress URL is its own: a call a dead dispatcher left running (or a
        # redelivery's predecessor here) reports to no later attempt of the task.
        token = secrets.token_urlsafe(32 if self.remote_base else 12)
        invocation = Invocation(
            task_id=submission.task_id,
            attempt=delivery.previous_deliveries() + 1,
            deadline=wall_deadline,
            body=_legacy_body(submission) if legacy else delivery.message.body,
            ce_type=_text(headers.get(h.CE_TYPE)) or SUBMITTED,
            ce_source=_text(headers.get(h.CE_SOURCE)) or f"/v1/services/{self.settings.queue}",
            ce_time=_text(headers.get(h.CE_TIME)),
            progress_url=self._progress_url(submission.task_id, token),
            traceparent=submission.traceparent,
        )
        log.debug("task received", extra={"task_id": submission.task_id, "tag": delivery.tag})
        return Attempt(
            delivery=delivery,
            submission=submission,
            attempt_id=str(uuid.uuid4()),
            invocation=invocation,
            budget=Budget(max_attempts, deadline),
            abort=abort,
            started_at=delivery.received,
            began=datetime.now(UTC),
            progress_token=token,
            traceparent=tracing.current() or submission.traceparent,
        )

    def _progress_url(self, task_id: str, token: str) -> str:
        return f"{self.remote_base or self.progress_base}/{task_id}/progress/{token}"

    # -- events ---------------------------------------------------------------

    def _schedule_started(self, attempt: Attempt) -> None:
        """`started` once the call has run STARTED_DELAY_MS. A timer, not a task that sleeps:
        most calls end sooner, and a cancelled timer costs the event loop nothing more."""
        delay = self.settings.started_delay_ms / 1000
        # A legacy event cannot carry the stand-in fields: legacy tasks always get one.
        if delay > 0 and attempt.submission.message_format is MessageFormat.CLOUDEVENTS:
            loop = asyncio.get_running_loop()
            attempt.started_timer = loop.call_later(delay, self._start, attempt)
        else:
            self._start(attempt)

    async def _started_first(self, attempt: Attempt) -> None:
        """A delivery its broker returned (a worker may have crashed with it) is on record as
        an attempt before its call: killed within STARTED_DELAY_MS, a worker left none, and
        the gateway took such returns for the broker's and gave the dead letter back, three
        times past the delivery limit (found by a black-box test). A first delivery keeps
        the delay: most never come back."""
        self._start(attempt)
        assert attempt.started is not None
        with contextlib.suppress(Aborted):  # the call then ends at once, as aborted
            await attempt.abort.guard(asyncio.shield(attempt.started))

    def _start(self, attempt: Attempt) -> None:
        """Sends `started` now, once: its delay is over, or the task reported progress."""
        if attempt.started_timer is not None:
            attempt.started_timer.cancel()
        if attempt.started is None:
            attempt.started = asyncio.create_task(self._publish_started(attempt))

    async def _publish_started(self, attempt: Attempt) -> None:
        event = attempt.event(EventKind.STARTED, host=self.settings.hostname)
        try:
            await asyncio.wait_for(
                self.publisher.publish_event(event, attempt.submission.message_format),
                EVENT_TIMEOUT,
            )
        except BROKER_ERRORS as exc:  # not fatal: the terminal event still ends the task
            log.warning(
                "started event not confirmed",
                extra={"task_id": attempt.task_id, "error": repr(exc)},
            )

    async def _publish_progress(self, attempt: Attempt, value: float) -> None:
        self._start(attempt)  # a task that reports progress is running: say so now
        assert attempt.started is not None
        await asyncio.wait((attempt.started,))  # `started` first, always
        event = attempt.event(EventKind.PROGRESS, progress=value)
        await asyncio.wait_for(
            self.publisher.publish_event(event, attempt.submission.message_format), EVENT_TIMEOUT
        )

    @staticmethod
    def _says_requeued(attempt: Attempt) -> bool:
        """Whether the gateway hears of the requeue: once the attempt's `started` went out,
        and for CloudEvents services (a legacy `-out` has no such event)."""
        return (
            attempt.started_sent and attempt.submission.message_format is not MessageFormat.LEGACY
        )

    async def _say_requeued(self, attempt: Attempt) -> None:
        """Tells the gateway that the task goes back to the queue: the task is PENDING again,
        not an IN_PROGRESS one whose worker fell silent (the watchdog would fail it if the
        queue held it longer than its time limit), and its expiry moves with its copy's. Sent
        with the copy, within the same bound, so that a shutdown takes no longer; should the
        next attempt's `started` come first, it supersedes this event (the gateway checks the
        attempt). Best effort: without it the task is as it always was."""
        event = attempt.event(EventKind.REQUEUED)
        try:
            await asyncio.wait_for(
                self.publisher.publish_event(event, attempt.submission.message_format),
                REPUBLISH_TIMEOUT,
            )
        except BROKER_ERRORS as exc:
            log.info(
                "requeued event not confirmed",
                extra={"task_id": attempt.task_id, "error": repr(exc)},
            )

    def _on_retry(self, attempt: Attempt, failure: Failure, pause: float) -> None:
        self.metrics.retried.inc()
        log.info(
            "function call failed; retrying",
            extra={
                "task_id": attempt.task_id,
                # what went wrong, not what the function said: its answer may echo the task
                "cause": failure.error.partition(":")[0][:200],
                "pause": round(pause, 3),
            },
        )

    # -- the unhappy paths ----------------------------------------------------

    async def _reject_poison(self, delivery: Delivery, reason: str) -> None:
        # Never the body: it may be huge, or carry personal data.
        self.metrics.poison.inc()
        log.warning(
            "poison message dead-lettered",
            extra={
                "delivery_tag": delivery.tag,
                "message_id": delivery.message_id,
                "reason": reason,
            },
        )
        await delivery.reject()

    async def _ended_already(self, delivery: Delivery, submission: Submission) -> bool:
        """Acks, without a call, a task the gateway has ended or is ending: cancelled, or past
        its expiry (the reaper fails it; the queue's TTL only bounds its wait in the queue)."""
        if self.cancels.cancelled(submission.task_id):
            await self._ack_cancelled(delivery, submission.task_id, called=False)
            return True
        expires = submission.expires_at
        if expires is not None and expires <= datetime.now(UTC):
            self.metrics.expired.inc()
            acked = await delivery.ack()
            log.info(
                "task expired before its call: not called",
                extra={"task_id": submission.task_id, "acked": acked},
            )
            return True
        return False

    async def _ack_cancelled(self, delivery: Delivery, task_id: str, called: bool) -> None:
        """The task is FAILURE already (the gateway cancelled it): no retry, no event."""
        self.metrics.cancelled.inc()
        acked = await delivery.ack()
        log.info(
            "task cancelled: call aborted" if called else "task cancelled: not called",
            extra={"task_id": task_id, "acked": acked},
        )

    async def _dead_letter(self, delivery: Delivery, submission: Submission) -> None:
        """A copy a graceful requeue republished starts the broker's count again: past the
        delivery limit counted with the earlier copies' crashes, it goes to `-dlq` uncalled,
        as the broker would have sent it (SPEC §7.1), and the gateway judges it the same way."""
        try:
            await asyncio.wait_for(self.publisher.dead_letter(delivery), REPUBLISH_TIMEOUT)
        except BROKER_ERRORS as exc:
            log.warning(
                "dead letter not confirmed; nack-requeue instead",
                extra={"task_id": submission.task_id, "error": repr(exc)},
            )
            await asyncio.sleep(DEAD_LETTER_PAUSE)  # not a loop at full speed while -dlq refuses
            await delivery.nack_requeue()
            return
        acked = await delivery.ack()
        log.warning(
            "task crashed its workers past its delivery limit: dead-lettered, not called",
            extra={"task_id": submission.task_id, "crashes": delivery.crashes(), "acked": acked},
        )

    async def _ack_finished_redelivery(self, delivery: Delivery) -> None:
        if await delivery.ack():
            log.info(
                "redelivered task already finished here before a reconnection: acked",
                extra={"message_id": delivery.message_id},
            )

    async def hand_back(self, delivery: Delivery) -> None:
        """A delivery that arrived while stopping: back to the queue, never started."""
        await self._requeue(delivery, attempted=False)

    async def _requeue(self, delivery: Delivery, attempted: bool, renewed: bool = False) -> None:
        if not delivery.valid:
            return  # its channel is gone: the broker has already requeued it
        expires = expiry_of(delivery.headers)
        if not renewed and expires is not None and expires <= datetime.now(UTC):
            # Its task is expired (or expiring) at the gateway: a copy would be called later.
            self.metrics.expired.inc()
            acked = await delivery.ack()
            log.info(
                "task expired before its requeue: acked, not handed back",
                extra={"message_id": delivery.message_id, "acked": acked},
            )
            return
        previous = delivery.previous_deliveries() + (1 if attempted else 0)
        try:
            await asyncio.wait_for(
                self.publisher.republish(delivery, previous, renewed), REPUBLISH_TIMEOUT
            )
        except BROKER_ERRORS as exc:
            log.warning(
                "republish failed; nack-requeue instead",
                extra={"delivery_tag": delivery.tag, "error": repr(exc)},
            )
            await delivery.nack_requeue()
            return
        if await delivery.ack():
            self.metrics.requeued.inc()
            log.info(
                "task requeued",
                extra={"message_id": delivery.message_id, "previous_deliveries": previous},
            )


def _url_host(address: str) -> str:
    """An address as a URL writes it: an IPv6 literal in brackets (`http://[::1]:8082/`), a name
    or an IPv4 address as it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    return f"[{address}]" if ip.version == 6 else address


def _legacy_body(submission: Submission) -> bytes:
    """A legacy submission's body as JSON (a CloudEvent's is forwarded as it came)."""
    return strict_json.dumps(submission.body, allow_nan=True)  # as json.dumps always did


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)
