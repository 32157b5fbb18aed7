"""The notification service: POSTs finished tasks to their callback URL.

Pending notifications live in the database (`notification_status = 'PENDING'`,
set in the same UPDATE that finishes the task), so a gateway restart loses
none. Rows are claimed with a lease and `FOR UPDATE SKIP LOCKED`, so replicas
share the work without sending twice. Each notification gets a bounded number
of attempts with exponential backoff (tenacity), then its outcome is recorded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx
from sqlalchemy import text
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from gateway import callbacks, metrics
from gateway.store import task_view

log = logging.getLogger("conveyor.gateway.notifier")

RECORD_PATIENCE = 60.0  # seconds; the claim lease covers it, so no replica re-sends meanwhile
# The result consumer wakes the notifier after every batch that finished a task, callback or
# not: under load, wake-ups are coalesced into at most one claim pass per WAKE_GAP seconds.
WAKE_GAP = 0.05

_CLAIM = text(
    """
    UPDATE tasks
       SET notify_claimed_until = now() + make_interval(secs => :lease),
           notification_attempts = notification_attempts + 1
     WHERE id IN (
             SELECT id FROM tasks
              WHERE notification_status = 'PENDING'
                AND (notify_claimed_until IS NULL OR notify_claimed_until < now())
              ORDER BY id LIMIT :limit
              FOR UPDATE SKIP LOCKED)
    RETURNING id, task_id, status, submission_date, start_date, end_date, progress, response,
              error_message, callback
    """
)
_RECORD = text(
    """
    UPDATE tasks SET notification_status = :outcome, notify_claimed_until = NULL
     WHERE id = :id AND notification_status = 'PENDING'
    """
)


class CallbackFailed(Exception):
    pass


class Notifier:
    def __init__(
        self,
        engine: AsyncEngine,
        policy: callbacks.CallbackPolicy,
        signing_secret: str,
        attempts: int = 3,
        backoff: float = 1.0,
        timeout: float = 10.0,
        batch: int = 50,
    ) -> None:
        self.engine = engine
        self.policy = policy
        self.signing_secret = signing_secret
        self.attempts = attempts
        self.backoff = backoff
        self.timeout = timeout
        self.batch = batch
        self._wakeup = asyncio.Event()
        self._client = httpx.AsyncClient(timeout=timeout, follow_redirects=False)

    def wake(self) -> None:
        self._wakeup.set()

    async def loop(self, idle: float = 1.0) -> None:
        while True:
            started = time.monotonic()
            try:
                while await self.run_once() >= self.batch:
                    pass
            except Exception as exc:
                log.warning("notifier pass failed", extra={"error": repr(exc)})
            await asyncio.sleep(max(0.0, WAKE_GAP - (time.monotonic() - started)))
            try:
                await asyncio.wait_for(self._wakeup.wait(), idle)
            except TimeoutError:
                pass
            self._wakeup.clear()

    async def run_once(self) -> int:
        lease = (
            self.attempts * (self.timeout + self.backoff * 2**self.attempts) + 30 + RECORD_PATIENCE
        )
        async with self.engine.begin() as conn:
            rows = (await conn.execute(_CLAIM, {"lease": lease, "limit": self.batch})).all()
        if rows:
            await asyncio.gather(*(self._notify(row) for row in rows))
        return len(rows)

    async def _notify(self, row: Any) -> None:
        outcome = "SUCCESS"
        try:
            await self._deliver(row.callback["url"], task_view(row))
        except (CallbackFailed, callbacks.CallbackRefused, RetryError) as exc:
            outcome = "FAILURE"
            log.info("callback failed", extra={"task_id": str(row.task_id), "reason": str(exc)})
        metrics.NOTIFICATIONS.labels(outcome=outcome).inc()
        await self._record(row.id, outcome)

    async def _record(self, row_id: int, outcome: str) -> None:
        """Records the outcome, waiting out a database outage: a callback already sent
        would otherwise be sent again when its lease expires."""
        retrying = AsyncRetrying(
            stop=stop_after_delay(RECORD_PATIENCE),
            wait=wait_exponential(multiplier=0.2, max=5),
            retry=retry_if_exception_type((OperationalError, InterfaceError)),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                async with self.engine.begin() as conn:
                    await conn.execute(_RECORD, {"id": row_id, "outcome": outcome})

    async def _deliver(self, url: str, data: dict[str, Any]) -> None:
        body = json.dumps(data, separators=(",", ":")).encode()
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=self.backoff, max=30),
            retry=retry_if_exception_type(CallbackFailed),  # a refused URL is final
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                # Re-checked at each attempt: a DNS answer may have changed since submission.
                await callbacks.check_destination(url, self.policy)
                await self._post(url, body)

    async def _post(self, url: str, body: bytes) -> None:
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "conveyor-notifier",
            callbacks.SIGNATURE_HEADER: callbacks.sign(self.signing_secret, body),
        }
        try:
            answer = await self._client.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise CallbackFailed(f"network error: {exc.__class__.__name__}") from None
        if not 200 <= answer.status_code < 300:
            raise CallbackFailed(f"answered {answer.status_code}")

    async def close(self) -> None:
        await self._client.aclose()
