"""The FastAPI application: routes, the error envelope everywhere, health and metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conveyor import envelope, heap, tracing
from conveyor.settings import GatewaySettings
from gateway import admin_api, api, api_docs, dashboard, errors, metrics, pgpool, schema
from gateway.responses import Json
from gateway.runtime import Runtime

log = logging.getLogger("conveyor.gateway.api")

_AUTH_HEADERS = {"WWW-Authenticate": 'Basic realm="conveyor"'}
# The HTTP server (httptools) bounds neither a header's size nor their number.
MAX_HEADER_BYTES = 64 * 1024
# How long a process's shutdown may take (its loops get STOP_PATIENCE of it).
SHUTDOWN_PATIENCE = 20.0
HEADERS_TOO_LARGE = errors.ErrorKind(431, 431001, "Request header fields too large.")


async def _take_over(rt: Runtime, loops_later: Callable[[], Awaitable[None]]) -> None:
    await loops_later()
    log.info("this process runs the background loops now")
    rt.start_background()


def create_app(
    settings: GatewaySettings | None = None,
    background: bool = True,
    server: bool = False,
    loops_later: Callable[[], Awaitable[None]] | None = None,
    api_routes: bool = True,
) -> FastAPI:
    """`server`: this app is its process's whole life (`conveyor gateway`), so what it loaded
    at start is frozen out of the cyclic collector (`conveyor.heap`); an app made in a test
    process is not. `loops_later`, without `background`: returns when this process is to
    run the background loops after all (a worker of `--workers` that took them over).
    Without `api_routes` (`--only-background`), it answers the probes and /metrics only."""
    settings = settings or GatewaySettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tracing.configure("conveyor-gateway")  # nothing unless an OTLP endpoint is set
        rt = Runtime(settings)
        app.state.runtime = rt
        await rt.start(background=background)
        taking_over = None
        if loops_later is not None and not background:
            taking_over = asyncio.create_task(_take_over(rt, loops_later))
        if server:
            log.info("serving", extra={"frozen": heap.serve(metrics.GC_PAUSES)})
        try:
            yield
        finally:
            if taking_over is not None:
                taking_over.cancel()
                await asyncio.gather(taking_over, return_exceptions=True)
            try:
                # A process whose shutdown hangs keeps its port's workers and the loops' lock
                # (gateway/workers.py): past this it ends anyway; the relay and the notifier's
                # leases cover what it left undone.
                async with asyncio.timeout(SHUTDOWN_PATIENCE):
                    await rt.stop()
            except TimeoutError:
                log.warning("shutdown not finished in time; ending the process anyway")
            if tracing.enabled:
                await asyncio.to_thread(tracing.shutdown)  # the last spans are exported

    app = FastAPI(
        title="Conveyor gateway",
        version="1",
        description="Submit tasks to asynchronous functions and follow them. "
        "Authentication: HTTP Basic with your clientId and clientSecret.",
        lifespan=lifespan,
        default_response_class=Json,
        docs_url=None,  # gateway.api_docs: its files from this process, not from a CDN
        openapi_url=None,  # gateway.api_docs too: a route of the table, counted as itself
        swagger_ui_oauth2_redirect_url=None,
    )
    if api_routes:
        app.include_router(api_docs.router)
        app.include_router(api.router)
        app.include_router(admin_api.router)
        app.include_router(dashboard.router)
    _add_operations(app)
    _add_error_handlers(app)
    app.add_middleware(_Measure)
    app.add_middleware(_HeaderLimit)
    app.openapi = lambda: _openapi_without_422(app)  # type: ignore[method-assign]
    return app


def _openapi_without_422(app: FastAPI) -> dict:
    """FastAPI documents a 422 on every route with parameters; this API answers 400002
    instead and never sends a 422, so the documented responses are the real ones. And the
    security scheme every `/v1/` call takes."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        # Every API call takes HTTP Basic (checked in the routes, not by a FastAPI security
        # dependency, so that every failure is the one 403): said here for generated clients.
        schema.setdefault("components", {})["securitySchemes"] = {
            "basic": {
                "type": "http",
                "scheme": "basic",
                "description": "a client id and secret; an operator's on /v1/admin",
            }
        }
        for route, item in schema.get("paths", {}).items():
            if route.startswith("/v1/"):
                for operation in item.values():
                    operation["security"] = [{"basic": []}]
        app.openapi_schema = schema
    return app.openapi_schema


class _HeaderLimit:
    """Answers 431 in the error envelope when the request's headers exceed MAX_HEADER_BYTES."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) for name, value in scope["headers"])
            if size > MAX_HEADER_BYTES:
                await _error_response(errors.ApiError(HEADERS_TOO_LARGE))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error_response(exc: errors.ApiError) -> Json:
    headers = dict(exc.headers)
    if exc.kind is errors.FORBIDDEN:
        headers.update(_AUTH_HEADERS)
    return Json(exc.envelope(), status_code=exc.kind.http_status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.ApiError)
    async def api_error(_: Request, exc: errors.ApiError) -> Json:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, exc: RequestValidationError) -> Json:
        found = [
            {"path": "/".join(str(p) for p in e.get("loc", ())), "message": str(e.get("msg"))[:200]}
            for e in exc.errors()[:20]
        ]
        return _error_response(errors.ApiError(errors.INVALID_REQUEST, found))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Json:
        kind = {404: errors.NOT_FOUND, 405: errors.METHOD_NOT_ALLOWED}.get(
            exc.status_code, errors.INVALID_REQUEST
        )
        return _error_response(errors.ApiError(kind, headers=dict(exc.headers or {})))

    async def database_away(_: Request, exc: Exception) -> Json:
        """The database down, frozen or cut off: 503 and a warning, no traceback. Registered
        by class so that Starlette does not re-raise it, as it does what the catch-all
        handler answers (uvicorn then logged each one as an error in the application)."""
        log.warning("database unavailable", extra={"error": exc.__class__.__name__})
        return _error_response(errors.ApiError(errors.UNAVAILABLE, headers=dict(errors.RETRY_SOON)))

    # A server that takes no writes (a standby not promoted yet, a database made read-only)
    # cannot store a task either: the same 503, not a 500 with a traceback (found by a sweep).
    for kind in (*pgpool.CONNECTION_ERRORS, psycopg.errors.ReadOnlySqlTransaction):
        app.add_exception_handler(kind, database_away)

    async def schema_missing(_: Request, exc: Exception) -> Json:
        """A table or column this code needs is not there: `conveyor db upgrade` has not run
        (yet). The client is told to come back, the log says what to run."""
        log.error(
            f"the database lacks this gateway's schema: {schema.UPGRADE}",
            extra={"error": exc.__class__.__name__},
        )
        return _error_response(errors.ApiError(errors.UNAVAILABLE, headers=dict(errors.RETRY_SOON)))

    for missing in schema.MISSING:
        app.add_exception_handler(missing, schema_missing)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_: Request, exc: ClientDisconnect) -> Response:
        """Closed before the end of its body (or dropped for its slowness): nobody reads an
        answer, and it is no error of this gateway's."""
        return Response(status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Json:
        log.exception("unexpected error")
        return _error_response(errors.ApiError(errors.INTERNAL))


def _add_operations(app: FastAPI) -> None:
    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> Json:
        return Json(envelope.probe({"alive": True, "process": os.getpid()}))

    @app.get("/readyz", include_in_schema=False)
    async def readyz(request: Request) -> Json:
        """Every check (SPEC §3.4), or all but those named by `exclude` (as kube-apiserver's
        `/readyz?exclude=etcd`): a broker outage takes every replica out of readiness while
        each still accepts tasks into the outbox, so the Service's probe excludes the broker
        (keda/gateway), and consumers keep being answered. Excluded checks are still shown."""
        runtime = request.app.state.runtime
        checks = await runtime.ready()
        excluded = set(request.query_params.getlist("exclude"))
        ok = all(passed for name, passed in checks.items() if name not in excluded)
        details = {k: v for k, v in runtime.problems().items() if v}
        data = {
            "ready": ok,
            "checks": checks,
            "background": runtime.background,  # this process runs the loops
            "process": os.getpid(),  # which of `--workers` answered
            **details,
        }
        return Json(envelope.probe(data, ok), status_code=200 if ok else 503)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        metrics.forget_dead_workers()
        return Response(generate_latest(metrics.EXPOSED), media_type=CONTENT_TYPE_LATEST)


class _Measure:
    """Latency and answer counts per route, as a plain ASGI middleware.

    Starlette's `BaseHTTPMiddleware` (`app.middleware("http")`) runs the rest of
    the app in a task group with memory streams for every request; this only
    watches `http.response.start` go by.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # unless a response starts: an exception escaped the app

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self._observe(_route_label(scope), status, started)

    def _observe(self, route: str, status: int, started: float) -> None:
        metrics.child(metrics.LATENCY, route).observe(time.perf_counter() - started)
        metrics.child(metrics.REQUESTS, route, str(status)).inc()


UNMATCHED = "unmatched"


def _route_label(scope: Scope) -> str:
    """The matched route's template, e.g. `/v1/services/{service}/tasks`: one label per route,
    never the raw path (a label per task id or per scanner's guess would grow the registry
    without bound). Requests no route took (404s, 431s refused before routing) share
    UNMATCHED, as does a router entry without a template of its own (FastAPI's included
    router node, should a request stop there)."""
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) and path.startswith("/") else UNMATCHED
