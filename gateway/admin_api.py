"""The admin API (SPEC §11.6): every service and every client's task, for operators only.

Operators authenticate like clients (HTTP Basic) against their own table, through an
authenticator of their own: a client's secret never opens these routes and an operator's never
opens the consumer API, and each failure is the same 403001. Pages go newest first by row id;
the cursor is that id, opaque to callers, so a page is stable while new tasks arrive.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from typing import Any

from fastapi import APIRouter, Request

from conveyor import envelope
from gateway import api_models, errors
from gateway.api import MAX_SERVICE_NAME, DirectRoute, authenticated, runtime
from gateway.models import TaskStatus
from gateway.responses import Json
from gateway.store import iso

router = APIRouter(route_class=DirectRoute, tags=["admin"])
MAX_LIMIT = 200
DEFAULT_LIMIT = 50

# Read by the handler itself (DirectRoute), documented here.
_PAGE_PARAMETERS = [
    {
        "name": "status",
        "in": "query",
        "required": False,
        "schema": {"type": "string", "enum": ["PENDING", "IN_PROGRESS", "SUCCESS", "FAILURE"]},
    },
    {
        "name": "limit",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT},
    },
    {
        "name": "cursor",
        "in": "query",
        "required": False,
        "description": "The previous page's `nextCursor`",
        "schema": {"type": "string"},
    },
]
_PAGE_PARAMETER_NAMES = tuple(str(parameter["name"]) for parameter in _PAGE_PARAMETERS)

_PAGE = """
    SELECT id, task_id, client_id, status, submission_date, start_date, end_date, progress,
           error_message, worker_host
    FROM tasks
    WHERE service = %(service)s AND id < %(before)s
      AND (%(status)s::text IS NULL OR status = %(status)s::text)
    ORDER BY id DESC LIMIT %(limit)s
    """
# Every column of the row (SPEC §11.6: "everything the row ... holds").
_TASK = """
    SELECT id, task_id, client_id, service, status,
           COALESCE(request_json, request::json) AS request, response, error_message, progress,
           callback, submission_date, start_date, end_date, notification_status,
           notification_attempts, notify_claimed_until, worker_host, attempt_id, attempts,
           idempotency_key, idempotency_fingerprint, not_before, traceparent, publish_at,
           publish_attempts, publish_error, time_limit, expires_at, cancelled_at,
           handed_back_attempt, handed_back_at, handed_back, updated_at
    FROM tasks WHERE task_id = %(task_id)s
    """
_ATTEMPTS = """
    SELECT attempt_id, worker_host, start_date, end_date, outcome, error_message
    FROM task_attempts WHERE task_id = %(task_id)s ORDER BY start_date, id
    """


@router.get(
    "/v1/admin/services",
    summary="Every service's figures",
    response_model=api_models.ServicesEnvelope,
    responses=api_models.error_responses(403, 431, 503),
)
async def services(request: Request) -> Json:
    rt = runtime(request)
    await authenticated(request, rt.operators)
    return _ok({"services": await rt.stats.snapshot()})


@router.get(
    "/v1/admin/services/{service}/tasks",
    summary="A service's tasks, any client's, newest first",
    response_model=api_models.TaskPageEnvelope,
    responses=api_models.error_responses(400, 403, 404, 431, 503),
    openapi_extra={"parameters": _PAGE_PARAMETERS},
)
async def service_tasks(service: str, request: Request) -> Json:
    """`status` filters; `limit` 1 to 200 (50); `cursor` is the previous page's `nextCursor`."""
    rt = runtime(request)
    await authenticated(request, rt.operators)
    query = request.query_params
    for name in _PAGE_PARAMETER_NAMES:
        if len(query.getlist(name)) > 1:  # which one was meant is anyone's guess
            raise errors.invalid(name, "given more than once")
    status = query.get("status") or None
    if status is not None and status not in TaskStatus.__members__:
        raise errors.invalid("status", "one of PENDING, IN_PROGRESS, SUCCESS, FAILURE")
    limit = _limit(query.get("limit"))
    before = _cursor(query.get("cursor"))
    if len(service) > MAX_SERVICE_NAME or "\x00" in service:  # PostgreSQL text refuses NUL
        raise errors.ApiError(errors.SERVICE_NOT_FOUND)
    async with rt.pool.connection() as conn:
        known = await conn.execute("SELECT 1 FROM services WHERE name = %s", (service,))
        if await known.fetchone() is None:
            raise errors.ApiError(errors.SERVICE_NOT_FOUND)
        params = {"service": service, "before": before, "status": status, "limit": limit + 1}
        rows = await (await conn.execute(_PAGE, params)).fetchall()
    more = len(rows) > limit
    rows = rows[:limit]
    return _ok(
        {
            "tasks": [_summary(row) for row in rows],
            "nextCursor": _encode(rows[-1].id) if more else None,
        }
    )


@router.get(
    "/v1/admin/tasks/{task_id}",
    summary="Everything about one task",
    response_model=api_models.TaskDetailEnvelope,
    responses=api_models.error_responses(403, 404, 431, 503),
)
async def task(task_id: str, request: Request) -> Json:
    rt = runtime(request)
    await authenticated(request, rt.operators)
    try:
        parsed = uuid.UUID(task_id)
    except ValueError:
        raise errors.ApiError(errors.TASK_NOT_FOUND) from None
    async with rt.pool.connection() as conn:
        row = await (await conn.execute(_TASK, {"task_id": parsed})).fetchone()
        if row is None:
            raise errors.ApiError(errors.TASK_NOT_FOUND)
        attempts = await (await conn.execute(_ATTEMPTS, {"task_id": parsed})).fetchall()
    detail = _summary(row) | {
        "rowId": row.id,
        "service": row.service,
        "request": row.request,
        "response": row.response,
        "notBefore": iso(row.not_before),
        "idempotencyKey": row.idempotency_key,
        "idempotencyFingerprint": _hex(row.idempotency_fingerprint),
        "deliveries": row.attempts,
        "attemptId": row.attempt_id,
        "traceparent": row.traceparent,
        # the row as the outbox: when the relay may publish it (null once published), how
        # many times it tried, and the last broker error
        "publishAt": iso(row.publish_at),
        "publishAttempts": row.publish_attempts,
        "publishError": row.publish_error,
        "timeLimit": row.time_limit,
        "expiresAt": iso(row.expires_at),
        "cancelledAt": iso(row.cancelled_at),  # set by a cancel, not by a function's message
        # a `requeued` read before its own `started` (gateway/lifecycle.py, `_REQUEUED`)
        "handedBackAttempt": row.handed_back_attempt,
        "handedBackAt": iso(row.handed_back_at),
        "handedBack": row.handed_back,  # every such attempt still waiting for its `started`
        "updatedAt": iso(row.updated_at),
        "callback": None,
        "attempts": [
            {
                "attemptId": a.attempt_id,
                "workerHost": a.worker_host,
                "startDate": iso(a.start_date),
                "endDate": iso(a.end_date),
                "outcome": a.outcome,
                "errorMessage": a.error_message,
            }
            for a in attempts
        ],
    }
    if row.callback is not None:
        detail["callback"] = {
            "type": row.callback.get("type"),
            "url": row.callback.get("url"),
            "status": row.notification_status,
            # Claims of the delivery by a notifier (`notification_attempts`), each up to
            # CONVEYOR_CALLBACK_ATTEMPTS HTTP calls: the calls themselves are not recorded.
            "rounds": row.notification_attempts,
            "claimedUntil": iso(row.notify_claimed_until),
        }
    return _ok(detail)


def _summary(row: Any) -> dict[str, Any]:
    return {
        "taskId": str(row.task_id),
        "clientId": row.client_id,
        "status": row.status,
        "submitionDate": iso(row.submission_date),
        "startDate": iso(row.start_date),
        "endDate": iso(row.end_date),
        "progress": 100.0 if row.status == TaskStatus.SUCCESS else float(row.progress),
        "errorMessage": row.error_message,
        "workerHost": row.worker_host,
    }


def _hex(value: bytes | None) -> str | None:
    return None if value is None else value.hex()


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    # ASCII digits only: str.isdigit() takes '²' and '①', which int() refuses (a 500)
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_LIMIT:
        raise errors.invalid("limit", f"an integer from 1 to {MAX_LIMIT}")
    return int(raw)


_LAST = 2**63 - 1  # no cursor: from the newest row


def _encode(row_id: int) -> str:
    return base64.urlsafe_b64encode(f"t{row_id}".encode()).decode().rstrip("=")


def _cursor(raw: str | None) -> int:
    if not raw:
        return _LAST
    try:
        text = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode()
        if text[:1] == "t" and text[1:].isdigit() and len(text) < 21:
            return int(text[1:])
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise errors.invalid("cursor", "not a cursor this API gave")


def _ok(data: dict[str, Any]) -> Json:
    return Json(envelope.success(data))
