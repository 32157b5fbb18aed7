"""`conveyor admin ...`: services, clients and grants are data, managed here."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import typer

from conveyor.settings import GatewaySettings

app = typer.Typer(help="Declare services, clients and grants.", no_args_is_help=True)
service_app = typer.Typer(help="Services.", no_args_is_help=True)
client_app = typer.Typer(help="Clients.", no_args_is_help=True)
app.add_typer(service_app, name="service")
app.add_typer(client_app, name="client")

T = TypeVar("T")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _run(action: Callable[[Any], Awaitable[T]]) -> T:
    """Runs `action(conn)` in one transaction; operator errors become clean messages."""
    from gateway.pgpool import connect
    from gateway.platform_file import PlatformError

    async def main() -> T:
        async with await connect(GatewaySettings().database_url) as conn, conn.transaction():
            return await action(conn)

    try:
        return asyncio.run(main())
    except PlatformError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"database unreachable: {exc}")
    raise AssertionError("unreachable")


async def _declare(specs: list[Any]) -> None:
    from conveyor import topology
    from conveyor.connection import connect

    settings = GatewaySettings()
    connection = await connect(
        settings.amqp_url, name="conveyor admin", heartbeat=settings.amqp_heartbeat
    )
    async with connection:
        channel = await connection.channel()
        for spec in specs:
            await topology.declare_service(
                channel, spec.queue, spec.messageFormat, settings.delivery_limit
            )


def _declare_or_fail(specs: list[Any]) -> None:
    try:
        asyncio.run(_declare(specs))
    except Exception as exc:
        _fail(f"could not declare queues on RabbitMQ: {exc}")


@app.command("apply")
def apply_file(
    file: Path = typer.Option(..., "-f", "--file", help="platform.yaml, or - for stdin"),
    declare: bool = typer.Option(True, help="Declare the services' RabbitMQ queues"),
) -> None:
    """Apply a platform file. Idempotent: applying it again changes nothing."""
    from gateway import admin
    from gateway.platform_file import PlatformError, load

    try:
        text = sys.stdin.read() if str(file) == "-" else file.read_text()
        spec = load(text)
    except (OSError, PlatformError) as exc:
        _fail(str(exc))

    changes = _run(lambda conn: admin.apply(conn, spec))
    if declare:
        _declare_or_fail(spec.services)
    for change in changes:
        typer.echo(str(change))


@service_app.command("create")
def service_create(
    name: str,
    queue: str | None = typer.Option(None, help="Queue prefix (default: the name)"),
    capacity: int | None = typer.Option(None),
    schema: Path | None = typer.Option(None, help="JSON Schema file for task bodies"),
    message_format: str = typer.Option("cloudevents", "--format", help="cloudevents or legacy"),
    timeout: int = typer.Option(300, help="taskTimeout in seconds"),
    max_attempts: int = typer.Option(3),
    retention: str = typer.Option("7d"),
) -> None:
    """Create or update one service and declare its queues."""
    from pydantic import ValidationError

    from gateway import admin

    try:
        spec = admin.service_spec(
            name=name,
            queueName=queue,
            capacity=capacity,
            jsonSchema=json.loads(schema.read_text()) if schema else None,
            messageFormat=message_format,
            taskTimeout=timeout,
            maxAttempts=max_attempts,
            retention=retention,
        )
    except (ValidationError, OSError, json.JSONDecodeError) as exc:
        _fail(str(exc))
    typer.echo(str(_run(lambda conn: admin.upsert_service(conn, spec))))
    _declare_or_fail([spec])


@service_app.command("list")
def service_list() -> None:
    from gateway import admin

    for row in _run(admin.listing)["services"]:
        typer.echo(json.dumps(row))


@service_app.command("delete")
def service_delete(name: str) -> None:
    """Delete a service and its grants (its queues are left to the operator)."""
    from gateway import admin

    if not _run(lambda conn: admin.delete_service(conn, name)):
        _fail(f"unknown service '{name}'")
    typer.echo(f"service {name}: deleted")


@client_app.command("create")
def client_create(client_id: str) -> None:
    """Create a client; its generated secret is printed once, and only its hash is kept."""
    from gateway import admin

    secret = _run(lambda conn: admin.create_client(conn, client_id))
    typer.echo(f"clientId: {client_id}\nclientSecret: {secret}\n(shown once: store it now)")


@client_app.command("list")
def client_list() -> None:
    from gateway import admin

    for row in _run(admin.listing)["clients"]:
        typer.echo(json.dumps(row))


@client_app.command("delete")
def client_delete(client_id: str) -> None:
    from gateway import admin

    if not _run(lambda conn: admin.delete_client(conn, client_id)):
        _fail(f"unknown client '{client_id}'")
    typer.echo(f"client {client_id}: deleted")


@app.command()
def grant(client_id: str, service: str, capacity: int | None = typer.Option(None, min=0)) -> None:
    """Allow CLIENT_ID to use SERVICE, optionally with its own capacity."""
    from gateway import admin

    _run(lambda conn: admin.grant(conn, client_id, service, capacity))
    typer.echo(f"granted {service} to {client_id}")


@app.command()
def revoke(client_id: str, service: str) -> None:
    from gateway import admin

    if not _run(lambda conn: admin.revoke(conn, client_id, service)):
        _fail(f"{client_id} has no grant on {service}")
    typer.echo(f"revoked {service} from {client_id}")


@app.command("list")
def list_all() -> None:
    """Services, clients and their grants, operators."""
    from gateway import admin

    typer.echo(json.dumps(_run(admin.listing), indent=2, default=str))


@app.command("migrate-queues")
def migrate_queues() -> None:
    """Turn the classic -out and -dlq queues of an older installation into quorum queues.

    Stop the gateways first (they consume these queues); dispatchers may keep running.
    Nothing is lost, and running it again after an interruption finishes the job.
    """
    from conveyor.connection import connect
    from conveyor.events import MessageFormat
    from gateway import admin
    from gateway.quorum_migration import InUse, migrate_service

    queues = [
        row["queue_name"]
        for row in _run(admin.listing)["services"]
        if row["message_format"] != MessageFormat.LEGACY.value
    ]
    settings = GatewaySettings()

    async def main() -> None:
        connection = await connect(
            settings.amqp_url, name="conveyor migrate-queues", heartbeat=settings.amqp_heartbeat
        )
        async with connection:
            for queue_name in queues:
                for moved in await migrate_service(connection, queue_name):
                    state = "converted" if moved.converted else "already quorum"
                    typer.echo(f"{moved.queue}: {state}, {moved.messages} message(s) moved")

    try:
        asyncio.run(main())
    except InUse as exc:
        _fail(str(exc))
    except Exception as exc:
        _fail(f"could not migrate the queues: {exc!r}")
