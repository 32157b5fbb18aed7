"""The task state machine (SPEC §6.4), the only place task state changes.

    PENDING ──started──▶ IN_PROGRESS ──succeeded──▶ SUCCESS
       │   ◀──requeued───  │    ▲  │   (a shutdown handed the message back to the queue)
       │                  │    └──┘ started of a *new* attempt: new worker_host,
       │                  │         progress 0, start_date reset (redelivery)
       └──────────────────┴──failed / dead-lettered / expired──▶ FAILURE

Each transition is one guarded UPDATE: the WHERE clause is the state machine's
precondition, re-checked by PostgreSQL under the row lock. That is what makes
duplicated, late and reordered events harmless, even with several gateway
replicas applying events concurrently:

* terminal states are final: every change of status requires a non-terminal one (an
  attempt's `started` or hand-back read after the next attempt began, or after the task
  ended, still adds that attempt to its history, as read in order it would have);
* a worker's event changes only its own service's tasks (`_came_through`);
* a `started` resets the task only for an attempt it has not seen yet and that
  began after the current one, or after every one recorded when the task waits in `-in`
  again (the `conveyorattempt` extension and event time);
* `progress` applies to the current attempt only, and only upwards;
* the first terminal event wins.

Every attempt is also recorded in `task_attempts` for investigation in SQL.
A task's first event also ends its row's life as an outbox entry (`publish_at`,
see `outbox`): a message that was delivered, or a task that ended, needs no
publish, and the update that says so is one the state machine makes anyway.

A transition is data (`Transition`: a statement, its parameters, and how to
read its one-row answer), so that the results consumer can send a whole batch
of them in one pipelined round trip and read the outcomes afterwards. Every
statement answers one row: how many tasks it changed, and how many of those
now have a callback to send (so that the notifier is woken only then).
The terminal transitions of distinct tasks can also go together as one set-based
statement (`Finishes`), whose guards are the same, row by row.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from conveyor import storable, strict_json
from conveyor.events import EventKind, TaskEvent, now


class Applied(enum.Enum):
    CHANGED = "changed"
    IGNORED = "ignored"  # a duplicate, a late event, or an unknown task
    FINISHED = "finished"  # reached a terminal state (the notifier may have work)


def _came_through(service: str, queue: str = "CAST(%(queue)s AS text)") -> str:
    """A worker's event changes only a task of the service whose queue it came through, or
    that the queue was moved from (`moved_queues`): a dispatcher cannot touch another
    service's tasks. No queue (NULL): the platform's own event."""
    return (
        f"({queue} IS NULL OR {service} IN ("
        f"SELECT s.name FROM services s WHERE s.queue_name = {queue}"
        f" UNION ALL SELECT m.service FROM moved_queues m WHERE m.queue_name = {queue}))"
    )


def _handed_back(task: str = "") -> str:
    """Whether the event's attempt was handed back before its `started` was read (`_REQUEUED`'s
    `early`): in `handed_back` (0018), or in the one-attempt columns a gateway of the release
    before may have written (0015)."""
    attempt = "CAST(%(attempt)s AS text)"
    return (
        f"COALESCE({task}handed_back ? {attempt} OR {task}handed_back_attempt = {attempt}, false)"
    )


# At most so many hand-backs of one task wait for their `started` (a worker sending `requeued`
# for attempts that never were cannot grow the row without bound).
HANDED_BACK_KEPT = 32

_STARTED = f"""
    WITH task AS (
        UPDATE tasks
           SET status = 'IN_PROGRESS', worker_host = CAST(%(host)s AS text),
               start_date = %(time)s, progress = 0, attempt_id = %(attempt)s,
               attempts = attempts + 1, updated_at = now(), publish_at = NULL
         WHERE task_id = %(task_id)s
           AND {_came_through("service")}
           -- PENDING again (a later attempt handed back): not for an attempt older than one
           -- already recorded, whose message is long gone (it made a task waiting in `-in`
           -- IN_PROGRESS, where the watchdog failed it)
           AND ((status = 'PENDING'
                 AND NOT EXISTS (SELECT 1 FROM task_attempts n
                                  WHERE n.task_id = %(task_id)s AND n.start_date > %(time)s))
                OR (status = 'IN_PROGRESS' AND attempt_id IS DISTINCT FROM %(attempt)s
                    AND start_date < %(time)s
                    AND NOT (%(same_host_continues)s AND worker_host = %(host)s)))
           -- an attempt already over (handed back, read first) starts nothing
           AND NOT EXISTS (SELECT 1 FROM task_attempts x
                            WHERE x.task_id = %(task_id)s AND x.attempt_id = %(attempt)s
                              AND x.end_date IS NOT NULL)
           AND NOT {_handed_back()}
        RETURNING task_id
    ), handed_back AS (
        -- its `requeued` was read first (see `_REQUEUED`): the attempt is recorded as handed
        -- back, once, whatever the task is at: also when the next attempt's `started` (the
        -- task IN_PROGRESS with that attempt, which the guard of `task` kept it from taking),
        -- or even its end, was read before this one. A task IN_PROGRESS with an older attempt
        -- (its `started` read in between) waits in `-in` again, as read in order it would.
        UPDATE tasks t
           SET attempts = t.attempts + 1, updated_at = now(),
               status = CASE WHEN o.over THEN 'PENDING' ELSE t.status END,
               worker_host = CASE WHEN o.over THEN NULL ELSE t.worker_host END,
               start_date = CASE WHEN o.over THEN NULL ELSE t.start_date END,
               progress = CASE WHEN o.over THEN 0 ELSE t.progress END,
               attempt_id = CASE WHEN o.over THEN CAST(%(attempt)s AS text) ELSE t.attempt_id END,
               expires_at = CASE WHEN o.over THEN GREATEST(t.expires_at, now()
                                     + (t.expires_at - COALESCE(t.not_before, t.submission_date)))
                                 ELSE t.expires_at END,
               handed_back = t.handed_back - CAST(%(attempt)s AS text)
          FROM (SELECT status = 'IN_PROGRESS' AND start_date < %(time)s AS over
                  FROM tasks WHERE task_id = %(task_id)s) o
         WHERE t.task_id = %(task_id)s AND {_handed_back("t.")}
           AND {_came_through("t.service")}
           AND NOT EXISTS (SELECT 1 FROM task_attempts x
                            WHERE x.task_id = %(task_id)s AND x.attempt_id = %(attempt)s)
        RETURNING t.task_id, o.over,
                  COALESCE(CAST(t.handed_back ->> CAST(%(attempt)s AS text) AS timestamptz),
                           t.handed_back_at) AS handed_back_at
    ), superseded AS (
        UPDATE task_attempts a SET end_date = GREATEST(a.start_date, %(time)s), outcome = 'interrupted'
          FROM handed_back h
         WHERE h.over AND a.task_id = h.task_id AND a.end_date IS NULL
           AND a.attempt_id <> %(attempt)s
    ), recorded AS (
        INSERT INTO task_attempts (task_id, attempt_id, worker_host, start_date, end_date, outcome)
        SELECT task_id, CAST(%(attempt)s AS text), CAST(%(host)s AS text), %(time)s,
               GREATEST(handed_back_at, %(time)s), 'requeued'
          FROM handed_back
        ON CONFLICT (task_id, attempt_id) DO NOTHING
    ), overtaken AS (
        -- read after a later attempt's `started`, or after the task's end (replicas read `-out`
        -- side by side, and a batch held back is read again later): the attempt happened, and
        -- is recorded as read in order it would have been: over when the next one began
        -- (`interrupted`, which its own `requeued` may still make `requeued`), or, the
        -- attempt the task ended with, over with the task's end (its host now known)
        -- (a task that ended with no attempt known, its end read first from a worker sending
        -- no attempt ids, ended with this one)
        UPDATE tasks
           SET attempts = attempts + 1, updated_at = now(),
               worker_host = CASE WHEN COALESCE(attempt_id, %(attempt)s) = %(attempt)s
                                  THEN COALESCE(worker_host, CAST(%(host)s AS text))
                                  ELSE worker_host END,
               attempt_id = COALESCE(attempt_id, CASE WHEN status IN ('SUCCESS', 'FAILURE')
                                                      THEN CAST(%(attempt)s AS text) END)
         WHERE task_id = %(task_id)s AND NOT %(same_host_continues)s
           AND {_came_through("service")}
           AND (status IN ('SUCCESS', 'FAILURE')
                OR (status = 'IN_PROGRESS' AND attempt_id IS DISTINCT FROM %(attempt)s
                    AND start_date >= %(time)s)
                OR (status = 'PENDING'
                    AND EXISTS (SELECT 1 FROM task_attempts n
                                 WHERE n.task_id = %(task_id)s AND n.start_date > %(time)s)))
           AND NOT {_handed_back()}
           AND NOT EXISTS (SELECT 1 FROM task_attempts x
                            WHERE x.task_id = %(task_id)s AND x.attempt_id = %(attempt)s)
        RETURNING task_id, status, attempt_id, end_date, error_message
    ), late AS (
        INSERT INTO task_attempts
               (task_id, attempt_id, worker_host, start_date, end_date, outcome, error_message)
        SELECT o.task_id, CAST(%(attempt)s AS text), CAST(%(host)s AS text), %(time)s,
               CASE WHEN o.attempt_id = %(attempt)s AND o.status IN ('SUCCESS', 'FAILURE')
                    THEN GREATEST(o.end_date, %(time)s)
                    ELSE GREATEST(%(time)s, COALESCE(
                        (SELECT min(n.start_date) FROM task_attempts n
                          WHERE n.task_id = o.task_id AND n.start_date > %(time)s),
                        o.end_date, %(time)s)) END,
               CASE WHEN o.attempt_id = %(attempt)s AND o.status IN ('SUCCESS', 'FAILURE')
                    THEN lower(o.status) ELSE 'interrupted' END,
               CASE WHEN o.attempt_id = %(attempt)s AND o.status IN ('SUCCESS', 'FAILURE')
                    THEN o.error_message END
          FROM overtaken o
        ON CONFLICT (task_id, attempt_id) DO NOTHING
    ), closed AS (
        UPDATE task_attempts a SET end_date = %(time)s, outcome = 'interrupted'
          FROM task
         WHERE a.task_id = task.task_id AND a.end_date IS NULL AND a.attempt_id <> %(attempt)s
    ), opened AS (
        INSERT INTO task_attempts (task_id, attempt_id, worker_host, start_date)
        SELECT task_id, CAST(%(attempt)s AS text), CAST(%(host)s AS text), %(time)s FROM task
        ON CONFLICT (task_id, attempt_id) DO NOTHING
    )
    SELECT count(*) AS changed, 0 AS callbacks FROM task
    """

# A shutdown handed the attempt's message back to `-in`: the task waits in the queue again,
# PENDING (the watchdog leaves it alone, the reaper's time to live applies, capacity counts
# it). Only for the attempt the task is at: a later attempt's `started` already took it over.
# The attempt itself is a hand-back whatever the task is at: read after the next attempt's
# `started` (replicas read `-out` side by side), it was closed `interrupted` by it, which the
# give-back (results.py) would count as a crash. A `started` of it read after it (a duplicate,
# or another replica's) finds it over and starts nothing. Read before its own `started`, it is
# kept on the row (`early`), whatever the task is at: while it is PENDING, that `started` would
# have set the task IN_PROGRESS while its message waits in `-in`, where the watchdog would fail
# it; it records the hand-back instead (`_STARTED`), also once the next attempt began or the
# task ended. Kept aside, not recorded at once: a `requeued` of an attempt that never was the
# task's must leave no attempt in its history.
_REQUEUED = f"""
    WITH task AS (
        UPDATE tasks
           SET status = 'PENDING', worker_host = NULL, start_date = NULL, progress = 0,
               updated_at = now(),
               -- Its message, republished, lives its time to live again from now: so does
               -- the task (the reaper would fail it at once, and a dispatcher run it later).
               expires_at = GREATEST(
                   expires_at, now() + (expires_at - COALESCE(not_before, submission_date)))
         WHERE task_id = %(task_id)s AND status = 'IN_PROGRESS' AND attempt_id = %(attempt)s
           AND {_came_through("service")}
        RETURNING task_id
    ), closed AS (
        UPDATE task_attempts a
           SET end_date = COALESCE(a.end_date, %(time)s), outcome = 'requeued'
          FROM tasks t
         WHERE a.task_id = %(task_id)s AND a.attempt_id = %(attempt)s
           AND (a.end_date IS NULL OR a.outcome = 'interrupted')
           AND t.task_id = a.task_id
           AND {_came_through("t.service")}
    ), early AS (
        -- its copy lives its time to live again from now, as above: also when its `started`
        -- never comes (that publish is best effort)
        UPDATE tasks
           SET handed_back_attempt = %(attempt)s, handed_back_at = %(time)s, updated_at = now(),
               handed_back = CASE
                   WHEN (SELECT count(*) FROM jsonb_object_keys(COALESCE(handed_back, '{{}}')))
                        < {HANDED_BACK_KEPT}
                   THEN COALESCE(handed_back, '{{}}')
                        || jsonb_build_object(CAST(%(attempt)s AS text), %(time)s)
                   ELSE handed_back END,
               expires_at = CASE WHEN status = 'PENDING' THEN GREATEST(
                   expires_at, now() + (expires_at - COALESCE(not_before, submission_date)))
                   ELSE expires_at END
         WHERE task_id = %(task_id)s AND attempt_id IS DISTINCT FROM %(attempt)s
           AND CAST(%(attempt)s AS text) IS NOT NULL
           AND {_came_through("service")}
           AND NOT EXISTS (SELECT 1 FROM task_attempts x
                            WHERE x.task_id = %(task_id)s AND x.attempt_id = %(attempt)s)
    )
    SELECT count(*) AS changed, 0 AS callbacks FROM task
    """

_PROGRESS = f"""
    WITH task AS (
        UPDATE tasks SET progress = %(progress)s, updated_at = now()
         WHERE task_id = %(task_id)s AND status = 'IN_PROGRESS' AND progress < %(progress)s
           AND (CAST(%(attempt)s AS text) IS NULL OR attempt_id = %(attempt)s)
           AND {_came_through("service")}
        RETURNING task_id
    )
    SELECT count(*) AS changed, 0 AS callbacks FROM task
    """

# `started` below is the stand-in start of an attempt that sent no `started` event (a call
# shorter than the dispatcher's STARTED_DELAY_MS): the terminal event then opens and closes
# that attempt itself, one statement instead of two events' worth.
_FINISH = f"""
    WITH task AS (
        UPDATE tasks
           SET status = CAST(%(status)s AS text), updated_at = now(),
               -- never before its start (a worker's clock behind the one that started it)
               end_date = GREATEST(CAST(%(time)s AS timestamptz),
                                   COALESCE(CAST(%(started)s AS timestamptz), start_date)),
               -- a worker's answer means it ran; the platform's own FAILURE (cancelled,
               -- dead-lettered) of a task never started gives it no start
               start_date = COALESCE(CAST(%(started)s AS timestamptz), start_date,
                                     CASE WHEN CAST(%(by_worker)s AS boolean)
                                          THEN CAST(%(time)s AS timestamptz) END),
               -- another attempt's end, its `started` not read yet: that host did not end it
               worker_host = CASE WHEN CAST(%(started)s AS timestamptz) IS NOT NULL
                                  THEN CAST(%(host)s AS text)
                                  WHEN attempt_id IS DISTINCT FROM COALESCE(
                                       CAST(%(attempt)s AS text), attempt_id) THEN NULL
                                  ELSE worker_host END,
               attempt_id = COALESCE(CAST(%(attempt)s AS text), attempt_id),
               attempts = attempts + CASE WHEN CAST(%(started)s AS timestamptz) IS NULL
                                          THEN 0 ELSE 1 END,
               response = CASE WHEN CAST(%(status)s AS text) = 'SUCCESS'
                               THEN CAST(%(response)s AS jsonb) END,
               error_message = CAST(%(error_message)s AS text),
               -- a FAILURE keeps its own attempt's last progress, not another's (a stand-in
               -- attempt, or one whose `started` was not read, reported none here)
               progress = CASE WHEN CAST(%(status)s AS text) = 'SUCCESS' THEN 100
                               WHEN CAST(%(started)s AS timestamptz) IS NOT NULL
                                    OR attempt_id IS DISTINCT FROM COALESCE(
                                        CAST(%(attempt)s AS text), attempt_id) THEN 0
                               ELSE progress END,
               notification_status = CASE WHEN callback IS NOT NULL THEN 'PENDING' END,
               publish_at = NULL
         WHERE task_id = %(task_id)s AND status IN ('PENDING', 'IN_PROGRESS')
           AND {_came_through("service")}
        RETURNING task_id, attempt_id, callback IS NOT NULL AS notify, service, attempts,
                  submission_date, not_before, start_date, end_date, traceparent
    ), history AS (
        UPDATE task_attempts a
           SET end_date = %(time)s,
               outcome = CASE WHEN a.attempt_id = COALESCE(CAST(%(attempt)s AS text), task.attempt_id)
                              THEN lower(CAST(%(status)s AS text)) ELSE 'interrupted' END,
               error_message = CASE WHEN a.attempt_id = COALESCE(CAST(%(attempt)s AS text),
                                                                 task.attempt_id)
                                    THEN CAST(%(error_message)s AS text) END
          FROM task
         WHERE a.task_id = task.task_id AND a.end_date IS NULL
    ), stand_in AS (
        INSERT INTO task_attempts
               (task_id, attempt_id, worker_host, start_date, end_date, outcome, error_message)
        SELECT task_id, CAST(%(attempt)s AS text), CAST(%(host)s AS text),
               CAST(%(started)s AS timestamptz), %(time)s, lower(CAST(%(status)s AS text)),
               CAST(%(error_message)s AS text)
          FROM task
         WHERE CAST(%(started)s AS timestamptz) IS NOT NULL
        ON CONFLICT (task_id, attempt_id) DO NOTHING
    )
    SELECT count(*) AS changed, count(*) FILTER (WHERE notify) AS callbacks,
           min(service) AS service,
           -- durations only for a task some attempt started: one failed while PENDING
           -- (dead-lettered, cancelled) neither waited its turn out nor ran
           min(extract(epoch FROM start_date - greatest(submission_date, not_before))::float8)
               FILTER (WHERE attempts > 0) AS waited,
           min(extract(epoch FROM end_date - start_date)::float8) FILTER (WHERE attempts > 0)
               AS ran,
           min(traceparent) AS traceparent
      FROM task
    """


# `_FINISH` for many tasks at once, row by row the same statement: each input row is one
# task's parameters, and a task must appear once (see `together`). It answers, per task it
# ended, what `_FINISH` answers for one.
_FINISH_MANY = f"""
    WITH input AS (
        SELECT * FROM unnest(CAST(%(task_ids)s AS uuid[]), CAST(%(statuses)s AS text[]),
                             CAST(%(times)s AS timestamptz[]), CAST(%(attempts)s AS text[]),
                             CAST(%(responses)s AS jsonb[]), CAST(%(error_messages)s AS text[]),
                             CAST(%(starteds)s AS timestamptz[]), CAST(%(hosts)s AS text[]),
                             CAST(%(by_workers)s AS boolean[]), CAST(%(queues)s AS text[]))
               AS i(task_id, status, time, attempt, response, error_message, started, host,
                    by_worker, queue)
    ), task AS (
        UPDATE tasks t
           SET status = i.status, end_date = GREATEST(i.time, COALESCE(i.started, t.start_date)),
               updated_at = now(),
               start_date = COALESCE(i.started, t.start_date,
                                     CASE WHEN i.by_worker THEN i.time END),
               worker_host = CASE WHEN i.started IS NOT NULL THEN i.host
                                  WHEN t.attempt_id IS DISTINCT FROM COALESCE(i.attempt, t.attempt_id)
                                  THEN NULL ELSE t.worker_host END,
               attempt_id = COALESCE(i.attempt, t.attempt_id),
               attempts = t.attempts + CASE WHEN i.started IS NULL THEN 0 ELSE 1 END,
               response = CASE WHEN i.status = 'SUCCESS' THEN i.response END,
               error_message = i.error_message,
               progress = CASE WHEN i.status = 'SUCCESS' THEN 100
                               WHEN i.started IS NOT NULL
                                    OR t.attempt_id IS DISTINCT FROM COALESCE(i.attempt, t.attempt_id)
                                    THEN 0
                               ELSE t.progress END,
               notification_status = CASE WHEN t.callback IS NOT NULL THEN 'PENDING' END,
               publish_at = NULL
          FROM input i
         WHERE t.task_id = i.task_id AND t.status IN ('PENDING', 'IN_PROGRESS')
           AND {_came_through("t.service", "i.queue")}
        RETURNING t.task_id, t.attempt_id, t.callback IS NOT NULL AS notify, t.service,
                  t.attempts, t.submission_date, t.not_before, t.start_date, t.end_date,
                  t.traceparent
    ), history AS (
        UPDATE task_attempts a
           SET end_date = i.time,
               outcome = CASE WHEN a.attempt_id = COALESCE(i.attempt, task.attempt_id)
                              THEN lower(i.status) ELSE 'interrupted' END,
               error_message = CASE WHEN a.attempt_id = COALESCE(i.attempt, task.attempt_id)
                                    THEN i.error_message END
          FROM task JOIN input i ON i.task_id = task.task_id
         WHERE a.task_id = task.task_id AND a.end_date IS NULL
    ), stand_in AS (
        INSERT INTO task_attempts
               (task_id, attempt_id, worker_host, start_date, end_date, outcome, error_message)
        SELECT task.task_id, i.attempt, i.host, i.started, i.time, lower(i.status),
               i.error_message
          FROM task JOIN input i ON i.task_id = task.task_id
         WHERE i.started IS NOT NULL
        ON CONFLICT (task_id, attempt_id) DO NOTHING
    )
    SELECT task_id, 1 AS changed, CASE WHEN notify THEN 1 ELSE 0 END AS callbacks, service,
           CASE WHEN attempts > 0 THEN
               extract(epoch FROM start_date - greatest(submission_date, not_before))::float8
           END AS waited,
           CASE WHEN attempts > 0 THEN extract(epoch FROM end_date - start_date)::float8
           END AS ran,
           traceparent
      FROM task
    """


@dataclass(frozen=True, slots=True)
class Transition:
    """One guarded statement; `changed` is what it did when its count is not zero."""

    sql: str
    params: dict[str, Any]
    changed: Applied

    @property
    def task_id(self) -> uuid.UUID:
        return self.params["task_id"]

    @property
    def terminal(self) -> bool:
        return self.changed is Applied.FINISHED

    def outcome(self, answer: Sequence[Any] | None) -> Outcome:
        changed, callbacks = (answer or (0, 0))[:2]
        if not changed:
            return Outcome(Applied.IGNORED, False)
        finished = None
        if self.terminal and answer is not None and len(answer) >= 6:
            service, waited, ran, trace = answer[2:6]
            finished = Finished(
                service, self.params["status"], _seconds(waited), _seconds(ran), trace
            )
        return Outcome(self.changed, callbacks > 0, finished)


@dataclass(frozen=True, slots=True)
class Finished:
    """A task this very statement ended (a duplicate terminal event ends nothing), for the
    metrics: queue wait is start - submission (or - notBefore, a run-later task's own wait is
    no queue's), run time end - start; None when no attempt ever started."""

    service: str
    status: str  # SUCCESS | FAILURE
    waited: float | None
    ran: float | None
    traceparent: str | None = None  # the task's trace, for the gateway's `result` span


@dataclass(frozen=True, slots=True)
class Outcome:
    applied: Applied
    callback_due: bool  # the task finished and has a callback URL: wake the notifier
    finished: Finished | None = None


def _seconds(value: float | None) -> float | None:
    # Start dates are the worker's clock, submission dates the database's: never below 0.
    return None if value is None else max(0.0, float(value))


CLOCK_AHEAD = timedelta(minutes=1)


def transition(event: TaskEvent, queue: str | None = None) -> Transition:
    """The statement that applies `event`, whatever the task's current state. Read from
    `queue`'s `-out` (a queue name), it applies only to a task of a service that has that queue
    name, or had it (`moved_queues`): a worker cannot end another service's task."""
    task_id = uuid.UUID(event.task_id)
    # The worker's clock: one far ahead of the database's dated a task's end (or its start) in
    # the year 9999, `startDate` past `endDate` and the service's run times in years. An event
    # is dated no later than CLOCK_AHEAD after its reading (clocks differ by a little).
    received = now()
    time = min(event.time or received, received + CLOCK_AHEAD)
    match event.kind:
        case EventKind.STARTED:
            params = {
                "task_id": task_id,
                "host": event.host,
                "time": time,
                # Legacy workers send no attempt id: each of their `started` is a new attempt,
                "attempt": event.attempt or event.event_id,
                # ... unless it has no message id either and comes from the host already
                # running the task: then it cannot be told from a duplicate of the first
                # (a republished or redelivered message), and taking a duplicate for a new
                # attempt would reset the task's progress and start date.
                "same_host_continues": event.attempt is None and not event.identified,
                "queue": queue,
            }
            return Transition(_STARTED, params, Applied.CHANGED)
        case EventKind.PROGRESS:
            progress: dict[str, Any] = {
                "task_id": task_id,
                "progress": event.progress,
                "attempt": event.attempt,
                "queue": queue,
            }
            return Transition(_PROGRESS, progress, Applied.CHANGED)
        case EventKind.SUCCEEDED:
            return _finish(
                task_id, "SUCCESS", time, event.attempt, _jsonb(event.response), None, event, queue
            )
        case EventKind.FAILED:
            message = storable.text(event.error_message or "The function failed without a message.")
            return _finish(task_id, "FAILURE", time, event.attempt, None, message, event, queue)
        case EventKind.REQUEUED:
            requeued = {"task_id": task_id, "attempt": event.attempt, "time": time, "queue": queue}
            return Transition(_REQUEUED, requeued, Applied.CHANGED)
    raise ValueError(f"no transition for {event.kind!r}")


def failure(task_id: uuid.UUID, message: str, queue: str | None = None) -> Transition:
    """FAILURE decided by the platform itself: dead-lettered, cancelled, a result that could
    not be stored (`queue`: read from that queue name's `-out` or `-dlq`, see `transition`)."""
    return _finish(task_id, "FAILURE", now(), None, None, message, queue=queue)


def _finish(
    task_id: uuid.UUID,
    status: str,
    time: datetime,
    attempt: str | None,
    response: Jsonb | None,
    error_message: str | None,
    event: TaskEvent | None = None,
    queue: str | None = None,
) -> Transition:
    started = None if event is None else event.started
    if started is not None:
        started = min(started, time)  # no attempt starts after it ended
    if event is not None and started is not None and not attempt:
        attempt = event.event_id  # a stand-in attempt needs an id: a producer sent none
    params = {
        "task_id": task_id,
        "status": status,
        "time": time,
        "attempt": attempt,
        "response": response,
        "error_message": error_message,
        "started": started,
        "host": None if event is None else event.host,
        "by_worker": event is not None,
        "queue": queue,
    }
    return Transition(_FINISH, params, Applied.FINISHED)


def _jsonb(value: Any) -> Jsonb:
    return Jsonb(value, dumps=_storable_json)


def _storable_json(value: Any) -> bytes:
    """A worker's JSON as jsonb takes it. strict_json keeps the digits of integers wider than
    64 bits; a NUL or a lone surrogate, which a worker that is not a dispatcher may send,
    becomes U+FFFD (else PostgreSQL refuses the whole result, and the task would end FAILURE
    for a character)."""
    dumped = strict_json.dumps(value)
    if storable.suspect(dumped):
        dumped = strict_json.dumps(storable.storable(value))
    return dumped


def together(changes: Sequence[Transition]) -> list[Transition]:
    """The terminal transitions that can share one statement (`Finishes`): those of tasks
    nothing else in `changes` touches, so that their order against the rest cannot matter.
    Fewer than two share nothing."""
    seen: dict[uuid.UUID, int] = {}
    for change in changes:
        seen[change.task_id] = seen.get(change.task_id, 0) + 1
    chosen = [c for c in changes if c.sql is _FINISH and seen[c.task_id] == 1]
    return chosen if len(chosen) > 1 else []


@dataclass(frozen=True, slots=True)
class Finishes:
    """Terminal transitions of distinct tasks as one set-based statement: one executor
    start and one round trip for the batch instead of one per event (PostgreSQL's CPU per
    event about halved: `bench.apply`, bench/README.md). Each task's outcome is the one its
    own statement would have had."""

    changes: Sequence[Transition]

    @property
    def sql(self) -> str:
        return _FINISH_MANY

    @property
    def params(self) -> dict[str, Any]:
        columns = ("task_id", "status", "time", "attempt", "response", "error_message")
        names = ("task_ids", "statuses", "times", "attempts", "responses", "error_messages")
        params = {
            name: [c.params[column] for c in self.changes]
            for name, column in zip(names, columns, strict=True)
        }
        params["starteds"] = [c.params["started"] for c in self.changes]
        params["hosts"] = [c.params["host"] for c in self.changes]
        params["by_workers"] = [c.params["by_worker"] for c in self.changes]
        params["queues"] = [c.params["queue"] for c in self.changes]
        return params

    def outcomes(self, rows: Sequence[Sequence[Any]]) -> list[Outcome]:
        """Per transition, in order; a task the statement did not change was IGNORED."""
        answers = {row[0]: row[1:] for row in rows}
        return [c.outcome(answers.get(c.task_id)) for c in self.changes]


async def apply(conn: psycopg.AsyncConnection[Any], change: Transition) -> Outcome:
    """Runs one transition on its own (inside the caller's transaction, if any)."""
    return change.outcome(await (await conn.execute(change.sql, change.params)).fetchone())


# Rows from before migration 0012 have no expiry: the reaper's earlier rule gives them one
# (from their due time, the PENDING time to live or the service's retention if shorter; a
# deleted service's, the time to live alone). A rolling upgrade's old gateways may still
# write such rows: each pass gives them theirs.
_GIVE_EXPIRY = """
    UPDATE tasks t
       SET expires_at = COALESCE(t.not_before, t.submission_date)
           + make_interval(secs => LEAST(%(ttl)s,
               COALESCE((SELECT s.retention_seconds FROM services s WHERE s.name = t.service),
                        %(ttl)s)))
     WHERE t.status = 'PENDING' AND t.expires_at IS NULL
    """

# A PENDING task fails when its message expires from `-in` (the row keeps that expiry), so
# that no worker runs it after, and no task waits PENDING once its message is gone. Only the
# rows past it are read (ix_tasks_pending_expiry), however deep the backlog.
# One text for a task past its time to live, whoever notices first: the reaper, or the
# gateway reading its message dead-lettered as expired from `-dlq`.
EXPIRED = "The task expired: it stayed PENDING longer than its time to live."

_EXPIRE = """
    WITH task AS (
        UPDATE tasks t
           SET status = 'FAILURE', end_date = now(), updated_at = now(),
               error_message = %(message)s,
               notification_status = CASE WHEN t.callback IS NOT NULL THEN 'PENDING' END,
               publish_at = NULL
         WHERE t.status = 'PENDING' AND t.expires_at < now()
        RETURNING t.service
    )
    SELECT service, count(*) FROM task GROUP BY service
    """


async def expire_pending(conn: psycopg.AsyncConnection[Any], ttl: float) -> dict[str, int]:
    """The reaper's transition: PENDING past its expiry becomes FAILURE. How many tasks per
    service. `ttl` is for the rows that have no expiry yet."""
    await conn.execute(_GIVE_EXPIRY, {"ttl": ttl})
    return await _per_service(conn, _EXPIRE, {"message": EXPIRED})


SERVICE_DELETED = "Service deleted."

# Once its service is deleted nobody consumes a task's results any more: every task not
# finished yet ends now, its open attempt interrupted, its callback due.
_END_SERVICE = """
    WITH task AS (
        UPDATE tasks
           SET status = 'FAILURE', end_date = now(), updated_at = now(),
               error_message = %(message)s,
               notification_status = CASE WHEN callback IS NOT NULL THEN 'PENDING' END,
               publish_at = NULL
         WHERE service = %(service)s AND status IN ('PENDING', 'IN_PROGRESS')
        RETURNING task_id
    ), history AS (
        UPDATE task_attempts a
           SET end_date = now(), outcome = 'interrupted'
          FROM task
         WHERE a.task_id = task.task_id AND a.end_date IS NULL
    )
    SELECT task_id FROM task
    """


async def end_service_tasks(conn: psycopg.AsyncConnection[Any], service: str) -> list[uuid.UUID]:
    """Ends every unfinished task of a service being deleted: FAILURE `Service deleted.`.
    Returns their ids: their dispatchers are told, as for a cancel."""
    cursor = await conn.execute(_END_SERVICE, {"service": service, "message": SERVICE_DELETED})
    return [row[0] for row in await cursor.fetchall()]


DEFAULT_TIME_LIMIT = 300 * 3  # taskTimeout x maxAttempts by default, for a deleted service

# No sign of life (started, progress) for longer than every attempt its message allows, plus
# a margin: the worker is gone without a word (its result was lost, or it never reported).
# The limit is the row's own (`time_limit`, from the figures its message was published with):
# a service whose timeout was lowered since must not fail the tasks still running under the
# old one. Rows older than migration 0010 fall back to the service's current figures.
_ABANDON = """
    WITH task AS (
        UPDATE tasks t
           SET status = 'FAILURE', end_date = now(), updated_at = now(),
               error_message = 'No result from the worker within the task''s time limit'
                   || ' (taskTimeout times maxAttempts, plus ' || %(margin)s || ' s).',
               notification_status = CASE WHEN t.callback IS NOT NULL THEN 'PENDING' END
         WHERE t.status = 'IN_PROGRESS'
           AND GREATEST(t.updated_at, %(heard_since)s) < now() - make_interval(
                 secs => %(margin)s + COALESCE(
                   t.time_limit,
                   (SELECT s.task_timeout * s.max_attempts FROM services s
                     WHERE s.name = t.service),
                   %(default_limit)s))
        RETURNING t.task_id, t.service
    ), history AS (
        UPDATE task_attempts a SET end_date = now(), outcome = 'abandoned'
          FROM task WHERE a.task_id = task.task_id AND a.end_date IS NULL
    )
    SELECT service, task_id FROM task
    """


async def abandon_silent(
    conn: psycopg.AsyncConnection[Any], margin: float, heard_since: datetime
) -> dict[str, list[uuid.UUID]]:
    """The watchdog's transition: IN_PROGRESS with no word for too long becomes FAILURE.
    The silence counts from `heard_since` at the earliest (gateway.hearing). The tasks per
    service: their dispatchers are told, as for a cancel."""
    params = {"margin": margin, "default_limit": DEFAULT_TIME_LIMIT, "heard_since": heard_since}
    abandoned: dict[str, list[uuid.UUID]] = {}
    for service, task_id in await (await conn.execute(_ABANDON, params)).fetchall():
        abandoned.setdefault(service, []).append(task_id)
    return abandoned


async def _per_service(
    conn: psycopg.AsyncConnection[Any], statement: str, params: dict[str, Any]
) -> dict[str, int]:
    rows = await (await conn.execute(statement, params)).fetchall()
    return {row[0]: int(row[1]) for row in rows}
