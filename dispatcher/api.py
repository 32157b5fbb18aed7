"""The dispatcher's local HTTP API, served by aiohttp inside the dispatcher's loop.

On `127.0.0.1:DISPATCHER_PORT` only (the function is in the same pod; nothing
else has any business posting progress):

* `POST /tasks/{taskId}/progress/{token}` with `{"progress": 42.5}` -> 204, the URL the
  function is given: the token is its attempt's, so a call a dead dispatcher left running
  reports to no later attempt (404 for a task not in flight here or an attempt that is over,
  400 for anything but a finite 0..100); `POST /tasks/{taskId}/progress` for a function that
  builds the URL itself: the task's running attempt takes it
* `GET /healthz` 200 while the process loop runs (it answers, so it runs)
* `GET /readyz` 200 when connected to the broker, the function is reachable
  and the dispatcher is not shutting down; 503 otherwise, with the details
* `GET /metrics` Prometheus text format

With `METRICS_PORT`, the probes and metrics (not the progress endpoint) are also
served on every address (IPv6 and IPv4), `METRICS_PORT`, for the kubelet and Prometheus.

With `PROGRESS_PORT` (knative mode: the function runs in another pod), the progress
endpoint alone is also served on every address, `PROGRESS_PORT`, as
`POST /tasks/{taskId}/progress/{token}`, where the token is the attempt's (SPEC §11.5):
`X-Conveyor-Progress-Url` is then that absolute URL on `POD_IP`.

A request must arrive whole within `REQUEST_READ_TIMEOUT` of its connection or of the answer
before it (aiohttp's keep-alive timer runs from the connection on, and a body is read under
that deadline): a caller that connects and sends nothing, or trickles its request, held its
connection and a descriptor for an hour, so thousands of them could exhaust the pod's.

aiohttp serves it because the sidecar loads aiohttp for its calls anyway
(invoker.py): a second HTTP stack (Starlette, uvicorn, anyio) would only cost
memory. Its signal handling is off: the dispatcher owns SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from conveyor import envelope, strict_json
from dispatcher.metrics import Metrics
from dispatcher.progress import ProgressBoard

log = logging.getLogger(__name__)

MAX_PROGRESS_BODY = 64 * 1024
ReadinessCheck = Callable[[], Awaitable[dict[str, bool]]]


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=strict_json.dumps(payload), status=status, content_type="application/json"
    )


def _error(
    status: int, number: int, description: str, errors: list[dict[str, str]] | None = None
) -> web.Response:
    return _json(envelope.error(number, description, errors), status)


def _invalid(message: str) -> web.Response:
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
    try:
        value = float(value)
    except OverflowError:
        # JSON allows an integer of any length: one too big for a float is still a finite
        # number, clamped as below (it answered 500).
        return 100.0 if value > 0 else 0.0
    if not math.isfinite(value):
        return "progress must be a finite number"
    # Clamped as the task's lifecycle clamps it (SPEC §6.4): a function that overshoots by
    # rounding (100.4, -0.0001) keeps its update.
    return min(100.0, max(0.0, value))


class Endpoints:
    def __init__(
        self,
        board: ProgressBoard,
        metrics: Metrics,
        readiness: ReadinessCheck,
        read_timeout: float,
    ) -> None:
        self.board = board
        self.metrics = metrics
        self.readiness = readiness
        self.read_timeout = read_timeout

    async def progress(self, request: web.Request) -> web.Response:
        """On loopback. With the attempt's token (the URL the function is given), a report
        of an attempt that is over is 404, as one of a task that is not here; without one
        (a URL a function built itself), the task's running attempt takes it."""
        try:
            task_id = str(uuid.UUID(request.match_info["task_id"]))
        except ValueError:
            task_id = ""
        token = request.match_info.get("token")
        if task_id not in self.board or (
            token is not None and not self.board.allows(task_id, token)
        ):
            return _error(404, 404002, "Task not found.")
        return await self._report(request, task_id)

    async def remote_progress(self, request: web.Request) -> web.Response:
        """The same report from another pod (knative mode): only with the attempt's token,
        and one identical 403 for every refusal, so that nothing about other tasks leaks."""
        try:
            task_id = str(uuid.UUID(request.match_info["task_id"]))
        except ValueError:
            return _error(403, 403001, "Forbidden.")
        if not self.board.allows(task_id, request.match_info["token"]):
            return _error(403, 403001, "Forbidden.")
        return await self._report(request, task_id, remote=True)

    async def _report(
        self, request: web.Request, task_id: str, remote: bool = False
    ) -> web.Response:
        raw = b""
        try:
            async with asyncio.timeout(self.read_timeout):
                async for chunk in request.content.iter_any():
                    raw += chunk
                    if len(raw) > MAX_PROGRESS_BODY:
                        return _error(413, 413001, "Request too large.")
        except (ConnectionError, web.RequestPayloadError, TimeoutError) as exc:
            # The caller left mid-body, or its body's framing is not HTTP: its doing, not
            # ours, so no ERROR with a traceback (aiohttp's log for a handler's exception).
            reason = str(exc) or type(exc).__name__
            log.info(
                "progress report not received whole", extra={"task_id": task_id, "reason": reason}
            )
            return _invalid("the body was not received whole")
        value = parse_progress(raw)
        if isinstance(value, str):
            return _invalid(value)
        if not self.board.report(task_id, value):  # the attempt ended while the body came
            if remote:  # as for any token that is no longer good: nothing about the task leaks
                return _error(403, 403001, "Forbidden.")
            return _error(404, 404002, "Task not found.")
        return web.Response(status=204)

    async def healthz(self, request: web.Request) -> web.Response:
        return _json(envelope.probe({"alive": True}))

    async def readyz(self, request: web.Request) -> web.Response:
        checks = await self.readiness()
        ready = all(checks.values())
        return _json(
            envelope.probe({"ready": ready, "checks": checks}, ready), 200 if ready else 503
        )

    async def metrics_text(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    def probe_routes(self) -> list[web.RouteDef]:
        return [
            web.get("/healthz", self.healthz, allow_head=False),
            web.get("/readyz", self.readyz, allow_head=False),
            web.get("/metrics", self.metrics_text, allow_head=False),
        ]

    def local_app(self) -> web.Application:
        return _app(
            [
                web.post("/tasks/{task_id}/progress", self.progress),
                web.post("/tasks/{task_id}/progress/{token}", self.progress),
                *self.probe_routes(),
            ]
        )

    def probe_app(self) -> web.Application:
        return _app(self.probe_routes())

    def remote_progress_app(self) -> web.Application:
        """Knative mode's progress endpoint on the pod's IP: that route alone."""
        return _app([web.post("/tasks/{task_id}/progress/{token}", self.remote_progress)])


@web.middleware
async def _unmatched_in_envelope(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The router's own 404 and 405 (plain text) in the SPEC §3 envelope, as the gateway
    answers them: a caller reads one format whichever port it reached. 405 keeps `Allow`."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        refused = _error(405, 405000, "Method not allowed.")
        refused.headers["Allow"] = exc.headers["Allow"]
        return refused
    except web.HTTPNotFound:
        return _error(404, 404000, "Not found.")


@web.middleware
async def _closing_when_the_body_is_left(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """An answer given before its request's body was read whole (a refusal: a task not here,
    a body too large) says `Connection: close`, as the connection then closes (`lingering_time`
    0, below): without it, a client that sent its next request on that connection at once lost
    it to the close (httpx.ReadError, seen in CI)."""
    answer = await handler(request)
    if request.body_exists and not request.content.is_eof():
        answer.force_close()
    return answer


def _app(routes: list[web.RouteDef]) -> web.Application:
    app = web.Application(middlewares=[_closing_when_the_body_is_left, _unmatched_in_envelope])
    app.add_routes(routes)
    return app


class _ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log, with a request it could not parse (it answers 400 itself)
    said at debug without a traceback, like aiohttp's own non-HTTP bytes: a caller's
    doing, and PROGRESS_PORT listens on the pod's IP. Any other exception, a handler's
    bug, is still an ERROR with its traceback."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            reason = exc_info.message.partition("\n")[0] or type(exc_info).__name__
            self.debug(f"{msg}: %s", *args, reason)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


EVERY_ADDRESS = ""  # a server the pod's other containers and pods reach


def _listening(host: str, port: int) -> socket.socket:
    """`EVERY_ADDRESS`: IPv6 and IPv4 where the kernel has both (a pod's IP may be either:
    progress posted to an IPv6 POD_IP was refused by a socket listening on IPv4 alone)."""
    if host != EVERY_ADDRESS:  # one address (POD_IP: either family)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=128)
    if socket.has_dualstack_ipv6():
        return socket.create_server(
            ("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128
        )
    return socket.create_server(("0.0.0.0", port), backlog=128)


class ApiServer:
    """One aiohttp server on a socket bound up front, so a busy port fails clearly."""

    def __init__(self, app: web.Application, host: str, port: int, read_timeout: float) -> None:
        self.host = host
        self.port = port
        self._socket = _listening(host, port)
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=1.0,
            logger=_ServerLog(logging.getLogger("aiohttp.server")),
            # A body the handler left unread (a refused report) is not read afterwards to keep
            # the connection: the connection closes. Read, a body that does not decode (a lying
            # Content-Encoding) was an ERROR with a traceback per request, anyone's at will.
            lingering_time=0,
            # From the connection on (aiohttp 3.14.4+), and after each answer: a request's head
            # must arrive within it. The handler reads a body within it too.
            keepalive_timeout=read_timeout,
        )
        self._started = False

    async def start(self) -> None:
        await self._runner.setup()
        await web.SockSite(self._runner, self._socket, shutdown_timeout=1.0).start()
        self._started = True

    async def stop(self) -> None:
        if self._started:
            await self._runner.cleanup()
        self._socket.close()
