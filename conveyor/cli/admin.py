"""`conveyor admin ...`: services, clients, grants and operators are data, managed here."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from conveyor.cli.input_files import read_text
from conveyor.settings import GatewaySettings

if TYPE_CHECKING:
    from aio_pika.abc import AbstractConnection
    from pydantic import BaseModel

    from conveyor.events import MessageFormat
    from gateway.admin import Change, DeletedService
    from gateway.platform_file import ServiceSpec

    Model = TypeVar("Model", bound=BaseModel)

app = typer.Typer(help="Declare services, clients, grants and operators.", no_args_is_help=True)
service_app = typer.Typer(help="Services.", no_args_is_help=True)
client_app = typer.Typer(help="Clients.", no_args_is_help=True)
operator_app = typer.Typer(
    help="Operators (created by `apply`: operators: [{id, secret | secretHash}]).",
    no_args_is_help=True,
)
app.add_typer(service_app, name="service")
app.add_typer(client_app, name="client")
app.add_typer(operator_app, name="operator")

T = TypeVar("T")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def _valid_id(kind: str, value: str) -> None:
    """Ids and names are held to the platform file's rule (`check_name`) before anything is
    written; the value itself is not echoed (it may be long, or span lines)."""
    from conveyor.topology import check_name

    try:
        check_name(value)
    except ValueError as exc:
        _fail(f"{kind}: {exc}")


def _validated(model: type[Model], data: dict[str, Any]) -> Model:
    """`data` held to the platform file's rules for `model`: one line naming the field."""
    from gateway.platform_file import PlatformError, validate

    try:
        return validate(model, data)
    except PlatformError as exc:
        _fail(str(exc))
    raise AssertionError("unreachable")


def _not_both(given: bool, removed: bool, option: str, removal: str) -> None:
    if given and removed:
        _fail(f"give {option} or {removal}, not both")


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


def _declaring(
    action: Callable[[Any], Awaitable[T]], specs: Sequence[ServiceSpec]
) -> Callable[[Any], Awaitable[T]]:
    """`action`, then the topology of `specs`, in `action`'s transaction (see `_run`).

    Declared before the commit, so a topology RabbitMQ refuses (or an unreachable broker)
    rolls the whole action back: the database never says what the broker refused, and a
    gateway never reads a service whose queues could not be declared. Should the commit
    itself fail, the queues stay declared and empty; applying again adopts them.
    """
    from gateway import admin

    async def run(conn: Any) -> T:
        before = await admin.message_formats(conn, [spec.name for spec in specs])
        result = await action(conn)
        await _declare(specs, before)
        return result

    return run


async def _declare(specs: Sequence[ServiceSpec], before: dict[str, MessageFormat]) -> None:
    """Declares the services' queues; a refusal is a PlatformError naming the service.

    RabbitMQ declarations are not transactional, so the services that have queues already,
    the only ones the broker can refuse, go first: when one is refused, no new service of
    the same file has had its queues made yet, and the queues the refused one's declaration
    made before the refusal (its `-dlq`, when someone else's `-in` is refused) are deleted.
    """
    from conveyor import topology
    from conveyor.connection import connect
    from gateway.platform_file import PlatformError

    if not specs:
        return
    settings = GatewaySettings()
    try:
        connection = await connect(
            settings.amqp_url, name="conveyor admin", heartbeat=settings.amqp_heartbeat
        )
    except Exception as exc:
        raise PlatformError(
            f"could not reach RabbitMQ to declare the queues ({exc}); nothing was applied"
            " (--no-declare applies without declaring)"
        ) from None
    async with connection:
        present = {spec.name: await _queues_present(connection, spec.queue) for spec in specs}
        channel = await connection.channel()
        for spec in sorted(specs, key=lambda spec: not present[spec.name]):
            try:
                await topology.declare_service(
                    channel, spec.queue, spec.messageFormat, settings.delivery_limit
                )
            except Exception as exc:
                await _delete_made(connection, spec.queue, present[spec.name])
                raise PlatformError(_refused(spec, before.get(spec.name), exc)) from None


def _queue_names(queue_name: str) -> tuple[str, str, str]:
    from conveyor import topology

    return (
        topology.dead_letter_queue(queue_name),
        topology.in_queue(queue_name),
        topology.out_queue(queue_name),
    )


async def _queues_present(connection: AbstractConnection, queue_name: str) -> set[str]:
    """Which queues of `queue_name` exist: passive declares, each miss closing its channel
    (RabbitMQ answers NOT_FOUND by closing it)."""
    import aiormq.exceptions

    present = set()
    for name in _queue_names(queue_name):
        channel = await connection.channel()
        try:
            await channel.declare_queue(name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            continue
        present.add(name)
        await channel.close()
    return present


async def _delete_made(connection: AbstractConnection, queue_name: str, present: set[str]) -> None:
    """Deletes the queues of `queue_name` that were not there before this declaration, if
    still empty and unused (asked first: quorum queues refuse `if-unused` and `if-empty`,
    closing the connection): "nothing was applied" is then true of the broker too."""
    for name in _queue_names(queue_name):
        if name in present:
            continue
        with contextlib.suppress(Exception):  # absent (not made), or the broker said no: kept
            channel = await connection.channel()
            queue = await channel.declare_queue(name, passive=True)
            if queue.declaration_result.message_count == 0 and not (
                queue.declaration_result.consumer_count
            ):
                await channel.queue_delete(name)
            await channel.close()


def _refused(spec: ServiceSpec, before: MessageFormat | None, exc: Exception) -> str:
    """RabbitMQ's reason, and for a queue type conflict what the operator can do instead."""
    from conveyor.events import MessageFormat

    message = f"service {spec.name}: RabbitMQ refused its queues ({exc}); nothing was applied"
    other_type = "x-queue-type" in str(exc)
    if other_type and before is not None and before is not spec.messageFormat:
        return (
            f"{message}. A queue's type cannot change in place (cloudevents services have"
            f" quorum queues, legacy ones classic queues), so messageFormat cannot go from"
            f" {before.value} to {spec.messageFormat.value} while the service's queues exist,"
            " and no command converts them: keep the format, or drain those queues and give"
            " the service a new queueName"
        )
    if before is MessageFormat.CLOUDEVENTS:
        return (
            f"{message}. A queue's type and arguments cannot change in place: `conveyor admin"
            " migrate-queues` gives queues declared by an older version, or with another"
            " DELIVERY_LIMIT, this version's (docs/scale.md); --no-declare applies meanwhile"
        )
    if other_type:
        return (
            f"{message}. A queue's type cannot change in place, and queues of that name exist"
            " with another type: give the service another queueName"
        )
    return message


@app.command("apply")
def apply_file(
    file: Path = typer.Option(..., "-f", "--file", help="platform.yaml, or - for stdin"),
    declare: bool = typer.Option(True, help="Declare the services' RabbitMQ queues"),
) -> None:
    """Apply a platform file. Idempotent: applying it again changes nothing.

    All or nothing: the file is one transaction, committed only once RabbitMQ has
    accepted every service's queues.
    """
    from gateway import admin
    from gateway.platform_file import PlatformError, load

    try:
        text = read_text(file)
        spec = load(text)
    except (OSError, UnicodeDecodeError, PlatformError) as exc:
        _fail(str(exc))

    services = spec.services if declare else []
    changes = _run(_declaring(lambda conn: admin.apply(conn, spec), services))
    for change in changes:
        typer.echo(str(change))


@service_app.command("create")
def service_create(
    name: str,
    queue: str | None = typer.Option(None, help="Queue prefix (new service: the name)"),
    capacity: int | None = typer.Option(None, help="capacity (new service: unlimited)"),
    unlimited: bool = typer.Option(False, "--unlimited", help="Remove the capacity limit"),
    schema: Path | None = typer.Option(None, help="JSON Schema file for task bodies"),
    no_schema: bool = typer.Option(False, "--no-schema", help="Remove the JSON Schema"),
    message_format: str | None = typer.Option(
        None, "--format", help="cloudevents (new service's default) or legacy"
    ),
    timeout: int | None = typer.Option(None, help="taskTimeout in seconds (new service: 300)"),
    max_attempts: int | None = typer.Option(None, help="(new service: 3)"),
    retention: str | None = typer.Option(None, help="(new service: 7d)"),
) -> None:
    """Create a service, or change an existing one's given settings; declare its queues.

    On an existing service an option not given keeps its stored value (`apply`, by
    contrast, sets every setting to the file's).
    """
    _valid_id("service name", name)
    _not_both(capacity is not None, unlimited, "--capacity", "--unlimited")
    _not_both(schema is not None, no_schema, "--schema", "--no-schema")
    try:
        body_schema = json.loads(read_text(schema)) if schema else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        _fail(str(exc))
    except RecursionError:
        _fail(f"{schema}: nested too deep")
    given = {
        "queueName": queue,
        "capacity": capacity,
        "jsonSchema": body_schema,
        "messageFormat": message_format,
        "taskTimeout": timeout,
        "maxAttempts": max_attempts,
        "retention": retention,
    }
    changes = {key: value for key, value in given.items() if value is not None}
    if unlimited:
        changes["capacity"] = None
    if no_schema:
        changes["jsonSchema"] = None
    typer.echo(str(_run(lambda conn: _update_declaring(conn, name, changes))))


async def _update_declaring(conn: Any, name: str, changes: dict[str, Any]) -> Change:
    """`changes` to the service `name`, then its topology, as `_declaring` does for `apply`:
    the spec to declare is known only once the stored settings are read."""
    from gateway import admin

    before = await admin.message_formats(conn, [name])
    spec, change = await admin.update_service(conn, name, changes)
    await _declare([spec], before)
    return change


@service_app.command("list")
def service_list() -> None:
    from gateway import admin

    for row in _run(admin.listing)["services"]:
        typer.echo(json.dumps(row))


@service_app.command("delete")
def service_delete(name: str) -> None:
    """Delete a service and its grants (its queues are left to the operator)."""
    from gateway import admin, cancel

    deleted = _run(lambda conn: admin.delete_service(conn, name))
    if deleted is None:
        _fail(f"unknown service '{name}'")
        return
    typer.echo(f"service {name}: deleted; {len(deleted.ended)} unfinished tasks ended FAILURE")
    if not deleted.ended:
        return
    if asyncio.run(_tell_dispatchers(name, deleted)):
        _run(lambda conn: cancel.forget(conn, deleted.ended))
    else:
        typer.echo(
            "warning: RabbitMQ did not take every cancel now: a running gateway tells them once"
            " it does (a dispatcher may call the function for some of those tasks meanwhile;"
            " their results are ignored)",
            err=True,
        )


async def _tell_dispatchers(service: str, deleted: DeletedService) -> bool:
    """The tasks a delete ended, told to the dispatchers as cancels: the ones running them
    abort their calls, and any that takes their messages later (the service made again under
    the same name, on the same queue) acks them without a call."""
    from gateway.broker import Broker
    from gateway.cancel import tell_dispatchers

    settings = GatewaySettings()
    broker = Broker(settings.amqp_url, heartbeat=settings.amqp_heartbeat)
    try:
        # Connected first: `tell_dispatchers` declares the `-cancels` streams only on a
        # connected broker (a gateway's outage is the publish's to report), and a cancel sent
        # to a `-control` exchange bound to no stream reaches no dispatcher started later.
        async with asyncio.timeout(settings.publish_timeout):
            await broker.connect()
        return await tell_dispatchers(broker, service, deleted.queue_names, deleted.ended)
    except Exception:  # unreachable, refused: the caller warns that cancels may be missing
        return False
    finally:
        await broker.close()


@client_app.command("create")
def client_create(client_id: str) -> None:
    """Create a client; its generated secret is printed once, and only its hash is kept.

    The id of a deleted client is refused while that client's tasks remain.
    """
    from gateway import admin

    _valid_id("client id", client_id)
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


@operator_app.command("list")
def operator_list() -> None:
    from gateway import admin

    for row in _run(admin.operators):
        typer.echo(json.dumps(row))


@operator_app.command("delete")
def operator_delete(operator_id: str) -> None:
    """Delete an operator (`apply` leaves operators missing from the file alone).

    Every gateway refuses its next request, though it verified the secret lately.
    """
    from gateway import admin

    if not _run(lambda conn: admin.delete_operator(conn, operator_id)):
        _fail(f"unknown operator '{operator_id}'")
    typer.echo(f"operator {operator_id}: deleted")


@app.command()
def grant(
    client_id: str,
    service: str,
    capacity: int | None = typer.Option(None, help="The client's own capacity on SERVICE"),
    unlimited: bool = typer.Option(False, "--unlimited", help="Remove the grant's capacity"),
) -> None:
    """Allow CLIENT_ID to use SERVICE, optionally with its own capacity.

    A new grant is unlimited unless --capacity is given.
    An existing one keeps its capacity unless --capacity or --unlimited is given.
    """
    from gateway import admin
    from gateway.platform_file import GrantSpec

    _valid_id("client id", client_id)
    _valid_id("service name", service)
    _not_both(capacity is not None, unlimited, "--capacity", "--unlimited")
    _validated(GrantSpec, {"service": service, "capacity": capacity})
    keep = capacity is None and not unlimited
    granted = _run(lambda conn: admin.grant(conn, client_id, service, capacity, keep_capacity=keep))
    limit = "unlimited" if granted is None else f"capacity {granted}"
    typer.echo(f"granted {service} to {client_id} ({limit})")


@app.command()
def revoke(client_id: str, service: str) -> None:
    """Take a client's grant on a service away (its cached secret stops working too)."""
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
    """Give every service's queues the arguments this version declares, losing nothing
    (the queues a service moved away from too, while they exist).

    An older installation's classic -out and -dlq become quorum queues, and an -in declared
    by an older version (or with another DELIVERY_LIMIT) is declared anew. Stop the gateways
    first (they consume -out and -dlq and publish to -in), and the dispatchers when an -in
    must move. Running it again after an interruption finishes the job.
    """
    from conveyor.connection import connect
    from conveyor.events import MessageFormat
    from gateway import admin
    from gateway.pgpool import connect as database
    from gateway.queue_migration import InUse, migrate_left_behind, migrate_service

    queues = [
        row["queue_name"]
        for row in _run(admin.listing)["services"]
        if row["message_format"] != MessageFormat.LEGACY.value
    ]
    left_behind = _run(admin.left_behind)
    settings = GatewaySettings()

    async def main() -> None:
        connection = await connect(
            settings.amqp_url, name="conveyor migrate-queues", heartbeat=settings.amqp_heartbeat
        )

        async def gateways() -> int:
            async with await database(settings.database_url) as conn:
                return await admin.running_gateways(conn)

        async with connection:
            if queues:  # the gateways' must be the same, or they take the queues for others
                typer.echo(f"-in queues get x-delivery-limit {settings.delivery_limit}")
            # then the old queues of a moved service, which it still reads
            jobs = [(migrate_service, q) for q in queues]
            jobs += [(migrate_left_behind, q) for q in left_behind]
            for migrate, queue_name in jobs:
                for moved in await migrate(
                    connection, queue_name, settings.delivery_limit, gateways
                ):
                    typer.echo(f"{moved.queue}: {moved.state}, {moved.messages} message(s) moved")

    try:
        asyncio.run(main())
    except InUse as exc:
        _fail(str(exc))
    except Exception as exc:
        _fail(f"could not migrate the queues: {exc!r}")
