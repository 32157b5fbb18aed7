"""The dispatcher's local HTTP API, served by uvicorn inside the dispatcher's loop.

On `127.0.0.1:DISPATCHER_PORT` only (the function is in the same pod; nothing
else has any business posting progress):

* `POST /tasks/{taskId}/progress` with `{"progress": 42.5}` -> 204
  (404 for a task not in flight here, 400 for anything but a finite 0..100)
* `GET /healthz` 200 while the process loop runs (it answers, so it runs)
* `GET /readyz` 200 when connected to the broker, the function is reachable
  and the dispatcher is not shutting down; 503 otherwise, with the details
* `GET /metrics` Prometheus text format

With `METRICS_PORT`, the probes and metrics (not the progress endpoint) are also
served on `0.0.0.0:METRICS_PORT` for the kubelet and Prometheus.

With `PROGRESS_PORT` (knative mode: the function runs in another pod), the progress
endpoint alone is also served on `0.0.0.0:PROGRESS_PORT` as
`POST /tasks/{taskId}/progress/{token}`, where the token is the attempt's (SPEC §11.5):
`X-Conveyor-Progress-Url` is then that absolute URL on `POD_IP`.

uvicorn's own signal handling is disabled: the dispatcher owns SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from conveyor import envelope, strict_json
from dispatcher.metrics import Metrics
from dispatcher.progress import ProgressBoard

log = logging.getLogger(__name__)

MAX_PROGRESS_BODY = 64 * 1024
ReadinessCheck = Callable[[], Awaitable[dict[str, bool]]]


def _error(
    status: int, number: int, description: str, errors: list[dict[str, str]] | None = None
) -> JSONResponse:
    return JSONResponse(envelope.error(number, description, errors), status_code=status)


def _invalid(message: str) -> JSONResponse:
    return _error(
        400, 400002, "Invalid request.", errors=[{"path": "progress", "message": message}]
    )


def parse_progress(raw: bytes) -> float | str:
    """The progress value, or why it is refused."""
    try:
        payload = strict_json.loads(raw)
    except strict_json.NotJson:
        return "body is not JSON"
    if not isinstance(payload, dict) or "progress" not in payload:
        return 'expected {"progress": <number>}'
    value = payload["progress"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "progress must be a number"
    value = float(value)
    if not math.isfinite(value) or not 0.0 <= value <= 100.0:
        return "progress must be between 0 and 100"
    return value


class Endpoints:
    def __init__(self, board: ProgressBoard, metrics: Metrics, readiness: ReadinessCheck) -> None:
        self.board = board
        self.metrics = metrics
        self.readiness = readiness

    async def progress(self, request: Request) -> Response:
        try:
            task_id = str(uuid.UUID(request.path_params["task_id"]))
        except ValueError:
            task_id = ""
        if task_id not in self.board:
            return _error(404, 404002, "Task not found.")
        return await self._report(request, task_id)

    async def remote_progress(self, request: Request) -> Response:
        """The same report from another pod (knative mode): only with the attempt's token,
        and one identical 403 for every refusal, so that nothing about other tasks leaks."""
        try:
            task_id = str(uuid.UUID(request.path_params["task_id"]))
        except ValueError:
            return _error(403, 403001, "Forbidden.")
        if not self.board.allows(task_id, request.path_params["token"]):
            return _error(403, 403001, "Forbidden.")
        return await self._report(request, task_id)

    async def _report(self, request: Request, task_id: str) -> Response:
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_PROGRESS_BODY:
                return _error(413, 413001, "Request too large.")
        value = parse_progress(raw)
        if isinstance(value, str):
            return _invalid(value)
        if not self.board.report(task_id, value):
            return _error(404, 404002, "Task not found.")
        return Response(status_code=204)

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        checks = await self.readiness()
        ready = all(checks.values())
        return JSONResponse(
            {"status": "ready" if ready else "not ready", "checks": checks},
            status_code=200 if ready else 503,
        )

    async def metrics_text(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    def probe_routes(self) -> list[Route]:
        return [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ]

    def local_app(self) -> Starlette:
        progress = Route("/tasks/{task_id}/progress", self.progress, methods=["POST"])
        return Starlette(routes=[progress, *self.probe_routes()])

    def probe_app(self) -> Starlette:
        return Starlette(routes=self.probe_routes())

    def remote_progress_app(self) -> Starlette:
        """Knative mode's progress endpoint on the pod's IP: that route alone."""
        route = Route("/tasks/{task_id}/progress/{token}", self.remote_progress, methods=["POST"])
        return Starlette(routes=[route])


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals belong to the dispatcher (shutdown.py)


class ApiServer:
    """One uvicorn server on a socket bound up front, so a busy port fails clearly."""

    def __init__(self, app: Starlette, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._socket = socket.create_server((host, port), backlog=128)
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            loop="none",
            ws="none",  # no websockets module to import
            timeout_graceful_shutdown=1,
        )
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))

    async def stop(self) -> None:
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=2)
        except TimeoutError:
            self._server.force_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
        self._socket.close()
