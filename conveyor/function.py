"""Optional helpers for Python function authors.

A Conveyor function is a plain HTTP handler and needs none of this: the sleeper
example uses only the standard library. These helpers save a few lines when a
function wants its task id, attempt number and deadline as typed values, or
reports progress:

    ctx = TaskContext.from_headers(request.headers)
    report_progress(ctx, 42.5)          # or report_progress(request.headers, 42.5)

Progress reports are best effort: they return False instead of raising, because
a lost progress update must never fail a task. They ignore HTTP_PROXY: the
progress URL is the dispatcher on the pod's loopback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx

from conveyor import headers as h

PROGRESS_TIMEOUT_S = 2.0


def _lower_keys(headers: Mapping[str, str]) -> dict[str, str]:
    return {key.lower(): value for key, value in headers.items()}


def _parse_deadline(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _parse_attempt(value: str | None) -> int:
    try:
        return max(1, int(value or 1))
    except ValueError:
        return 1


@dataclass(frozen=True)
class TaskContext:
    """What the dispatcher tells a function about the task it is running."""

    task_id: str | None
    attempt: int
    deadline: datetime | None
    progress_url: str | None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> TaskContext:
        """Reads the dispatcher's headers; any case, any Mapping (dict, httpx, Starlette...)."""
        lowered = _lower_keys(headers)
        return cls(
            task_id=lowered.get(h.CE_ID) or lowered.get(h.TASK_ID),
            attempt=_parse_attempt(lowered.get(h.ATTEMPT)),
            deadline=_parse_deadline(lowered.get(h.DEADLINE)),
            progress_url=lowered.get(h.PROGRESS_URL) or None,
        )

    def seconds_left(self, now: datetime | None = None) -> float | None:
        """Seconds until the attempt's deadline (negative once past), None if unknown."""
        if self.deadline is None:
            return None
        return (self.deadline - (now or datetime.now(UTC))).total_seconds()


def _progress_url(target: str | TaskContext | Mapping[str, str] | None) -> str | None:
    if target is None or isinstance(target, str):
        return target or None
    if isinstance(target, TaskContext):
        return target.progress_url
    return TaskContext.from_headers(target).progress_url


def _progress_payload(value: float) -> dict[str, float]:
    return {"progress": min(100.0, max(0.0, float(value)))}


def report_progress(
    target: str | TaskContext | Mapping[str, str] | None,
    value: float,
    timeout: float = PROGRESS_TIMEOUT_S,
) -> bool:
    """POSTs `{"progress": value}` (clamped to 0-100); True if the dispatcher accepted it.

    `target` is the progress URL, a TaskContext, or the request's headers. With no
    progress URL (the function was called directly, not by a dispatcher) it does
    nothing and returns False.
    """
    url = _progress_url(target)
    if url is None:
        return False
    try:
        answer = httpx.post(url, json=_progress_payload(value), timeout=timeout, trust_env=False)
    except httpx.HTTPError:
        return False
    return answer.is_success


async def areport_progress(
    target: str | TaskContext | Mapping[str, str] | None,
    value: float,
    timeout: float = PROGRESS_TIMEOUT_S,
    client: httpx.AsyncClient | None = None,
) -> bool:
    """The async twin of `report_progress`; pass `client` to reuse connections."""
    url = _progress_url(target)
    if url is None:
        return False
    try:
        if client is not None:
            answer = await client.post(url, json=_progress_payload(value), timeout=timeout)
        else:
            async with httpx.AsyncClient(timeout=timeout, trust_env=False) as own_client:
                answer = await own_client.post(url, json=_progress_payload(value))
    except httpx.HTTPError:
        return False
    return answer.is_success
