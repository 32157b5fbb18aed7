"""The notification service: POSTs finished tasks to their callback URL.

Pending notifications live in the database (`notification_status = 'PENDING'`,
set in the same UPDATE that finishes the task), so a gateway restart loses
none. Rows are claimed with a short lease and `FOR UPDATE SKIP LOCKED`, so
replicas share the work without sending twice; the lease is renewed while a
delivery is in progress, so the callbacks of a replica that dies are taken
over within one lease. Each claim counts (`notification_attempts`), and that
count is the claim's token: a replica that stopped running for longer than its
lease (frozen, its host paused) finds its claim taken when it runs again, and
neither renews it, nor tries again, nor records an outcome under it.

A callback target is someone else's server, so none may hold the notifier up:
each attempt has a total deadline (a target trickling its answer included), only
the status line is read, and deliveries run in a bounded pool that the claim
loop never waits on as a whole, shared round-robin across targets: hanging targets leave
slots free for the others, however many hang, once each has let an attempt time out (it
then gives way to the others, and never takes the last free slots). Each notification
gets a bounded number of attempts with exponential backoff (tenacity); then its outcome is
recorded, whatever went wrong.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from conveyor import headers as h
from conveyor import logs, signatures, tracing
from gateway import callbacks, metrics, supervisor
from gateway.pgpool import CONNECTION_ERRORS, Pool
from gateway.store import task_view

log = logging.getLogger("conveyor.gateway.notifier")

RECORD_PATIENCE = 60.0  # seconds to wait out a database outage before giving a result up
# The result consumer wakes the notifier after every batch that finished a task, callback or
# not: under load, wake-ups are coalesced into at most one claim pass per WAKE_GAP seconds.
WAKE_GAP = 0.05

# A target that let an attempt time out is slow for SLOW_MEMORY seconds (or until it answers):
# its deliveries, a first one too, take only slots that leave `reserve` free, after every other
# target's first. Hanging targets with nothing in flight would otherwise each take a slot at
# their first delivery, and as many of them as there are slots would hold every slot again
# at each round of their callbacks. Never starved: however busy the other targets keep the
# pool, a mark that no new timeout renews ends, and the target's oldest callback goes first.
SLOW_MEMORY = 300.0
MAX_MARKS = 10_000  # the earliest to expire go first beyond this

# A callback's target, as the claim groups them: its URL's authority (host and port). URLs are
# stored as httpx writes them (`callbacks.check_shape`); split_part costs a tenth of a regex.
_TARGET = (
    "lower(split_part(split_part(split_part(split_part("
    "callback->>'url', '://', 2), '/', 1), '?', 1), '#', 1))"
)
_DUE = (
    "notification_status = 'PENDING'"
    " AND (notify_claimed_until IS NULL OR notify_claimed_until < now())"
)
# Round-robin across targets. A due notification's `nth` is the delivery it would be for its
# target (those this gateway delivers now counted); the claim takes the lowest `nth` first,
# oldest first among equals: a target with nothing in flight goes before any target's second
# delivery, and busy targets take turns instead of the oldest backlog going first. A first
# delivery may take any free slot, a further one only a slot that leaves `reserve` free: targets
# that hang, however many, hold more than one slot each only within `concurrency - reserve`.
# Every due row cannot be read at each pass (up to 20 a second): ranking all of 100,000 due rows
# took 430-730 ms a pass on a loaded 2-core machine. A pass reads two bounded slices of
# `ix_tasks_notify` instead: the oldest `window` due rows, where each target's rank is exact,
# and a `sweep` band after a cursor this gateway moves on at each pass (`swept`: 0 when the band
# reached the end), of which only targets the window does not hold are taken: targets behind a
# backlog of others (hanging or not) get their turn once the band reaches them, within
# (due rows / sweep) passes, however long the backlog. Same 100,000 rows: 8-18 ms a pass, and
# the same rows claimed (a target added behind them: claimed at the 51st pass).
_CLAIM = f"""
    WITH oldest AS (
        SELECT id, {_TARGET} AS target FROM tasks
         WHERE {_DUE} ORDER BY id LIMIT %(window)s
    ), band AS (
        SELECT id, {_TARGET} AS target FROM tasks
         WHERE {_DUE} AND id > %(after)s ORDER BY id LIMIT %(sweep)s
    ), due AS (
        SELECT id, target, row_number() OVER (PARTITION BY target ORDER BY id) AS rank
          FROM (SELECT id, target FROM oldest
                 UNION ALL
                SELECT id, target FROM band b
                 WHERE NOT EXISTS (SELECT FROM oldest o WHERE o.target = b.target)) seen
    ), ranked AS (
        SELECT id, target, rank + COALESCE((CAST(%(busy)s AS int[]))[
                   array_position(CAST(%(targets)s AS text[]), target)], 0) AS nth,
               target = ANY(CAST(%(slow)s AS text[])) AS slow
          FROM due
    ), turns AS (
        SELECT id, target, first, row_number() OVER (ORDER BY NOT first, nth, id) AS pos
          FROM (SELECT *, nth = 1 AND NOT slow AS first FROM ranked
                 ORDER BY NOT (nth = 1 AND NOT slow), nth, id LIMIT %(limit)s) head
    ), chosen AS (
        SELECT id, target FROM turns WHERE first OR pos <= %(limit)s - %(reserve)s
    ), claimed AS (
        UPDATE tasks t
           SET notify_claimed_until = now() + make_interval(secs => %(lease)s),
               notification_attempts = t.notification_attempts + 1
          FROM chosen c
         WHERE t.id = c.id
           AND t.id IN (SELECT id FROM tasks
                         WHERE id IN (SELECT id FROM chosen)
                           AND {_DUE}
                         FOR UPDATE SKIP LOCKED)
        RETURNING t.id, t.task_id, t.status, t.submission_date, t.start_date, t.end_date,
                  t.progress, t.response, t.error_message, t.callback, t.not_before,
                  t.traceparent, c.target, t.notification_attempts AS claim
    )
    SELECT claimed.*, s.swept
      FROM (SELECT CASE WHEN count(*) < %(sweep)s THEN 0 ELSE max(id) END AS swept
              FROM band) s
      LEFT JOIN claimed ON true
    """
# The claims (row id, claim token) this replica still holds; all but those are left alone.
_OURS = """
     WHERE (id, notification_attempts) IN (
           SELECT * FROM unnest(CAST(%(ids)s AS bigint[]), CAST(%(claims)s AS int[])))
       AND notification_status = 'PENDING'
    """
_RENEW = "UPDATE tasks SET notify_claimed_until = now() + make_interval(secs => %(lease)s)" + _OURS
# A gateway shutting down gives back the callbacks it was delivering: another replica, or
# this one restarted, sends them at once instead of after the rest of their lease.
_RELEASE = "UPDATE tasks SET notify_claimed_until = NULL" + _OURS
_RECORD = "UPDATE tasks SET notification_status = %(outcome)s, notify_claimed_until = NULL" + _OURS


class ClaimLost(Exception):
    """Another replica took the notification over while this one did not run."""


class CallbackFailed(Exception):
    pass


class CallbackTimedOut(CallbackFailed):
    pass


class _Marks:
    """Keys remembered until a time (monotonic), at most MAX_MARKS of them."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def mark(self, key: str) -> None:
        self._until.pop(key, None)  # re-inserted last: the dict stays in order of expiry
        self._until[key] = time.monotonic() + SLOW_MEMORY
        if len(self._until) > MAX_MARKS:
            del self._until[next(iter(self._until))]

    def forget(self, key: str) -> None:
        self._until.pop(key, None)

    def current(self) -> list[str]:
        now = time.monotonic()
        while self._until:
            key, until = next(iter(self._until.items()))
            if until > now:
                break
            del self._until[key]
        return list(self._until)


class Notifier:
    def __init__(
        self,
        pool: Pool,
        policy: callbacks.CallbackPolicy,
        signing_secret: str,
        previous_signing_secret: str = "",
        attempts: int = 3,
        backoff: float = 1.0,
        timeout: float = 10.0,
        concurrency: int = 20,
        lease: float = 30.0,
        per_target: int = 5,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.signing_secret = signing_secret
        self.previous_signing_secret = previous_signing_secret  # also signed with, if set
        self.attempts = attempts
        self.backoff = backoff
        self.timeout = timeout  # the whole of one attempt: connect, send, status line
        self.concurrency = concurrency
        # Slots that targets already delivering leave free for those with nothing in flight;
        # one target alone still gets all but these.
        self.reserve = max(0, min(per_target, concurrency - 1))
        self.lease = lease
        # A pass ranks the oldest `window` due rows (the previous claim's window: room for a
        # pass's turns across many targets, a few ms to read) and a band of `sweep` rows
        # further on, after `_swept`, that reaches targets behind a long backlog.
        self.window = max(50, concurrency * 10)
        self.sweep = self.window * 10
        self._swept = 0  # the band's next start (a row id); 0: the oldest due rows
        self._wakeup = asyncio.Event()
        self._deliveries: dict[int, asyncio.Task[None]] = {}  # row id -> its delivery
        self._targets: dict[int, str] = {}  # row id -> its delivery's target
        self._claims: dict[int, int] = {}  # row id -> its claim's token
        self._slow = _Marks()  # targets that let an attempt time out lately
        self._client = httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False)

    def wake(self) -> None:
        self._wakeup.set()

    async def loop(self, idle: float = 1.0) -> None:
        """Claims while there is room in the pool, and keeps the claims' leases alive."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._keep_leases())
            while True:
                # the database away or stuck: tried again, not restarted (/readyz flapped)
                with supervisor.one_pass(log, "could not claim callbacks", CONNECTION_ERRORS):
                    await self.claim()
                await asyncio.sleep(WAKE_GAP)
                try:
                    await asyncio.wait_for(self._wakeup.wait(), idle)
                except TimeoutError:
                    pass
                self._wakeup.clear()

    async def claim(self) -> int:
        """Claims as many notifications as there are free delivery slots; starts them."""
        slow = self._slow.current()
        metrics.CALLBACK_SLOW_TARGETS.set(len(slow))
        room = self.concurrency - len(self._deliveries)
        if room <= 0:
            return 0
        busy = Counter(self._targets.values())
        params = {
            "slow": slow,
            "lease": self.lease,
            "limit": room,
            "reserve": self.reserve,
            "targets": list(busy),
            "busy": list(busy.values()),
            "window": self.window,
            "sweep": self.sweep,
            "after": self._swept,
        }
        async with self.pool.lease() as conn:
            answer = await (await conn.execute(_CLAIM, params)).fetchall()
        # one row at least, its `swept` the band's next start; `id` is NULL if none was claimed
        self._swept = answer[0].swept
        rows = [row for row in answer if row.id is not None]
        for row in rows:
            task = asyncio.create_task(self._notify(row))
            self._deliveries[row.id] = task
            self._targets[row.id] = row.target
            self._claims[row.id] = row.claim
            task.add_done_callback(functools.partial(self._done, row.id))
        return len(rows)

    async def drain(self) -> None:
        """Waits for the deliveries in progress (tests, shutdown)."""
        while self._deliveries:
            await asyncio.gather(*self._deliveries.values(), return_exceptions=True)

    def _done(self, row_id: int, _: asyncio.Task[None]) -> None:
        self._deliveries.pop(row_id, None)
        self._targets.pop(row_id, None)
        self._claims.pop(row_id, None)
        self._wakeup.set()  # a slot is free

    async def _keep_leases(self) -> None:
        while True:
            await asyncio.sleep(self.lease / 3)
            if not self._deliveries:
                continue
            try:
                async with self.pool.connection() as conn:
                    await conn.execute(_RENEW, {"lease": self.lease, **self._ours(self._claims)})
            except CONNECTION_ERRORS as exc:
                log.warning("could not renew callback leases", extra={"error": logs.describe(exc)})

    async def _notify(self, row: Any) -> None:
        outcome = "SUCCESS"
        attributes = {"conveyor.task_id": str(row.task_id)} if tracing.enabled else None
        try:
            with tracing.span("callback", row.traceparent, attributes, kind="client"):
                still_ours = functools.partial(self._still_ours, row.id, row.claim)
                timed_out = functools.partial(self._slow.mark, row.target)
                await self._deliver(row.callback["url"], task_view(row), still_ours, timed_out)
            self._slow.forget(row.target)  # it answered
        except ClaimLost:
            log.info("callback taken over by another replica", extra={"task_id": str(row.task_id)})
            return
        except (
            Exception
        ) as exc:  # whatever happens, the outcome is recorded: nothing retries forever
            outcome = "FAILURE"
            reason = logs.reason(exc)
            log.info("callback failed", extra={"task_id": str(row.task_id), "reason": reason})
        metrics.child(metrics.NOTIFICATIONS, outcome).inc()
        await self._record(row.id, row.claim, outcome)

    async def _record(self, row_id: int, claim: int, outcome: str) -> None:
        """Records the outcome, waiting out a database outage: a callback already sent
        would otherwise be sent again when its lease expires."""
        retrying = AsyncRetrying(
            stop=stop_after_delay(RECORD_PATIENCE),
            wait=wait_exponential(multiplier=0.2, max=5),
            retry=retry_if_exception_type(CONNECTION_ERRORS),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    async with self.pool.connection() as conn:
                        await conn.execute(
                            _RECORD, {"outcome": outcome, **self._ours({row_id: claim})}
                        )
        except CONNECTION_ERRORS:
            log.warning("callback outcome not recorded; its lease will expire")

    async def _still_ours(self, row_id: int, claim: int) -> bool:
        """Renews the claim if it is still this replica's. A database away says nothing: the
        attempt goes ahead (no other replica can claim meanwhile either)."""
        try:
            async with self.pool.connection() as conn:
                renewed = await conn.execute(
                    _RENEW, {"lease": self.lease, **self._ours({row_id: claim})}
                )
                return renewed.rowcount == 1
        except CONNECTION_ERRORS:
            return True

    @staticmethod
    def _ours(claims: dict[int, int]) -> dict[str, list[int]]:
        return {"ids": list(claims), "claims": list(claims.values())}

    async def _deliver(
        self,
        url: str,
        data: dict[str, Any],
        still_ours: Callable[[], Awaitable[bool]],
        timed_out: Callable[[], None] = lambda: None,
    ) -> None:
        body = json.dumps(data, separators=(",", ":")).encode()
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=self.backoff, max=30),
            retry=retry_if_exception(
                lambda exc: isinstance(exc, CallbackFailed | callbacks.HostUnresolved)
            ),
            reraise=True,  # a refused URL is final
        )
        async for attempt in retrying:
            with attempt:
                # After a wait, possibly longer than the lease if this process was not running.
                if attempt.retry_state.attempt_number > 1 and not await still_ours():
                    raise ClaimLost
                # Resolved and checked at each attempt, and the connection goes to the very
                # address that was checked: a DNS answer that changes in between (rebinding)
                # cannot lead the call anywhere else.
                target = await callbacks.destination(url, self.policy)
                try:
                    await self._post(target, body)
                except CallbackTimedOut:
                    timed_out()
                    raise

    async def _post(self, target: callbacks.Destination, body: bytes) -> None:
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "conveyor-notifier",
            h.SIGNATURE: signatures.sign(
                self.signing_secret, body, previous=self.previous_signing_secret
            ),
            **target.headers,
        }
        trace = tracing.current()  # the callback span: the receiver's spans may join the trace
        if trace is not None:
            headers[h.TRACEPARENT] = trace
        try:
            async with asyncio.timeout(self.timeout):  # the attempt, every address included
                answer = await self._send(target, body, headers)
                await answer.aclose()  # the status is all we need: the body is never read
        except TimeoutError:
            raise CallbackTimedOut(f"no answer within {self.timeout:g} s") from None
        except httpx.TimeoutException as exc:  # httpx's own clock, the same timeout
            raise CallbackTimedOut(f"network error: {exc.__class__.__name__}") from None
        except httpx.HTTPError as exc:
            raise CallbackFailed(f"network error: {exc.__class__.__name__}") from None
        if not 200 <= answer.status_code < 300:
            raise CallbackFailed(f"answered {answer.status_code}")

    async def _send(
        self, target: callbacks.Destination, body: bytes, headers: dict[str, str]
    ) -> httpx.Response:
        """To the first checked address that takes the connection: a host's IPv6 address may
        be unreachable from an IPv4-only cluster, and its IPv4 one is checked all the same."""
        *others, last = target.urls
        for url in others:
            try:
                return await self._client.send(
                    self._request(url, target, body, headers), stream=True
                )
            except httpx.ConnectError:
                continue
        return await self._client.send(self._request(last, target, body, headers), stream=True)

    def _request(
        self, url: httpx.URL, target: callbacks.Destination, body: bytes, headers: dict[str, str]
    ) -> httpx.Request:
        return self._client.build_request(
            "POST", url, content=body, headers=headers, extensions=target.extensions
        )

    async def close(self) -> None:
        unfinished = dict(self._claims)
        for task in list(self._deliveries.values()):
            task.cancel()
        await asyncio.gather(*self._deliveries.values(), return_exceptions=True)
        await self._client.aclose()
        if unfinished:
            try:
                async with self.pool.connection() as conn:
                    await conn.execute(_RELEASE, self._ours(unfinished))
            except CONNECTION_ERRORS:
                log.warning("callbacks in progress not given back; their leases will expire")
