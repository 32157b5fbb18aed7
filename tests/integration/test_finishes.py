"""Terminal events applied together (`lifecycle.Finishes`) end tasks exactly as one
statement per event would (`lifecycle._FINISH`), on real PostgreSQL.

Every case of the state machine's terminal step is built twice, on twin tasks: once
applied event by event, once as one set-based statement. The twins must end with the
same row, the same attempt history and the same outcome.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from psycopg.types.json import Jsonb

from conveyor.events import EventKind, TaskEvent
from gateway import lifecycle
from gateway.pgpool import connect
from tests.support.gateway import Platform

# Recent: the session gateway's reaper ends PENDING tasks submitted over 24 hours ago, and a
# fixed date here would have let it end the PENDING twins mid-test from that day on.
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)

_TASK_COLUMNS = (
    "status, start_date, end_date, worker_host, attempt_id, attempts, response, error_message,"
    " progress, notification_status, publish_at IS NULL AS published"
)


@dataclass(frozen=True)
class Case:
    """A task's state before the event (None: no such task), and the event."""

    name: str
    before: str | None  # PENDING | IN_PROGRESS | SUCCESS
    callback: bool
    event: str  # succeeded | failed | platform
    same_attempt: bool = True  # the event's attempt is the one running
    stand_in: bool = False  # the event carries its own start (no `started` was sent)


CASES = [
    Case("pending, short call", "PENDING", False, "succeeded", stand_in=True),
    Case("pending, short call, callback", "PENDING", True, "succeeded", stand_in=True),
    Case("pending, short call fails", "PENDING", False, "failed", stand_in=True),
    Case("running, its attempt ends", "IN_PROGRESS", False, "succeeded"),
    Case("running, callback, fails", "IN_PROGRESS", True, "failed"),
    Case("running, another attempt ends", "IN_PROGRESS", False, "succeeded", False, True),
    Case("running, old attempt's late answer", "IN_PROGRESS", False, "failed", False),
    Case("finished already", "SUCCESS", False, "failed", stand_in=True),
    Case("dead-lettered while pending", "PENDING", True, "platform"),
    Case("dead-lettered while running", "IN_PROGRESS", False, "platform"),
    Case("unknown task", None, False, "succeeded", stand_in=True),
]


async def _make(conn: Any, service: str, case: Case) -> uuid.UUID:
    task_id = uuid.uuid4()
    if case.before is None:
        return task_id
    callback = Jsonb({"url": "https://example.com/hook"}) if case.callback else None
    await conn.execute(
        "INSERT INTO tasks (task_id, client_id, service, request, callback, submission_date,"
        " publish_at) VALUES (%s, 'client', %s, '{}', %s, %s, now() + interval '5 s')",
        (task_id, service, callback, T0),
    )
    history = [(EventKind.STARTED, {"host": "host-a"})]
    history += [(EventKind.SUCCEEDED, {"response": {"first": True}})]
    steps = {"PENDING": 0, "IN_PROGRESS": 1, "SUCCESS": 2}[case.before]
    for second, (kind, fields) in enumerate(history[:steps], start=1):
        event = TaskEvent(
            kind=kind,
            task_id=str(task_id),
            event_id=f"e-{second}",
            time=T0 + timedelta(seconds=second),
            attempt="attempt-1",
            **fields,
        )
        await lifecycle.apply(conn, lifecycle.transition(event))
    return task_id


def _event(task_id: uuid.UUID, case: Case) -> lifecycle.Transition:
    if case.event == "platform":
        return lifecycle.failure(task_id, "Dead-lettered.")
    kind = EventKind.SUCCEEDED if case.event == "succeeded" else EventKind.FAILED
    return lifecycle.transition(
        TaskEvent(
            kind=kind,
            task_id=str(task_id),
            event_id=f"e-{uuid.uuid4().hex[:8]}",
            time=T0 + timedelta(seconds=5),
            host="host-b",
            attempt="attempt-1" if case.same_attempt else "attempt-2",
            started=T0 + timedelta(seconds=4) if case.stand_in else None,
            response={"answer": [1, 2, 3]} if kind is EventKind.SUCCEEDED else None,
            error_message="it broke" if kind is EventKind.FAILED else None,
        )
    )


async def _state(conn: Any, task_id: uuid.UUID) -> tuple[Any, list[Any]]:
    row = await (
        await conn.execute(f"SELECT {_TASK_COLUMNS} FROM tasks WHERE task_id = %s", (task_id,))
    ).fetchone()
    attempts = await (
        await conn.execute(
            "SELECT attempt_id, worker_host, start_date, end_date, outcome, error_message"
            " FROM task_attempts WHERE task_id = %s ORDER BY attempt_id",
            (task_id,),
        )
    ).fetchall()
    return (None if row is None else tuple(row)), [tuple(a) for a in attempts]


async def _compare(database_url: str, service: str) -> None:
    async with await connect(database_url) as conn:
        alone = [await _make(conn, service, case) for case in CASES]
        shared = [await _make(conn, service, case) for case in CASES]
        one_by_one = [_event(t, case) for t, case in zip(alone, CASES, strict=True)]
        set_based = [  # the very same events, for the twins
            replace(change, params={**change.params, "task_id": twin})
            for change, twin in zip(one_by_one, shared, strict=True)
        ]
        async with conn.transaction():
            outcomes_alone = [await lifecycle.apply(conn, change) for change in one_by_one]
        finishes = lifecycle.Finishes(lifecycle.together(set_based))
        assert len(finishes.changes) == len(CASES)  # distinct tasks: all of them together
        async with conn.transaction():
            rows = await (await conn.execute(finishes.sql, finishes.params)).fetchall()
        outcomes_shared = finishes.outcomes(rows)

        for case, a, b, out_a, out_b in zip(
            CASES, alone, shared, outcomes_alone, outcomes_shared, strict=True
        ):
            assert out_a == out_b, case.name
            assert await _state(conn, a) == await _state(conn, b), case.name
        # the cases do what they say (so that the comparison compares something)
        ended = [o.applied is lifecycle.Applied.FINISHED for o in outcomes_shared]
        assert ended == [c.before in ("PENDING", "IN_PROGRESS") for c in CASES]
        due = [o.callback_due for o in outcomes_shared]
        assert due == [c.callback and c.before in ("PENDING", "IN_PROGRESS") for c in CASES]


def test_terminal_events_together_end_tasks_as_one_by_one(
    database_url: str, platform: Platform
) -> None:
    asyncio.run(_compare(database_url, platform.service().name))


def _finish(task_id: uuid.UUID) -> lifecycle.Transition:
    return lifecycle.failure(task_id, "x")


def test_only_terminal_events_of_tasks_mentioned_once_go_together() -> None:
    a, b, c, d = (uuid.uuid4() for _ in range(4))
    started = lifecycle.transition(
        TaskEvent(kind=EventKind.STARTED, task_id=str(c), event_id="s", host="h")
    )
    changes = [_finish(a), _finish(b), started, _finish(c), _finish(d), _finish(d)]
    assert [x.task_id for x in lifecycle.together(changes)] == [a, b]  # c and d: not alone
    assert lifecycle.together([_finish(a), started]) == []  # one alone shares nothing
