"""After the storm: waiting for the platform to settle, then the checks.

Everything is read from the source of truth — the run's database, the broker,
the function's call log — never from the gateway's API:

* lost: accepted (201/200) but no row;
* stuck: a row (accepted or not) not SUCCESS/FAILURE in the end;
* wrong outcome: SUCCESS/FAILURE differs from what the sleeper decided, which
  is `doomed(taskId, failRate)`, recomputed here exactly as the sleeper does;
* idempotency: one row per Idempotency-Key, the row the client was told about;
* `<q>-in` empty and without consumers once the dispatchers are stopped;
* every callback task has a notification_status of SUCCESS or FAILURE;
* the backlog counts the triggers keep (migration 0008) equal the PENDING rows, crashes of
  PostgreSQL included;
* duplicates: calls per ce-id in CALL_LOG beyond the first (allowed around
  kills: delivery is at least once; reported, not asserted).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos.infra import QueueState, query, queue_state
from bench.chaos.submitter import SubmitResult
from conveyor import topology

TERMINAL = ("SUCCESS", "FAILURE")
EXPECTED_FAILURE = "Argh!"  # the sleeper's errorMessage for a doomed task
# What each hostile answer of the sleeper must end as: (status, phrases of errorMessage, any
# one of which is enough; empty: any message).
HOSTILE_EXPECTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "nul": ("SUCCESS", ()),  # the NUL is replaced by U+FFFD, the text stored
    "deep": ("FAILURE", ("could not be parsed",)),
    "huge": ("FAILURE", ("exceeded",)),
    # A trickled answer holds its dispatcher for the whole task timeout, so faults often meet
    # one: cut at the deadline, dead-lettered after crashes, ended by the watchdog, out of time
    # after its function was killed. It can never succeed; any FAILURE with its reason is right.
    "trickle": ("FAILURE", ()),
}
SAMPLE = 20  # task ids listed in the report per problem


def doomed(task_id: str, fail_rate: float) -> bool:
    """The sleeper's decision (functions/sleeper/main.py), re-implemented on purpose."""
    digest = int(hashlib.sha256(task_id.encode()).hexdigest(), 16)
    return digest % 1000 < fail_rate * 1000


# ---------------------------------------------------------------------------
# settling


@dataclass
class Progress:
    statuses: Counter[str]
    notifications_pending: int
    outbox: int
    in_queue: QueueState | None

    @property
    def unfinished(self) -> int:
        return sum(n for s, n in self.statuses.items() if s not in TERMINAL)

    @property
    def quiet(self) -> bool:
        return (
            self.unfinished == 0
            and self.notifications_pending == 0
            and self.outbox == 0
            and self.in_queue is not None
            and self.in_queue.messages == 0
        )


def progress(database_url: str, amqp_url: str, service: str, queue: str) -> Progress | None:
    try:
        rows = query(
            database_url,
            "SELECT status, count(*) FROM tasks WHERE service = %(s)s GROUP BY status",
            {"s": service},
        )
        (pending,) = query(
            database_url,
            "SELECT count(*) FROM tasks WHERE service = %(s)s AND notification_status = 'PENDING'",
            {"s": service},
        )[0]
        (outbox,) = query(
            database_url,
            "SELECT count(*) FROM tasks WHERE service = %(s)s AND publish_at IS NOT NULL",
            {"s": service},
        )[0]
    except Exception:  # the database may be restarting under a late fault
        return None
    state = queue_state(amqp_url, topology.in_queue(queue))
    return Progress(Counter(dict(rows)), pending, outbox, state)


def wait_until_settled(
    database_url: str,
    amqp_url: str,
    service: str,
    queue: str,
    timeout: float,
    stop: threading.Event,
    expected: int,
) -> tuple[bool, float | None]:
    """Until every task is terminal, notified, published and `-in` is empty twice in a row.

    Returns (settled, the time.monotonic() at which every task was terminal, if ever).
    Notifications may take longer than the tasks: a callback claimed by a gateway
    that was killed waits for its lease to expire.
    """
    give_up = time.monotonic() + timeout
    terminal_at: float | None = None
    quiet_polls = 0
    last_print = time.monotonic()
    while time.monotonic() < give_up and not stop.is_set():
        seen = progress(database_url, amqp_url, service, queue)
        if seen is not None:
            enough = sum(seen.statuses.values()) >= expected
            if terminal_at is None and seen.unfinished == 0 and enough:
                terminal_at = time.monotonic()
            quiet_polls = quiet_polls + 1 if seen.quiet and enough else 0
            if quiet_polls >= 2:
                return True, terminal_at
            if time.monotonic() - last_print > 10:
                last_print = time.monotonic()
                _print_progress(seen)
        stop.wait(1.0)
    return False, terminal_at


def _print_progress(seen: Progress) -> None:
    print(
        f"  settling: {dict(seen.statuses)}, notifications pending {seen.notifications_pending},"
        f" outbox {seen.outbox}, -in {seen.in_queue}",
        flush=True,
    )


# ---------------------------------------------------------------------------
# the checks


@dataclass
class Verdict:
    accepted: int = 0
    rows: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    stuck: list[dict[str, Any]] = field(default_factory=list)
    wrong_outcome: list[dict[str, Any]] = field(default_factory=list)
    unexpected_failure_reasons: dict[str, int] = field(default_factory=dict)
    rows_never_acknowledged: int = 0  # committed although the client never got an answer
    keyless: dict[str, int] = field(default_factory=dict)
    hostile: dict[str, int] = field(default_factory=dict)  # "<kind> <status>" -> tasks
    idempotency: dict[str, Any] = field(default_factory=dict)
    duplicates: dict[str, Any] = field(default_factory=dict)
    callbacks: dict[str, Any] = field(default_factory=dict)
    in_queue: dict[str, Any] = field(default_factory=dict)
    dead_lettered: int = 0
    attempts: dict[str, int] = field(default_factory=dict)
    backlog: dict[str, int] = field(default_factory=dict)  # counted vs PENDING rows

    @property
    def backlog_exact(self) -> bool:
        b = self.backlog
        return b.get("counted") == b.get("pending") and b.get("in_blocks") == b.get("immediate")

    @property
    def in_queue_empty(self) -> bool:
        return self.in_queue.get("messages") == 0 and self.in_queue.get("consumers") == 0

    @property
    def idempotent(self) -> bool:
        i = self.idempotency
        return not (
            i.get("keys_with_several_rows")
            or i.get("accepted_id_differs")
            or i.get("repeat_mismatches")
        )

    @property
    def notifications_set(self) -> bool:
        return not self.callbacks.get("status_not_set")

    @property
    def ok(self) -> bool:
        return (
            not self.lost
            and not self.stuck
            and not self.wrong_outcome
            and self.in_queue_empty
            and self.idempotent
            and self.notifications_set
            and not self.callbacks.get("well_behaved_not_delivered")
            and self.backlog_exact
        )


def _rows(database_url: str, service: str) -> list[tuple]:
    return query(
        database_url,
        """
        SELECT task_id::text, status, idempotency_key, error_message, notification_status,
               callback IS NOT NULL, attempts, request->>'hostile'
          FROM tasks WHERE service = %(s)s
        """,
        {"s": service},
    )


def _calls(call_log: Path) -> tuple[Counter[str], Counter[str]]:
    """(calls per ce-id, outcomes) from CALL_LOG."""
    per_task: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    if call_log.exists():
        for line in call_log.read_text(errors="replace").splitlines():
            fields = line.split("\t")
            if len(fields) == 3:
                per_task[fields[0]] += 1
                outcomes[fields[2]] += 1
    return per_task, outcomes


def verify(
    database_url: str,
    service: str,
    submitted: SubmitResult,
    call_log: Path,
    fail_rate: float,
    callbacks_received: dict[str, int],
    in_queue: QueueState | None,
    dlq: QueueState | None,
) -> Verdict:
    rows = _rows(database_url, service)
    verdict = Verdict(accepted=len(submitted.accepted), rows=len(rows))
    verdict.statuses = dict(Counter(r[1] for r in rows))
    by_id = {r[0]: r for r in rows}
    verdict.lost = sorted(set(submitted.accepted.values()) - set(by_id))
    _check_outcomes(verdict, rows, fail_rate)
    _check_idempotency(verdict, rows, submitted)
    _check_duplicates(verdict, rows, call_log)
    _check_callbacks(verdict, rows, submitted, callbacks_received)
    verdict.in_queue = (
        {"messages": in_queue.messages, "consumers": in_queue.consumers}
        if in_queue is not None
        else {"error": "not inspectable"}
    )
    verdict.dead_lettered = dlq.messages if dlq is not None else -1
    verdict.attempts = {str(k): v for k, v in sorted(Counter(r[6] for r in rows).items())}
    verdict.backlog = _backlog(database_url, service)
    return verdict


def _backlog(database_url: str, service: str) -> dict[str, int]:
    [row] = query(
        database_url,
        """
        SELECT (SELECT COALESCE(sum(pending), 0) FROM task_backlog WHERE service = %(s)s),
               (SELECT count(*) FROM tasks WHERE service = %(s)s AND status = 'PENDING'),
               (SELECT COALESCE(sum(pending), 0) FROM task_backlog_blocks WHERE service = %(s)s),
               (SELECT count(*) FROM tasks
                 WHERE service = %(s)s AND status = 'PENDING' AND not_before IS NULL)
        """,
        {"s": service},
    )
    return dict(zip(("counted", "pending", "in_blocks", "immediate"), map(int, row), strict=True))


def _check_outcomes(verdict: Verdict, rows: list[tuple], fail_rate: float) -> None:
    reasons: Counter[str] = Counter()
    hostile: Counter[str] = Counter()
    for task_id, status, _key, error, *_, kind in rows:
        if status not in TERMINAL:
            verdict.stuck.append({"taskId": task_id, "status": status})
            continue
        if kind is not None:
            hostile[f"{kind} {status}"] += 1
            expected, phrases = HOSTILE_EXPECTED[kind]
            if status != expected or (phrases and not any(p in (error or "") for p in phrases)):
                verdict.wrong_outcome.append(
                    {"taskId": task_id, "hostile": kind, "status": status, "error": error}
                )
            continue
        expected = "FAILURE" if doomed(task_id, fail_rate) else "SUCCESS"
        if status != expected:
            verdict.wrong_outcome.append(
                {"taskId": task_id, "status": status, "expected": expected, "error": error}
            )
        if status == "FAILURE" and error != EXPECTED_FAILURE:
            reasons[(error or "")[:200]] += 1
    verdict.hostile = dict(hostile)
    verdict.unexpected_failure_reasons = dict(reasons.most_common(10))


def _check_idempotency(verdict: Verdict, rows: list[tuple], submitted: SubmitResult) -> None:
    by_key: dict[str | None, list[str]] = {}
    for task_id, _status, key, *_ in rows:
        by_key.setdefault(key, []).append(task_id)
    several = {k: ids for k, ids in by_key.items() if k is not None and len(ids) > 1}
    differs = [
        k for k, task_id in submitted.accepted.items() if by_key.get(k, [task_id])[0] != task_id
    ]
    verdict.rows_never_acknowledged = sum(
        1 for k in by_key if k is not None and k not in submitted.accepted
    )
    acknowledged = set(submitted.accepted.values())
    verdict.keyless = {
        "accepted": submitted.keyless,
        "no_answer": submitted.keyless_unknown,  # neither accepted nor lost: nobody knows
        "rows_never_acknowledged": sum(1 for t in by_key.get(None, []) if t not in acknowledged),
    }
    verdict.idempotency = {
        "keys_with_several_rows": len(several),
        "rows_without_key": len(by_key.get(None, [])),
        "accepted_id_differs": len(differs),
        "repeats_checked": submitted.repeats,
        "repeat_mismatches": len(submitted.mismatches),
        "retried_keys": submitted.retried,
        "found_after_failure": submitted.found_after_failure,
        "samples": {
            "several": dict(list(several.items())[:SAMPLE]),
            "differs": differs[:SAMPLE],
            "mismatches": submitted.mismatches[:SAMPLE],
        },
    }


def _check_duplicates(verdict: Verdict, rows: list[tuple], call_log: Path) -> None:
    per_task, outcomes = _calls(call_log)
    repeated = {t: n for t, n in per_task.items() if n > 1}
    successes = {r[0] for r in rows if r[1] == "SUCCESS"}
    verdict.duplicates = {
        "calls": sum(per_task.values()),
        "tasks_called": len(per_task),
        "tasks_called_more_than_once": len(repeated),
        "extra_calls": sum(n - 1 for n in repeated.values()),
        "max_calls_per_task": max(per_task.values(), default=0),
        "call_outcomes": dict(outcomes),
        "success_never_called": len(successes - set(per_task)),
    }


def _check_callbacks(
    verdict: Verdict, rows: list[tuple], submitted: SubmitResult, received: dict[str, int]
) -> None:
    with_callback = {r[0]: r for r in rows if r[5]}
    statuses = Counter(str(r[4]) for r in with_callback.values())
    not_set = [t for t, r in with_callback.items() if r[4] not in TERMINAL]
    delivered = {t for t, r in with_callback.items() if r[4] == "SUCCESS"}
    well_behaved = submitted.callbacks & set(with_callback)
    verdict.callbacks = {
        "expected": len(with_callback),
        "hostile_targets": len(submitted.hostile_callbacks),
        "well_behaved_not_delivered": sorted(
            t for t in well_behaved if with_callback[t][4] != "SUCCESS"
        )[:SAMPLE],
        "accepted_with_callback": len(submitted.callbacks),
        "received_tasks": len(set(received) & set(with_callback)),
        "received_total": sum(received.values()),
        "received_more_than_once": sum(1 for n in received.values() if n > 1),
        "notified_but_not_received": len(delivered - set(received)),
        "notification_status": dict(statuses),
        "status_not_set": not_set[:SAMPLE] if not_set else [],
        "status_not_set_count": len(not_set),
    }
