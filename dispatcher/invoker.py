"""The HTTP call to the function, and what its answer means (SPEC §7, step 2 and 4).

The request is a CloudEvent in HTTP binary mode (`ce-*` headers, the task's
body as plain JSON), so a function written for Knative Eventing works
unchanged, plus the `X-Conveyor-*` headers that only Conveyor functions read.

One `httpx.AsyncClient` with keep-alive serves every call of the process: no
connection is opened per task. Requests are built here and handed to
`client.send()`: the URL is parsed once, and the client's default headers and
cookies, which `client.post()` merges into every request (a third of httpx's
CPU per call in a profile), are not wanted anyway.

| answer                               | outcome                          |
|--------------------------------------|----------------------------------|
| 2xx                                  | Success(JSON body / string / None)|
| 4xx except 408, 429 (and 1xx, 3xx)   | Failure, final                   |
| 408, 429, 5xx, network error         | Failure, retryable               |
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

ERROR_LIMIT = 4096  # bytes of errorMessage kept, UTF-8
RETRYABLE_STATUS = frozenset({408, 429})
_ERROR_FIELDS = ("errorMessage", "error", "detail")


@dataclass(frozen=True, slots=True)
class Success:
    response: Any


@dataclass(frozen=True, slots=True)
class Failure:
    error: str
    retryable: bool
    retry_after: str | None = None  # the raw Retry-After header; see retry.py


Outcome = Success | Failure


@dataclass(frozen=True, slots=True)
class Invocation:
    """Everything the function is told about one delivery of one task."""

    task_id: str
    attempt: int  # X-Conveyor-Attempt: the delivery number, from 1
    deadline: datetime
    body: bytes  # the task's body, JSON
    ce_type: str
    ce_source: str
    ce_time: str | None
    progress_url: str
    traceparent: str | None = None

    def headers(self, retry: int) -> dict[str, str]:
        headers = {
            "ce-id": self.task_id,
            "ce-type": self.ce_type,
            "ce-source": self.ce_source,
            "ce-subject": self.task_id,
            "ce-specversion": "1.0",
            "ce-time": self.ce_time or rfc3339(datetime.now(UTC)),
            "content-type": "application/json",
            "x-conveyor-task-id": self.task_id,
            "x-conveyor-attempt": str(self.attempt),
            "x-conveyor-retry": str(retry),
            "x-conveyor-deadline": rfc3339(self.deadline),
            "x-conveyor-progress-url": self.progress_url,
        }
        if self.traceparent:
            headers["traceparent"] = self.traceparent
        return headers


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------------
# answer -> outcome (pure)


def classify(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> Outcome:
    """SPEC §7 table. `headers` only matters for Retry-After."""
    if 200 <= status < 300:
        return Success(response_value(body))
    cause = f"HTTP {status}"
    message = error_message(body)
    if message:
        cause = f"{cause}: {message}" if status >= 500 or status in RETRYABLE_STATUS else message
    if status >= 500 or status in RETRYABLE_STATUS:
        retry_after = (headers or {}).get("retry-after")
        return Failure(truncate(cause), retryable=True, retry_after=retry_after)
    return Failure(truncate(cause), retryable=False)


def network_failure(exc: httpx.HTTPError) -> Failure:
    """Connection refused or reset, timeouts: the function may come back."""
    kind = type(exc).__name__
    detail = str(exc) or kind
    if isinstance(exc, httpx.TimeoutException):
        detail = f"timed out ({kind})"
    elif isinstance(exc, httpx.ConnectError):
        detail = f"cannot connect to the function: {detail}"
    return Failure(truncate(detail), retryable=True)


def response_value(body: bytes) -> Any:
    """2xx body: JSON when it parses, else the text as a JSON string; empty -> None."""
    if not body.strip():
        return None
    try:
        return _strict_json(body)
    except ValueError:
        return body.decode("utf-8", errors="replace")


def error_message(body: bytes) -> str:
    """The body's errorMessage, error or detail, else its text."""
    if not body.strip():
        return ""
    try:
        payload = _strict_json(body)
    except ValueError:
        return body.decode("utf-8", errors="replace").strip()
    if isinstance(payload, dict):
        for name in _ERROR_FIELDS:
            value = payload.get(name)
            if value is None:
                continue
            return value if isinstance(value, str) else json.dumps(value)
    return payload if isinstance(payload, str) else json.dumps(payload)


def truncate(text: str, limit: int = ERROR_LIMIT) -> str:
    encoded = text.encode()
    if len(encoded) <= limit:
        return text
    return encoded[:limit].decode("utf-8", errors="ignore")


def _strict_json(body: bytes) -> Any:
    # NaN/Infinity are not JSON and could not be published as such.
    return json.loads(body, parse_constant=_reject)


def _reject(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# ---------------------------------------------------------------------------
# the call


class Invoker:
    """Calls FUNCTION_URL; one shared keep-alive client for the whole process."""

    def __init__(self, function_url: str, concurrency: int) -> None:
        self.url = httpx.URL(function_url)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        # CA certificates are loaded only when they can be needed (~1 MB of RSS).
        verify = function_url.startswith("https:")
        self._client = httpx.AsyncClient(limits=limits, trust_env=False, verify=verify)

    async def call(self, invocation: Invocation, retry: int, timeout: float) -> Outcome:
        request = httpx.Request(
            "POST",
            self.url,
            content=invocation.body,
            headers=invocation.headers(retry),
            extensions={"timeout": httpx.Timeout(timeout).as_dict()},
        )
        try:
            answer = await self._client.send(request)
        except httpx.HTTPError as exc:
            return network_failure(exc)
        return classify(answer.status_code, answer.content, answer.headers)

    async def close(self) -> None:
        await self._client.aclose()
