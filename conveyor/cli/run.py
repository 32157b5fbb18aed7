"""Long-running commands: `conveyor gateway`, `conveyor dispatcher`, `conveyor purge`."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import typer

from conveyor import logs
from conveyor.dispatcher_settings import MAX_PORT, DispatcherSettings
from conveyor.settings import GatewaySettings

WORKER_HEALTHCHECK_SECONDS = 30


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    uvloop.install()


def gateway(
    host: str = typer.Option("127.0.0.1", help="Address to listen on"),
    port: int = typer.Option(8000),
    workers: int = typer.Option(
        1, min=1, max=64, help="API processes on the port; one of them runs the loops"
    ),
    no_background: bool = typer.Option(False, "--no-background", help="Serve the API only"),
    only_background: bool = typer.Option(
        False,
        "--only-background",
        help="Run relay, result consumer, notifier and reaper only (and /healthz, /readyz, /metrics)",
    ),
) -> None:
    """The consumer API and its background loops."""
    if not 1 <= port <= MAX_PORT:  # uvicorn takes any integer: 85143 listened on 19607
        typer.echo(f"error: --port must be from 1 to {MAX_PORT}, not {port}", err=True)
        raise typer.Exit(2)
    settings = GatewaySettings()
    logs.configure(settings.log_level, settings.log_format)
    if no_background and only_background:
        raise typer.BadParameter("--no-background and --only-background exclude each other")
    if workers > 1 and (no_background or only_background):
        raise typer.BadParameter("--workers runs the loops in one of its workers")
    problem = settings.signing_secret_problem()
    if problem:
        typer.echo(f"error: {problem} (e.g. export it from `openssl rand -hex 32`)", err=True)
        raise typer.Exit(2)
    import uvicorn

    serving: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_config": None,
        "access_log": False,
        "timeout_graceful_shutdown": 5,
        "timeout_keep_alive": settings.keep_alive_timeout,
        "h11_max_incomplete_event_size": 64 * 1024,
        # X-Forwarded-For only from the proxies named: else any caller picks its own source.
        "proxy_headers": bool(settings.forwarded_allow_ips),
        "forwarded_allow_ips": settings.forwarded_allow_ips or None,
        # httptools, each answer in one send (gateway/http_protocol.py)
        "http": "gateway.http_protocol:CoalescingHttpToolsProtocol",
    }
    if workers > 1:
        import tempfile

        from gateway.workers import (
            LOCK_ENV,
            METRICS_ENV,
            SUPERVISOR_ENV,
            see_dead_workers_at_once,
        )

        with tempfile.TemporaryDirectory(prefix="conveyor-gateway-") as folder:
            os.environ[LOCK_ENV] = os.path.join(folder, "loops.lock")
            os.environ[METRICS_ENV] = os.path.join(folder, "metrics")
            os.environ[SUPERVISOR_ENV] = str(os.getpid())
            os.mkdir(os.environ[METRICS_ENV])
            see_dead_workers_at_once()
            uvicorn.run(
                "gateway.workers:worker_app",
                factory=True,
                workers=workers,
                # How long a new worker may take to serve before a SIGHUP restart keeps the
                # old one (uvicorn's default is 5 s; a loaded machine took 5 s to import one),
                # and how long a worker may leave a ping unanswered before it counts as hung.
                timeout_worker_healthcheck=WORKER_HEALTHCHECK_SECONDS,
                **serving,
            )
        return

    from gateway.app import create_app

    _install_uvloop()
    # --only-background answers the probes and /metrics, on the --host given (it listened on
    # 127.0.0.1 whatever was asked, so a kubelet's probes failed, and served the whole API).
    app = create_app(
        settings, background=not no_background, server=True, api_routes=not only_background
    )
    uvicorn.run(app, **serving)


def dispatcher() -> None:
    """The sidecar: queue -> HTTP function bridge, configured by environment (docs/functions.md)."""
    settings = DispatcherSettings.from_env()
    logs.configure(settings.log_level, settings.log_format)
    from dispatcher.main import run

    sys.exit(run(settings))


def purge() -> None:
    """Delete finished tasks past their service's retention, and anything past the hard maximum."""
    settings = GatewaySettings()
    logs.configure(settings.log_level, settings.log_format)
    from gateway.housekeeping import purge as run_purge
    from gateway.pgpool import connect

    async def main() -> None:
        async with await connect(settings.database_url) as conn:
            report = await run_purge(conn, settings.purge_max_age, settings.purge_batch_size)
        typer.echo(
            f"purged {report.finished} finished, {report.ancient} past the maximum age,"
            f" {report.poison} poison messages, in {report.batches} batches"
        )

    asyncio.run(main())
