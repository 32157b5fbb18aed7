"""`conveyor inject`: wires the dispatcher into a function's Kubernetes manifest.

A thin command-line shell around `conveyor.inject`, which holds the logic: this
module only reads the input, maps options, and turns `InjectError` into a clear
message on stderr with exit code 2 (never a traceback).
"""

from __future__ import annotations

import sys

import typer

from conveyor.cli.input_files import read_text
from conveyor.inject import InjectError, InjectOptions, Mode, ShutdownMode, inject_yaml


def _read_input(source: str) -> str:
    try:
        return read_text(source)
    except (OSError, UnicodeDecodeError) as exc:
        raise InjectError(f"cannot read {source}: {exc}") from None


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def inject(
    file: str = typer.Option(
        "-", "--file", "-f", help="Deployment, Job or Knative Service YAML; '-' reads stdin."
    ),
    mode: Mode | None = typer.Option(
        None,
        "--mode",
        help="sidecar (Deployment), job (KEDA ScaledJob) or knative; default: from the kind.",
    ),
    container: str | None = typer.Option(
        None, "--container", help="The function's container, when the pod has several."
    ),
    queue: str | None = typer.Option(
        None, "--queue", help="Queue prefix: consumes <queue>-in. Default: the workload's name."
    ),
    concurrency: int | None = typer.Option(
        None, "--concurrency", min=1, help="Tasks in flight per dispatcher (default 4; job: 1)."
    ),
    shutdown_mode: ShutdownMode | None = typer.Option(
        None, "--shutdown-mode", help="On SIGTERM: requeue in-flight tasks, or drain them."
    ),
    drain_timeout: int | None = typer.Option(
        None, "--drain-timeout", min=0, help="Seconds to drain (default 30; job: 600)."
    ),
    image: str | None = typer.Option(None, "--image", help="The dispatcher image."),
    amqp_secret: str | None = typer.Option(
        None,
        "--amqp-secret",
        help="Secret with keys amqp-url (dispatcher) and management-url (KEDA).",
    ),
) -> None:
    """Inject the dispatcher into a function's manifest and add its KEDA objects.

    Writes the result to stdout. Injecting the output again changes nothing.
    """
    options = InjectOptions(
        mode=mode,
        container=container,
        queue=queue,
        concurrency=concurrency,
        shutdown_mode=shutdown_mode,
        drain_timeout=drain_timeout,
        image=image,
        amqp_secret=amqp_secret,
    )
    try:
        text, warnings = inject_yaml(_read_input(file), options)
    except InjectError as exc:
        raise _fail(str(exc)) from None
    for warning in warnings:
        typer.echo(f"warning: {warning}", err=True)
    sys.stdout.write(text)
