"""Housekeeping: the purge (`conveyor purge`, a CronJob) and the reaper of stale PENDING tasks.

The purge runs as the real CLI on a database of its own holding over 100,000
tasks, so that its exact counts are known and no other test's rows are touched.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from typing import Any, NamedTuple

import pytest

from gateway import lifecycle
from gateway.pgpool import connect
from tests.support.amqp import remove_service, scratch_database, wait_until
from tests.support.gateway import GatewayProcess, Platform, Service
from tests.support.processes import REPO

DAY = 86400
MAX_AGE_DAYS = 30


class Rows(NamedTuple):
    """`count` tasks alike; `fate` is what the purge must do with them."""

    label: str
    service: str
    status: str
    count: int
    submitted_days_ago: float
    ended_days_ago: float | None
    fate: str  # kept | finished (past its service's retention) | ancient (past the maximum)


ROWS = [
    Rows("old-a", "keep-week", "SUCCESS", 20_000, 9, 8, "finished"),
    Rows("old-a-failed", "keep-week", "FAILURE", 10_000, 9, 8, "finished"),
    Rows("old-b", "keep-day", "SUCCESS", 15_000, 3, 2, "finished"),
    Rows("old-b-failed", "keep-day", "FAILURE", 15_000, 3, 2, "finished"),
    Rows("old-orphan", "deleted-service", "SUCCESS", 1_000, 9, 8, "finished"),  # default: 7 d
    Rows("recent-a", "keep-week", "SUCCESS", 15_000, 2, 1, "kept"),
    Rows("recent-b", "keep-day", "FAILURE", 14_000, 0.2, 0.1, "kept"),
    Rows("recent-orphan", "deleted-service", "SUCCESS", 1_000, 4, 3, "kept"),
    Rows("pending", "keep-week", "PENDING", 8_000, 0.05, None, "kept"),
    Rows("running", "keep-day", "IN_PROGRESS", 2_000, 0.05, None, "kept"),
    Rows("ancient-pending", "keep-week", "PENDING", 500, MAX_AGE_DAYS + 5, None, "ancient"),
    Rows("ancient-running", "keep-week", "IN_PROGRESS", 500, MAX_AGE_DAYS + 5, None, "ancient"),
    Rows("ancient-finished", "keep-week", "SUCCESS", 500, MAX_AGE_DAYS + 5, 1, "ancient"),
]


def _total(fate: str) -> int:
    return sum(r.count for r in ROWS if r.fate == fate)


_INSERT = """
    INSERT INTO tasks (task_id, client_id, service, status, request, submission_date,
                       start_date, end_date, progress)
    SELECT gen_random_uuid(), 'purge-client', %(service)s, %(status)s,
           jsonb_build_object('label', %(label)s::text, 'n', n),
           now() - make_interval(secs => %(submitted)s),
           CASE WHEN %(status)s <> 'PENDING' THEN now() - make_interval(secs => %(submitted)s) END,
           now() - make_interval(secs => %(ended)s::float8),
           CASE WHEN %(status)s = 'SUCCESS' THEN 100 ELSE 0 END
      FROM generate_series(1, %(count)s) n
"""


def _seed(platform: Platform) -> None:
    platform.apply(
        {
            "services": [
                {"name": "keep-week", "retention": "7d"},
                {"name": "keep-day", "retention": "1d"},
            ]
        }
    )
    for rows in ROWS:
        ended = rows.ended_days_ago
        platform.sql(
            _INSERT,
            {
                "label": rows.label,
                "service": rows.service,
                "status": rows.status,
                "count": rows.count,
                "submitted": rows.submitted_days_ago * DAY,
                "ended": None if ended is None else ended * DAY,
            },
        )
    # One attempt per started task: it must go with its task.
    platform.sql(
        "INSERT INTO task_attempts (task_id, attempt_id, worker_host, start_date)"
        " SELECT task_id, 'a1', 'host', submission_date FROM tasks WHERE status <> 'PENDING'"
    )
    platform.sql(
        "INSERT INTO poison_messages (queue, reason, body_size, received_at)"
        " SELECT 'q-out', 'test', 0, now() - make_interval(days => d)"
        "   FROM unnest(ARRAY[1, 2, %(old)s, %(old)s, %(old)s]) d",
        {"old": MAX_AGE_DAYS + 1},
    )


def _counts(platform: Platform) -> dict[str, int]:
    rows = platform.sql("SELECT request->>'label', count(*) FROM tasks GROUP BY 1")
    return dict(rows)


def _purge(database_url: str, **settings: str) -> subprocess.CompletedProcess[str]:
    env = {
        "CONVEYOR_DATABASE_URL": database_url,
        "CONVEYOR_PURGE_BATCH_SIZE": "5000",
        "CONVEYOR_PURGE_MAX_AGE": str(MAX_AGE_DAYS * DAY),
        "CONVEYOR_LOG_FORMAT": "json",
        **{f"CONVEYOR_{name.upper()}": value for name, value in settings.items()},
    }
    return subprocess.run(
        [sys.executable, "-m", "conveyor", "purge"],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.timeout(120)
def test_purge_deletes_in_batches_exactly_what_is_due(database_url: str) -> None:
    with scratch_database(database_url) as url:
        platform = Platform(url)
        _seed(platform)
        seeded = _counts(platform)
        assert sum(seeded.values()) >= 100_000

        done = _purge(url)

        assert done.returncode == 0, done.stderr + done.stdout
        expected = {r.label: r.count for r in ROWS if r.fate == "kept"}
        assert _counts(platform) == expected
        finished, ancient = _total("finished"), _total("ancient")
        report = re.search(
            r"purged (\d+) finished, (\d+) past the maximum age, (\d+) poison messages,"
            r" in (\d+) batches",
            done.stdout,
        )
        assert report, done.stdout
        assert [int(g) for g in report.groups()[:3]] == [finished, ancient, 3]
        assert int(report.group(4)) >= -(-finished // 5000)  # deleted in batches of 5000
        logged = next(json.loads(line) for line in done.stdout.splitlines() if "purge done" in line)
        assert (logged["message"], logged["finished"], logged["ancient"]) == (
            "purge done",
            finished,
            ancient,
        )
        _assert_dependents_gone(platform)


def _assert_dependents_gone(platform: Platform) -> None:
    remaining = platform.sql(
        "SELECT (SELECT count(*) FROM task_attempts a WHERE NOT EXISTS"
        "          (SELECT 1 FROM tasks t WHERE t.task_id = a.task_id)),"
        "       (SELECT count(*) FROM task_attempts),"
        "       (SELECT count(*) FROM poison_messages)"
    )
    kept = [r for r in ROWS if r.fate == "kept"]
    kept_attempts = sum(r.count for r in kept if r.status != "PENDING")
    assert remaining == [(0, kept_attempts, 2)]


# -- the reaper --------------------------------------------------------------------


def _submit(gateway: GatewayProcess, svc: Service) -> str:
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(gateway.tasks_url(svc.name), json={"body": {}})
    assert answer.status_code == 201, answer.text
    return answer.json()["data"]["taskId"]


def _poll(gateway: GatewayProcess, svc: Service, task_id: str) -> dict[str, Any]:
    with gateway.http(svc.clients[0]) as http:
        return http.get(f"{gateway.tasks_url(svc.name)}/{task_id}").json()["data"]


@pytest.mark.timeout(60)
def test_reaper_fails_pending_tasks_past_their_ttl(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    svc = platform.service()
    try:
        _reap(gateway, platform, svc)
    finally:
        remove_service(platform, amqp_url, svc)


def _reap(gateway: GatewayProcess, platform: Platform, svc: Service) -> None:
    stale, fresh = _submit(gateway, svc), _submit(gateway, svc)
    platform.sql(  # its message expired from -in a day ago
        "UPDATE tasks SET submission_date = now() - interval '2 days',"
        " expires_at = now() - interval '1 day' WHERE task_id = %(t)s",
        {"t": stale},
    )

    data = wait_until(
        lambda: (d := _poll(gateway, svc, stale))["status"] == "FAILURE" and d,
        timeout=10,
        what="stale task reaped",
    )
    assert "expired" in data["errorMessage"]
    assert "endDate" in data
    assert _poll(gateway, svc, fresh)["status"] == "PENDING"


@pytest.mark.timeout(60)
def test_a_task_expires_when_its_message_does_whatever_its_retention_became(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    """Found by a sweep: the reaper read the service's retention at the time of each pass,
    while the task's message carries the expiry it was published with. Lowered by `admin
    apply`, the reaper failed tasks "expired" whose messages a dispatcher then ran anyway;
    raised, a task whose message had expired stayed PENDING for the new retention. The row
    now keeps its message's expiry."""
    lowered, raised = platform.service(retention=86400), platform.service(retention=3)
    try:
        kept, gone = _submit(gateway, lowered), _submit(gateway, raised)
        platform.apply(
            {
                "services": [
                    {"name": lowered.name, "queueName": lowered.queue_name, "retention": 2},
                    {"name": raised.name, "queueName": raised.queue_name, "retention": 86400},
                ]
            }
        )
        data = wait_until(
            lambda: (d := _poll(gateway, raised, gone))["status"] == "FAILURE" and d,
            timeout=15,
            what="the task whose message expired, reaped",
        )
        assert "expired" in data["errorMessage"]
        time.sleep(1.0)  # two more reaper passes (every 0.5 s)
        assert _poll(gateway, lowered, kept)["status"] == "PENDING"
    finally:
        remove_service(platform, amqp_url, lowered)
        remove_service(platform, amqp_url, raised)


@pytest.mark.timeout(60)
def test_pending_tasks_of_a_deleted_service_expire_too(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    svc = platform.service()
    stale = _submit(gateway, svc)
    platform.sql(  # published already
        "UPDATE tasks SET publish_at = NULL WHERE task_id = %(t)s", {"t": stale}
    )
    platform.sql(
        "UPDATE tasks SET submission_date = now() - interval '2 days',"
        " expires_at = now() - interval '1 day' WHERE task_id = %(t)s",
        {"t": stale},
    )
    remove_service(platform, amqp_url, svc)

    def status() -> str:
        rows = platform.sql("SELECT status FROM tasks WHERE task_id = %(t)s", {"t": stale})
        return rows[0][0]

    wait_until(lambda: status() == "FAILURE", timeout=10, what="task of a deleted service reaped")


async def _expire_reading_only_the_old(url: str) -> None:
    """A deep young backlog, tasks whose message expired or not whatever their age, and rows
    from before migration 0012 (no expiry of their own) each past what bounds its life."""
    async with await connect(url) as conn:
        await conn.execute(
            "INSERT INTO services (name, queue_name, retention_seconds)"
            " VALUES ('short', 'short-in', 60), ('long', 'long-in', 7 * 86400)"
        )
        await conn.execute(
            """INSERT INTO tasks (task_id, client_id, service, request, status, submission_date,
                                  not_before, expires_at)
               SELECT gen_random_uuid(), 'c1', s, '{}'::jsonb, 'PENDING', now() - age, later,
                      expiry
                 FROM (VALUES
                   ('long', interval '0 s', NULL::timestamptz, now() + interval '1 day', 5000,
                    'young'),
                   ('long', interval '1 hour', NULL, now() - interval '1 s', 2,
                    'its message expired'),
                   ('short', interval '2 days', NULL, now() + interval '1 hour', 1,
                    'old, but its message lives an hour more'),
                   -- rows from before 0012: the earlier rule gives them their expiry
                   ('long', interval '2 days', NULL, NULL, 3, 'past the TTL'),
                   ('gone', interval '2 days', NULL, NULL, 2, 'a deleted service: the TTL'),
                   ('long', interval '2 days', now() + interval '1 hour', NULL, 4,
                    'waits its time'),
                   ('long', interval '3 days', now() - interval '2 days', NULL, 5,
                    'due long ago'),
                   ('short', interval '2 minutes', NULL, NULL, 6, 'past its retention'),
                   ('short', interval '10 s', NULL, NULL, 7, 'within its retention')
                 ) AS r(s, age, later, expiry, n, what), generate_series(1, r.n)"""
        )
        read = (
            "SELECT seq_tup_read AS seq, COALESCE(idx_tup_fetch, 0) AS fetched"
            " FROM pg_stat_xact_user_tables WHERE relname = 'tasks'"
        )
        passes = []
        for _ in range(2):
            async with conn.transaction():
                before = await (await conn.execute(read)).fetchone()
                expired = await lifecycle.expire_pending(conn, DAY)
                after = await (await conn.execute(read)).fetchone()
            passes.append((expired, after.seq - before.seq, after.fetched - before.fetched))
        left = await (
            await conn.execute(
                "SELECT service, count(*) AS n FROM tasks WHERE status = 'PENDING'"
                " GROUP BY service ORDER BY service"
            )
        ).fetchall()
        assert [(r.service, r.n) for r in left] == [("long", 5000 + 4), ("short", 1 + 7)]
        # The first pass reads the 27 rows without an expiry, then the 18 past theirs; the
        # next one reads nothing at all: never the young backlog.
        assert passes[0][0] == {"long": 2 + 3 + 5, "gone": 2, "short": 6}
        assert passes[0][1] == 0 and passes[0][2] <= 27 + 18, passes
        assert passes[1] == ({}, 0, 0), passes
        # Nor does it compile the statement: at a million rows, JIT was most of a pass.
        assert (await (await conn.execute("SHOW jit")).fetchone()).jit == "off"


@pytest.mark.timeout(60)
def test_the_reaper_reads_only_the_pending_tasks_old_enough_to_expire(database_url: str) -> None:
    with scratch_database(database_url) as url:
        asyncio.run(_expire_reading_only_the_old(url))


def test_purge_counts_a_task_to_run_later_from_when_it_is_due(database_url: str) -> None:
    """Found by a black-box sweep: with PURGE_MAX_AGE shorter than a task's delay, the purge
    deleted the task before it was due (counted from its submission): it never ran, never
    failed, and its callback never went out. A task to run later is as old as the time it
    has been due."""
    with scratch_database(database_url) as url:
        platform = Platform(url)
        platform.apply({"services": [{"name": "later", "retention": "7d"}]})
        rows = {
            # label: (submitted days ago, due days from now, purged?)
            "due-next-week": (MAX_AGE_DAYS + 5, 7, False),
            "due-yesterday": (MAX_AGE_DAYS + 5, -1, False),
            "due-long-ago": (MAX_AGE_DAYS + 5, -(MAX_AGE_DAYS + 1), True),
        }
        for label, (submitted, due, _) in rows.items():
            platform.sql(
                "INSERT INTO tasks (task_id, client_id, service, status, request,"
                " submission_date, not_before)"
                " VALUES (gen_random_uuid(), 'c', 'later', 'PENDING',"
                " jsonb_build_object('label', %(label)s::text),"
                " now() - make_interval(days => %(submitted)s),"
                " now() + make_interval(days => %(due)s))",
                {"label": label, "submitted": submitted, "due": due},
            )
        done = _purge(url)
        assert done.returncode == 0, done.stderr + done.stdout
        assert set(_counts(platform)) == {label for label, row in rows.items() if not row[2]}


def test_purge_refuses_a_maximum_age_shorter_than_a_waiting_tasks_time_to_live(
    database_url: str,
) -> None:
    """A PURGE_MAX_AGE under PENDING_TTL would delete tasks still waiting to run, before they
    expire (FAILURE, and their callback): refused at start, naming both."""
    done = _purge(database_url, pending_ttl=str(2 * DAY), purge_max_age=str(DAY))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "CONVEYOR_PURGE_MAX_AGE" in done.stderr and "CONVEYOR_PENDING_TTL" in done.stderr


def test_purge_keeps_a_finished_task_its_callback_or_idempotency_key_still_needs(
    database_url: str,
) -> None:
    """Found by a black-box sweep at a retention of one second: the purge deleted finished
    tasks whose callback was still to be sent (never sent, nor recorded anywhere), and tasks
    whose Idempotency-Key was within its 24 h (a repeat made a second task; a batch purged in
    part was refused as "a different request"). Kept until they are done with, or until
    PURGE_MAX_AGE."""
    with scratch_database(database_url) as url:
        platform = Platform(url)
        platform.apply({"services": [{"name": "brief", "retention": "1s"}]})
        rows = {
            # label: (submitted h ago, notification, idempotency key, purged?)
            "callback-due": (2, "PENDING", None, False),
            "callback-sent": (2, "SENT", None, True),
            "callback-failed": (2, "FAILED", None, True),
            "key-fresh": (2, None, "k1", False),
            "batch-fresh-0": (2, None, "b\n0", False),
            "batch-fresh-1": (2, None, "b\n1", False),
            "key-stale": (25, None, "k2", True),
            "plain": (2, None, None, True),
            "ancient-callback-due": (MAX_AGE_DAYS * 24 + 1, "PENDING", "k3", True),
        }
        for label, (hours, notification, key, _) in rows.items():
            platform.sql(
                "INSERT INTO tasks (task_id, client_id, service, status, request,"
                " submission_date, end_date, notification_status, idempotency_key)"
                " VALUES (gen_random_uuid(), 'c', 'brief', 'SUCCESS',"
                " jsonb_build_object('label', %(label)s::text),"
                " now() - make_interval(hours => %(hours)s), now() - interval '1 hour',"
                " %(notification)s, %(key)s)",
                {"label": label, "hours": hours, "notification": notification, "key": key},
            )
        done = _purge(url)
        assert done.returncode == 0, done.stderr + done.stdout
        kept = set(_counts(platform))
        assert kept == {label for label, row in rows.items() if not row[3]}
