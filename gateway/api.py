"""The consumer API (SPEC §3): create and poll tasks.

Checks run in the order the SPEC gives, cheapest first, and stop at the first
failure: credentials (403001), service (404001), grant (403001), size
(413001), shape (400002: JSON, a `body` object), JSON Schema (400001), callback
and time (400002), capacity (429001/429002).
The body is read by hand so that a huge or hostile body is refused before it
is parsed, and so that every refusal carries the seed's error envelope.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import anyio
from fastapi import APIRouter, Request
from fastapi.routing import APIRoute
from sse_starlette import EventSourceResponse
from starlette.responses import Response

from conveyor import envelope, rfc3339, strict_json, tracing
from conveyor import headers as h
from gateway import api_models, catalog, errors, metrics, store
from gateway.auth import Authenticator
from gateway.callbacks import CallbackRefused, check_callback
from gateway.cancel import cancel_task
from gateway.outbox import submission_for
from gateway.responses import Json
from gateway.runtime import Runtime
from gateway.store import (
    Accepted,
    NewTask,
    create_task,
    create_tasks,
    get_task,
    task_status,
    time_to_live,
)
from gateway.task_events import TERMINAL, has_the_end


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
# Deeper documents overflow recursive JSON encoders downstream (json, orjson: 254).
MAX_DEPTH = 128
# A stopping server lets its event streams end on their own (uvicorn waits 5 s in all).
STREAM_STOP_GRACE = 2.0
_JSON_TYPES = ("application/json", "application/cloudevents+json")
# Bytes that may hold what jsonb refuses: an escaped NUL, a surrogate escaped or encoded.
# Searched in the bytes as sent, so only bytes the reader takes as UTF-8 are let through.
_SUSPECT = re.compile(rb"\\u0000|\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_UTF8 = ("utf-8", "utf-8-sig")  # json.detect_encoding's names; a UTF-8 byte order mark is read


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def authenticated(request: Request, auth: Authenticator) -> str:
    """The caller's id for this authenticator (clients, or operators), or the one 403001
    every authentication failure gets."""
    source = request.client.host if request.client else ""
    # Two credentials are malformed ones: which a proxy or a server honours differs (the
    # first was taken, so a request naming two clients was served as one of them).
    given = request.headers.getlist("authorization")
    found = await auth.authenticate(given[0] if len(given) == 1 else None, source)
    if found is None:
        metrics.AUTH_FAILURES.inc()
        raise errors.ApiError(errors.FORBIDDEN)
    return found


async def _access(rt: Runtime, client_id: str, service: str) -> catalog.Access | None:
    if len(service) > MAX_SERVICE_NAME or "\x00" in service:  # PostgreSQL text refuses NUL
        return None
    return await rt.access.access(client_id, service)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, up to `limit` bytes (413001 past it). The gateway decodes no
    `Content-Encoding`: one was ignored, a compressed body then refused as malformed JSON
    and a plain one labelled gzip taken as it was; it is refused by name."""
    for coding in request.headers.getlist("content-encoding"):
        if any(part.strip().lower() not in ("", "identity") for part in coding.split(",")):
            raise errors.invalid("Content-Encoding", "not supported: send the body as it is")
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


def _content_type(request: Request) -> str | None:
    """The request's one Content-Type. Two, even alike, are refused as a wrong one is: which
    a proxy or a server honours differs (the first was taken, `text/plain` second or not)."""
    given = request.headers.getlist("content-type")
    if len(given) > 1:
        raise errors.invalid("Content-Type", "must be given once, as application/json")
    return given[0] if given else None


def _parse(raw: bytes, content_type: str | None, items_below: int = 0) -> dict[str, Any]:
    """The request as a JSON object, refused before anything else if it is not one.
    `items_below`: how many levels below the root its tasks sit (a batch's: `tasks`, then
    the index), so that a task may nest as deep in a batch as alone."""
    media = (content_type or "application/json").split(";")[0].strip().lower()
    if media not in _JSON_TYPES and not media.endswith("+json"):
        raise errors.invalid("Content-Type", "must be application/json")
    if json.detect_encoding(raw) not in _UTF8:  # the stdlib would read UTF-16 or UTF-32
        raise errors.invalid("", "malformed JSON: not UTF-8 (RFC 8259 §8.1)")
    try:
        payload = strict_json.loads(raw)  # refuses NaN/Infinity, invalid UTF-8, deep nesting
    except strict_json.NotJson as exc:
        raise errors.invalid("", f"malformed JSON: {str(exc)[:200]}") from None
    if not isinstance(payload, dict):
        raise errors.invalid("", "the request must be a JSON object")
    if _SUSPECT.search(raw) or raw.count(b"{") + raw.count(b"[") > MAX_DEPTH:
        _check_storable(payload, first_depth=1 - items_below)
    return payload


def _check_item(item: Any, where: str = "") -> dict[str, Any]:
    """One task's part of a request: `body` (an object) before anything else, since the
    schema reads it; its other fields are checked after the schema (`_check_fields`)."""
    if not isinstance(item, dict):
        raise errors.invalid(where.rstrip("/"), "must be a JSON object")
    if not isinstance(item.get("body"), dict):
        raise errors.invalid(where + "body", "required, and must be a JSON object")
    return item


def _check_fields(item: dict[str, Any], where: str) -> None:
    """Besides `body`: an optional `callback` and an optional time to wait for
    (`notBefore` or `delaySeconds`), nothing else."""
    unknown = sorted(set(item) - {"body", "callback", "notBefore", "delaySeconds"})
    if unknown:
        raise errors.invalid(where + unknown[0][:100], "unknown field")


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "may not contain NUL (\\u0000)"
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            return "may not contain lone surrogates (\\ud800-\\udfff)"
    return None


def _check_storable(payload: dict[str, Any], first_depth: int = 1) -> None:
    """Refuses what cannot be stored or re-encoded: NUL characters and lone surrogates (jsonb
    refuses both) and nesting deeper than MAX_DEPTH. Iterative, so a hostile document cannot
    exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(payload, "", first_depth)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if problem := _text_problem(value):
                raise errors.invalid(path[:200], f"text {problem}")
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_DEPTH:
            raise errors.invalid(path[:200], f"nested deeper than {MAX_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and (problem := _text_problem(key)):
                raise errors.invalid(path[:200], f"keys {problem}")
            stack.append((item, f"{path}/{key}" if path else str(key), depth + 1))


def _idempotency_key(request: Request) -> str | None:
    """The key, or None. Given on two header lines, it is refused: a proxy may join them
    into one (RFC 9110 §5.3), and which task a retry finds would then depend on the path.
    Its length is counted in bytes (HTTP header values are bytes; Starlette reads them as
    Latin-1). Spaces and tabs around it are not part of it (RFC 9110 §5.5): the server
    dropped those before it only, so `k ` made another task than `k`."""
    keys = request.headers.getlist("idempotency-key")
    if len(keys) > 1:
        raise errors.invalid("Idempotency-Key", "given more than once")
    key = keys[0].strip(" \t") if keys else None
    if key is not None and not (0 < len(key) <= h.MAX_IDEMPOTENCY_KEY):
        raise errors.invalid("Idempotency-Key", f"1 to {h.MAX_IDEMPOTENCY_KEY} bytes")
    return key


def _ok(data: dict[str, Any], status: int) -> Json:
    return Json(envelope.success(data), status_code=status)


# How API tools chain a create to the poll of the task it made (OpenAPI links).
_POLL_LINK = {
    "operationId": "poll",
    "parameters": {"service": "$request.path.service", "task_id": "$response.body#/data/taskId"},
}
_LOCATION = {
    "Location": {"description": "The task's poll URL (a path)", "schema": {"type": "string"}}
}
_CREATE_DOC: dict[str, Any] = {
    "status_code": 201,
    "response_model": api_models.CreatedEnvelope,
    "responses": {
        201: {"links": {"poll": _POLL_LINK}, "headers": _LOCATION},
        200: {
            "model": api_models.CreatedEnvelope,
            "description": "Idempotent repeat",
            "links": {"poll": _POLL_LINK},
            "headers": _LOCATION,
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
                "schema": {"type": "string", "maxLength": h.MAX_IDEMPOTENCY_KEY},
                "description": "Repeats within 24 h return the same taskId with 200",
            }
        ],
    },
}


_BATCH_DOC: dict[str, Any] = {
    "status_code": 201,
    "response_model": api_models.BatchEnvelope,
    "responses": {
        200: {"model": api_models.BatchEnvelope, "description": "Idempotent repeat"},
        **api_models.error_responses(400, 403, 404, 413, 429, 431, 503),
    },
    "openapi_extra": {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": api_models.inline_schema(api_models.CreateBatch)}
            },
        },
        "parameters": _CREATE_DOC["openapi_extra"]["parameters"],
    },
}


@router.post("/v1/services/{service}/tasks", summary="Create a task", **_CREATE_DOC)
@router.post("/v1/services/{service}/tasks/", include_in_schema=False, **_CREATE_DOC)
async def create(service: str, request: Request) -> Json:
    rt = runtime(request)
    incoming = tracing.checked(request.headers.get(h.TRACEPARENT))
    with tracing.span("submit", incoming, {"conveyor.service": service}, kind="server"):
        trace = tracing.current() or incoming
        client_id, access = await _granted(request, rt, service)
        payload = _check_item(
            _parse(
                await _read_body(request, rt.settings.max_body_bytes),
                _content_type(request),
            )
        )
        key = _idempotency_key(request)
        fingerprint = store.fingerprint(["task", _request_of(payload)]) if key else None
        try:
            new = await _new_task(
                rt, client_id, access, payload, key, trace, fingerprint=fingerprint
            )
        except errors.ApiError as refusal:
            if key is None:
                raise
            try:
                found = await store.earlier_request(rt.pool, client_id, access, key, fingerprint)
            except store.KeyReused:
                raise refusal from None
            if found is None:
                raise
            accepted = found[0]
        else:
            stored = time.perf_counter()
            accepted = await create_task(rt.pool, new, rt.intake.insert, rt.settings.outbox_grace)
            metrics.child(metrics.SUBMIT_PHASES, "store").observe(time.perf_counter() - stored)
            await _publish(rt, [(new, accepted)])
        task_id = str(accepted.task_id)
        tracing.annotate("conveyor.task_id", task_id)
        data = {"taskId": task_id, "taskPosition": accepted.position}
        answer = _ok(data, 201 if accepted.created else 200)
        # Where the task is polled (RFC 9110 §15.3.2), on a repeat as on the first answer.
        answer.headers["location"] = f"/v1/services/{quote(service, safe='')}/tasks/{task_id}"
        return answer


@router.post("/v1/services/{service}/tasks/batch", summary="Create many tasks", **_BATCH_DOC)
@router.post("/v1/services/{service}/tasks/batch/", include_in_schema=False, **_BATCH_DOC)
async def create_batch(service: str, request: Request) -> Json:
    """All or nothing: one transaction, one insert, capacity counted for the whole batch.
    The request is a `submit-batch` span; each task begins a trace of its own, linked to it."""
    rt = runtime(request)
    incoming = tracing.checked(request.headers.get(h.TRACEPARENT))
    with tracing.span("submit-batch", incoming, {"conveyor.service": service}, kind="server"):
        return await _create_batch(service, request, rt, tracing.current() or incoming)


async def _create_batch(service: str, request: Request, rt: Runtime, trace: str | None) -> Json:
    client_id, access = await _granted(request, rt, service)
    raw = await _read_body(request, rt.settings.max_batch_bytes)
    payload = _parse(raw, _content_type(request), items_below=2)
    unknown = sorted(set(payload) - {"tasks"})
    if unknown:
        raise errors.invalid(unknown[0][:100], "unknown field")
    items = payload.get("tasks")
    limit = rt.settings.max_batch_items
    if not isinstance(items, list) or not 1 <= len(items) <= limit:
        raise errors.invalid("tasks", f"required: a list of 1 to {limit} tasks")
    if len(raw) > rt.settings.max_body_bytes:  # else no item can be over it
        _check_item_sizes(items, rt.settings.max_body_bytes)
    key = _idempotency_key(request)
    # the key is the whole batch's, as is its fingerprint
    fingerprint = (
        store.fingerprint(["batch", [_request_of(item) for item in items]]) if key else None
    )
    checked = await asyncio.gather(
        *(
            _new_task(
                rt,
                client_id,
                access,
                item,
                key and f"{key}\n{i}",
                trace,
                where=f"tasks/{i}/",
                fingerprint=fingerprint,
            )
            for i, item in enumerate(items)
        ),
        return_exceptions=True,
    )
    refused = [c for c in checked if isinstance(c, errors.ApiError)]
    if refused:
        try:
            found = key and await store.earlier_request(
                rt.pool, client_id, access, key, fingerprint, batch_size=len(items)
            )
        except store.KeyReused:
            found = None  # the request's own errors come first
        if not found:
            raise _all_refusals(refused)
        tasks = [{"taskId": str(a.task_id), "taskPosition": a.position} for a in found]
        return _ok({"tasks": tasks}, 200)
    for outcome in checked:
        if isinstance(outcome, BaseException):
            raise outcome
    news = [c for c in checked if isinstance(c, NewTask)]
    roots: list[tracing.Root] = []
    try:
        roots = [tracing.root("submit", trace, {"conveyor.service": service}) for _ in news]
        news = [
            replace(n, traceparent=r.traceparent or n.traceparent)
            for n, r in zip(news, roots, strict=True)
        ]
        stored = time.perf_counter()
        accepted = await create_tasks(rt.pool, news, rt.settings.outbox_grace)
        metrics.child(metrics.SUBMIT_PHASES, "store").observe(time.perf_counter() - stored)
        for made, task in zip(roots, accepted, strict=True):
            made.annotate("conveyor.task_id", str(task.task_id))
        await _publish(rt, list(zip(news, accepted, strict=True)))
    finally:
        for made in roots:
            made.end()
    created = bool(accepted) and accepted[0].created
    tasks = [{"taskId": str(a.task_id), "taskPosition": a.position} for a in accepted]
    return _ok({"tasks": tasks}, 201 if created else 200)


def _check_item_sizes(items: list[Any], limit: int) -> None:
    """Each item obeys the single request's limit (413001), or a batch of one would get
    around it; measured as the item would be sent alone, in compact JSON."""
    for i, item in enumerate(items):
        if len(strict_json.dumps(item)) > limit:
            message = f"larger than {limit} bytes, the limit of one task"
            raise errors.ApiError(errors.TOO_LARGE, [{"path": f"tasks/{i}", "message": message}])


async def _granted(request: Request, rt: Runtime, service: str) -> tuple[str, catalog.Access]:
    """The caller and their access to the service, in the SPEC's order of refusals."""
    client_id = await authenticated(request, rt.auth)
    access = await _access(rt, client_id, service)
    if access is None:
        raise errors.ApiError(errors.SERVICE_NOT_FOUND)
    if not access.granted:
        raise errors.ApiError(errors.FORBIDDEN)
    return client_id, access


async def _new_task(
    rt: Runtime,
    client_id: str,
    access: catalog.Access,
    item: Any,
    key: str | None,
    traceparent: str | None,
    where: str = "",
    fingerprint: bytes | None = None,
) -> NewTask:
    """One task checked in SPEC §3.1's order: its shape (a `body` object), the service's JSON
    Schema (400001), then its other fields, its callback (the SSRF guard) and its time
    (400002)."""
    item = _check_item(item, where)
    schema_errors = rt.schemas.errors(access.service, item["body"])
    if schema_errors:
        for error in schema_errors:
            error["path"] = where + error["path"]
        raise errors.ApiError(errors.SCHEMA_INVALID, schema_errors)
    _check_fields(item, where)
    callback = None
    if item.get("callback") is not None:
        try:
            callback = await check_callback(item["callback"], rt.policy)
        except CallbackRefused as exc:
            raise errors.invalid(where + exc.path, str(exc)) from None
    not_before, delay = _run_at(item, where, rt.settings.max_delay)
    ttl = time_to_live(access.service, rt.settings.pending_ttl)
    return NewTask(
        client_id,
        access,
        item["body"],
        callback,
        key,
        ttl,
        not_before,
        traceparent,
        fingerprint,
        delay=delay,
    )


def _request_of(item: Any) -> Any:
    """What a task's part of a request asks for, as its Idempotency-Key's fingerprint takes it:
    a field given as `null` is the field left out."""
    if not isinstance(item, dict):
        return item
    return {name: value for name, value in item.items() if value is not None}


def _run_at(
    item: dict[str, Any], where: str, max_delay: float
) -> tuple[datetime | None, int | None]:
    """When a task may run (SPEC §11.4): `notBefore` (RFC 3339, with its offset) or
    `delaySeconds`, not both, at most `max_delay` ahead; a time already past is now. A delay
    is counted from the submission's date, on the database's clock as every other date is
    (added to this process's clock, a gateway an hour behind ran them at once)."""
    at, delay = item.get("notBefore"), item.get("delaySeconds")
    if at is None and delay is None:
        return None, None
    if at is not None and delay is not None:
        raise errors.invalid(where + "delaySeconds", "give notBefore or delaySeconds, not both")
    now = datetime.now(UTC)
    if delay is not None:
        if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
            raise errors.invalid(where + "delaySeconds", "must be a whole number of seconds >= 0")
        if delay > max_delay:
            raise errors.invalid(where + "delaySeconds", f"at most {max_delay:.0f} seconds")
        return None, delay
    field = where + "notBefore"
    text = at if isinstance(at, str) else ""  # a number or an object is no time either
    try:  # in UTC: RFC 3339's offsets go to ±23:59, those PostgreSQL takes to ±15:59
        when = rfc3339.parse(text)
    except ValueError:
        raise errors.invalid(
            field, "must be an RFC 3339 date and time with its offset (Z or +hh:mm)"
        ) from None
    except OverflowError:  # before year 1 (a long past time is now) or after 9999, in UTC
        when = now if text.startswith("0001-") else datetime.max.replace(tzinfo=UTC)
    if when > now + timedelta(seconds=max_delay):
        raise errors.invalid(field, f"at most {max_delay:.0f} seconds ahead")
    return when, None


def _all_refusals(refused: list[errors.ApiError]) -> errors.ApiError:
    """A batch's refusals in one answer: 400002 if any item is malformed, else 400001."""
    malformed = [r for r in refused if r.kind is errors.INVALID_REQUEST]
    chosen = malformed or refused
    found = [e for r in chosen for e in r.errors][:100]
    return errors.ApiError(chosen[0].kind, found)


async def _publish(rt: Runtime, done: list[tuple[NewTask, Accepted]]) -> None:
    """The fast path of the outbox, after the commit: the relay retries what fails here."""
    publishes = []
    for new, accepted in done:
        if accepted.created and accepted.row_id is not None and not accepted.delayed:
            service = new.access.service
            metrics.child(metrics.SUBMITTED, service.name).inc()
            assert accepted.expires_at is not None  # a row just inserted has its expiry
            submission = submission_for(
                accepted.task_id, service, new.body, accepted.expires_at, new.traceparent
            )
            publishes.append(rt.outbox.publish_now(accepted.row_id, submission, service.queue_name))
    if publishes:
        started = time.perf_counter()
        await asyncio.gather(*publishes)
        metrics.child(metrics.SUBMIT_PHASES, "publish").observe(time.perf_counter() - started)


@router.get(
    "/v1/services/{service}/tasks/{task_id}",
    summary="Poll a task",
    operation_id="poll",
    response_model=api_models.TaskEnvelope,
    responses=api_models.error_responses(403, 404, 431, 503),
)
@router.get("/v1/services/{service}/tasks/{task_id}/", include_in_schema=False)
async def poll(service: str, task_id: str, request: Request) -> Json:
    rt = runtime(request)
    client_id, _ = await _granted(request, rt, service)
    parsed = _task_uuid(task_id)
    return _ok(await get_task(rt.pool, client_id, service, parsed), 200)


def _task_uuid(task_id: str) -> uuid.UUID:
    """A task id that is no UUID names no task: the same 404002 as an unknown one."""
    try:
        return uuid.UUID(task_id)
    except ValueError:
        raise errors.ApiError(errors.TASK_NOT_FOUND) from None


@router.post(
    "/v1/services/{service}/tasks/{task_id}/cancel",
    summary="Cancel a task",
    response_model=api_models.TaskEnvelope,
    responses=api_models.error_responses(403, 404, 409, 431, 503),
)
@router.post("/v1/services/{service}/tasks/{task_id}/cancel/", include_in_schema=False)
async def cancel(service: str, task_id: str, request: Request) -> Json:
    """PENDING or IN_PROGRESS: FAILURE `Task cancelled.` at once; already cancelled: the same
    answer; finished otherwise: 409001 (gateway.cancel)."""
    rt = runtime(request)
    client_id, access = await _granted(request, rt, service)
    parsed = _task_uuid(task_id)
    data, finished_now = await cancel_task(rt.pool, rt.cancels, client_id, access.service, parsed)
    if finished_now:
        rt.notifier.wake()  # its callback, if it has one
    return _ok(data, 200)


@router.get(
    "/v1/services/{service}/tasks/{task_id}/events",
    summary="Follow a task (Server-Sent Events)",
    response_class=EventSourceResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "`event: task`, increasing `id`, `data`: the poll's data; one event"
            " now, one per change of status or progress, then the end after a terminal state",
        },
        204: {
            "description": "the task has ended and the `Last-Event-ID` sent is its terminal"
            " state's: nothing to send (an EventSource stops reconnecting)"
        },
        **api_models.error_responses(403, 404, 431, 503),
    },
)
@router.get("/v1/services/{service}/tasks/{task_id}/events/", include_in_schema=False)
async def events(service: str, task_id: str, request: Request) -> Response:
    """Errors before the stream starts are the poll's; then the stream (gateway.task_events)."""
    rt = runtime(request)
    client_id, _ = await _granted(request, rt, service)
    parsed = _task_uuid(task_id)
    status = await task_status(rt.pool, client_id, service, parsed)  # 404002 before any stream
    last_event_id = request.headers.get("last-event-id")
    if status in TERMINAL and await has_the_end(rt.pool, str(parsed), last_event_id):
        return Response(status_code=204)  # EventSource: stop reconnecting

    async def read() -> dict[str, Any]:
        # Asked again at every read this stream leads, for all the task's streams (one client,
        # one service, one grant: the access cache's, in memory while it is trusted): a grant
        # revoked or the task gone ends them as the poll refuses it (an ApiError).
        await _granted(request, rt, service)
        return await get_task(rt.pool, client_id, service, parsed)

    async def check() -> None:
        # This stream's own credentials, before each read another stream led: the credential
        # cache's (gateway.auth: in memory, no bcrypt nor database until a change to the
        # secrets is heard), so that a secret changed since ends this stream alone.
        await authenticated(request, rt.auth)

    stopping = anyio.Event()  # set by sse_starlette once the server shuts down
    response = EventSourceResponse(
        rt.task_events.stream(
            str(parsed),
            read,
            check,
            stopping,
            rt.pool,
            last_event_id,
            recheck=rt.settings.stream_heartbeat,
        ),
        ping=rt.settings.stream_heartbeat,
        headers={"Cache-Control": "no-store"},
        shutdown_event=stopping,
        shutdown_grace_period=STREAM_STOP_GRACE,
    )
    # sse_starlette writes `Connection: keep-alive`, the server's hop-by-hop header to write: a
    # stream asked with `Connection: close` answered both.
    del response.headers["connection"]
    return response
