"""The consumer API (SPEC §3): create and poll tasks.

Checks run in the order the SPEC gives, cheapest first, and stop at the first
failure: credentials (403001), service (404001), grant (403001), size
(413001), shape (400002), JSON Schema (400001), capacity (429001/429002).
The body is read by hand so that a huge or hostile body is refused before it
is parsed, and so that every refusal carries the seed's error envelope.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from sqlalchemy.exc import DBAPIError, OperationalError
from starlette.responses import Response

from gateway import api_models, catalog, errors, metrics, pgpool
from gateway.callbacks import CallbackRefused, check_callback
from gateway.outbox import submission_for
from gateway.responses import Json
from gateway.runtime import Runtime
from gateway.store import NewTask, create_task, get_task


class DirectRoute(APIRoute):
    """A FastAPI route (documented in OpenAPI, matched by the one route table, named in
    metrics) whose requests go straight to the handler: the handlers read their own path
    parameters and body, so FastAPI's per-request dependency solving and validation,
    a large share of a submission's CPU, is skipped."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint

        async def handle(request: Request) -> Response:
            return await endpoint(request=request, **request.path_params)

        return handle


router = APIRouter(route_class=DirectRoute)
MAX_SERVICE_NAME = 200
MAX_IDEMPOTENCY_KEY = 200
# Deeper documents overflow recursive JSON encoders downstream (json, orjson: 254).
MAX_DEPTH = 128
_JSON_TYPES = ("application/json", "application/cloudevents+json")


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def _client(request: Request, rt: Runtime) -> str:
    source = request.client.host if request.client else ""
    client_id = await rt.auth.authenticate(request.headers.get("authorization"), source)
    if client_id is None:
        metrics.AUTH_FAILURES.inc()
        raise errors.ApiError(errors.FORBIDDEN)
    return client_id


async def _access(rt: Runtime, client_id: str, service: str) -> catalog.Access | None:
    if len(service) > MAX_SERVICE_NAME or "\x00" in service:  # PostgreSQL text refuses NUL
        return None
    return await rt.access.access(client_id, service)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise errors.invalid("Content-Length", "not a number")
        if int(declared) > limit:
            raise errors.ApiError(errors.TOO_LARGE)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise errors.ApiError(errors.TOO_LARGE)
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(raw: bytes, content_type: str | None) -> dict[str, Any]:
    media = (content_type or "application/json").split(";")[0].strip().lower()
    if media not in _JSON_TYPES and not media.endswith("+json"):
        raise errors.invalid("Content-Type", "must be application/json")
    try:
        payload = orjson.loads(raw)  # refuses NaN/Infinity, invalid UTF-8 and deep nesting
    except orjson.JSONDecodeError as exc:
        raise errors.invalid("", f"malformed JSON: {str(exc)[:200]}") from None
    if not isinstance(payload, dict):
        raise errors.invalid("", "the request must be a JSON object")
    if b"\\u0000" in raw or raw.count(b"{") + raw.count(b"[") > MAX_DEPTH:
        _check_storable(payload)
    unknown = sorted(set(payload) - {"body", "callback"})
    if unknown:
        raise errors.invalid(unknown[0][:100], "unknown field")
    if not isinstance(payload.get("body"), dict):
        raise errors.invalid("body", "required, and must be a JSON object")
    return payload


def _check_storable(payload: dict[str, Any]) -> None:
    """Refuses what cannot be stored or re-encoded: NUL characters (jsonb refuses them) and
    nesting deeper than MAX_DEPTH. Iterative, so a hostile document cannot exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(payload, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                raise errors.invalid(path[:200], "text may not contain NUL (\\u0000)")
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_DEPTH:
            raise errors.invalid(path[:200], f"nested deeper than {MAX_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and "\x00" in key:
                raise errors.invalid(path[:200], "keys may not contain NUL (\\u0000)")
            stack.append((item, f"{path}/{key}" if path else str(key), depth + 1))


def _idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is not None and not (0 < len(key) <= MAX_IDEMPOTENCY_KEY):
        raise errors.invalid("Idempotency-Key", f"1 to {MAX_IDEMPOTENCY_KEY} characters")
    return key


def _ok(data: dict[str, Any], status: int) -> Json:
    return Json({"status": "success", "data": data}, status_code=status)


# How API tools chain a create to the poll of the task it made (OpenAPI links).
_POLL_LINK = {
    "operationId": "poll",
    "parameters": {"service": "$request.path.service", "task_id": "$response.body#/data/taskId"},
}
_CREATE_DOC: dict[str, Any] = {
    "status_code": 201,
    "response_model": api_models.CreatedEnvelope,
    "responses": {
        201: {"links": {"poll": _POLL_LINK}},
        200: {
            "model": api_models.CreatedEnvelope,
            "description": "Idempotent repeat",
            "links": {"poll": _POLL_LINK},
        },
        **api_models.error_responses(400, 403, 404, 413, 429, 431, 503),
    },
    "openapi_extra": {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": api_models.inline_schema(api_models.CreateTask)}
            },
        },
        "parameters": [
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "schema": {"type": "string", "maxLength": MAX_IDEMPOTENCY_KEY},
                "description": "Repeats within 24 h return the same taskId with 200",
            }
        ],
    },
}


@router.post("/v1/services/{service}/tasks", summary="Create a task", **_CREATE_DOC)
@router.post("/v1/services/{service}/tasks/", include_in_schema=False, **_CREATE_DOC)
async def create(service: str, request: Request) -> Json:
    rt = runtime(request)
    client_id = await _client(request, rt)
    access = await _access(rt, client_id, service)
    if access is None:
        raise errors.ApiError(errors.SERVICE_NOT_FOUND)
    if not access.granted:
        raise errors.ApiError(errors.FORBIDDEN)
    payload = _parse(
        await _read_body(request, rt.settings.max_body_bytes), request.headers.get("content-type")
    )
    key = _idempotency_key(request)
    callback = None
    if payload.get("callback") is not None:
        try:
            callback = await check_callback(payload["callback"], rt.policy)
        except CallbackRefused as exc:
            raise errors.invalid("callback.url", str(exc)) from None
    schema_errors = rt.schemas.errors(access.service, payload["body"])
    if schema_errors:
        raise errors.ApiError(errors.SCHEMA_INVALID, schema_errors)
    accepted = await create_task(
        rt.pool, NewTask(client_id, access, payload["body"], callback, key), rt.intake
    )
    if accepted.created and accepted.outbox_id is not None:
        metrics.SUBMITTED.labels(service=service).inc()
        submission = submission_for(
            accepted.task_id, access.service, payload["body"], request.headers.get("traceparent")
        )
        await rt.outbox.publish_now(accepted.outbox_id, submission, access.service.queue_name)
    data = {"taskId": str(accepted.task_id), "taskPosition": accepted.position}
    return _ok(data, 201 if accepted.created else 200)


@router.get(
    "/v1/services/{service}/tasks/{task_id}",
    summary="Poll a task",
    operation_id="poll",
    response_model=api_models.TaskEnvelope,
    responses=api_models.error_responses(403, 404, 431, 503),
)
async def poll(service: str, task_id: str, request: Request) -> Json:
    rt = runtime(request)
    client_id = await _client(request, rt)
    access = await _access(rt, client_id, service)
    if access is None:
        raise errors.ApiError(errors.SERVICE_NOT_FOUND)
    if not access.granted:
        raise errors.ApiError(errors.FORBIDDEN)
    try:
        parsed = uuid.UUID(task_id)
    except ValueError:
        raise errors.ApiError(errors.TASK_NOT_FOUND) from None
    return _ok(await get_task(rt.pool, client_id, service, parsed), 200)


def database_down(exc: Exception) -> bool:
    return isinstance(exc, (OperationalError, *pgpool.CONNECTION_ERRORS)) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated
    )
