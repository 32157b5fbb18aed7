"""Operator actions on services, clients, grants and operators (SPEC §4, §11.6).

`apply` is declarative and idempotent: applying the same file twice reports
every entry unchanged and writes nothing. A plaintext secret in the file is
re-hashed only when it no longer matches the stored hash. A client's grants
become exactly those listed for it; services and clients missing from the file
are left alone (delete them explicitly), so a partial file is never
destructive. Clients are never operators (SPEC §11.6): an id held by one kind
is refused as the other, here and in `create_client`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import bcrypt
from psycopg import AsyncConnection

from conveyor.events import MessageFormat
from gateway import cancel, lifecycle, store
from gateway.auth import generate_secret, hash_secret
from gateway.listener import LISTENER_NAME
from gateway.pgpool import jsonb
from gateway.platform_file import (
    ClientSpec,
    OperatorSpec,
    PlatformError,
    PlatformSpec,
    ServiceSpec,
    validate,
)


@dataclass(frozen=True, slots=True)
class Change:
    kind: str
    name: str
    action: str  # created | updated | unchanged | deleted

    def __str__(self) -> str:
        return f"{self.kind} {self.name}: {self.action}"


_SERVICE_UPSERT = """
    INSERT INTO services (name, queue_name, capacity, json_schema, message_format,
                          task_timeout, max_attempts, retention_seconds)
    VALUES (%(name)s, %(queue_name)s, %(capacity)s, %(json_schema)s, %(message_format)s,
            %(task_timeout)s, %(max_attempts)s, %(retention_seconds)s)
    ON CONFLICT (name) DO UPDATE SET
        queue_name = EXCLUDED.queue_name, capacity = EXCLUDED.capacity,
        json_schema = EXCLUDED.json_schema, message_format = EXCLUDED.message_format,
        task_timeout = EXCLUDED.task_timeout, max_attempts = EXCLUDED.max_attempts,
        retention_seconds = EXCLUDED.retention_seconds, updated_at = now()
    WHERE (services.queue_name, services.capacity, services.json_schema, services.message_format,
           services.task_timeout, services.max_attempts, services.retention_seconds)
      IS DISTINCT FROM
          (EXCLUDED.queue_name, EXCLUDED.capacity, EXCLUDED.json_schema, EXCLUDED.message_format,
           EXCLUDED.task_timeout, EXCLUDED.max_attempts, EXCLUDED.retention_seconds)
    RETURNING (xmax = 0) AS created
    """


def _service_params(spec: ServiceSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "queue_name": spec.queue,
        "capacity": spec.capacity,
        "json_schema": jsonb(spec.jsonSchema),
        "message_format": spec.messageFormat.value,
        "task_timeout": spec.taskTimeout,
        "max_attempts": spec.maxAttempts,
        "retention_seconds": spec.retention,
    }


# Held to the end of the transaction by every command that writes a service: two concurrent
# commands cannot both find a queue name free and give it to two services.
_QUEUE_NAMES_LOCK = "SELECT pg_advisory_xact_lock(hashtext('conveyor.queue_names'))"
_QUEUE_OWNER = """
    SELECT name FROM services WHERE queue_name = %(queue)s AND name <> %(name)s
    UNION ALL
    SELECT service FROM moved_queues WHERE queue_name = %(queue)s AND service <> %(name)s
    LIMIT 1
    """


async def upsert_service(conn: AsyncConnection[Any], spec: ServiceSpec) -> Change:
    """The service as `spec` says; refused (PlatformError) if its queue name is, or was until
    its old queues are deleted, another service's: one's tasks ran on the other's function."""
    await conn.execute(_QUEUE_NAMES_LOCK)
    params = {"queue": spec.queue, "name": spec.name}
    owner = await (await conn.execute(_QUEUE_OWNER, params)).fetchone()
    if owner is not None:
        raise PlatformError(
            f"service {spec.name}: queueName {spec.queue} is service {owner[0]}'s"
            " (each service has queues of its own): choose another"
        )
    row = await (await conn.execute(_SERVICE_UPSERT, _service_params(spec))).fetchone()
    action = "unchanged" if row is None else ("created" if row.created else "updated")
    return Change("service", spec.name, action)


_STORED_SERVICE = """
    SELECT queue_name AS "queueName", capacity, json_schema AS "jsonSchema",
           message_format AS "messageFormat", task_timeout AS "taskTimeout",
           max_attempts AS "maxAttempts", retention_seconds AS retention
      FROM services WHERE name = %s FOR UPDATE
    """


async def update_service(
    conn: AsyncConnection[Any], name: str, changes: dict[str, Any]
) -> tuple[ServiceSpec, Change]:
    """`changes` over the service's stored settings (over the defaults for a new service):
    `service create` on an existing service changes only what it is told, unlike `apply`,
    where the file is the whole truth. The row is locked until the transaction ends."""
    await conn.execute(_QUEUE_NAMES_LOCK)  # before the row, as `apply` takes them: no deadlock
    row = await (await conn.execute(_STORED_SERVICE, (name,))).fetchone()
    stored = {} if row is None else row._asdict()
    spec = validate(ServiceSpec, {**stored, **changes, "name": name})
    return spec, await upsert_service(conn, spec)


async def message_formats(
    conn: AsyncConnection[Any], names: Sequence[str]
) -> dict[str, MessageFormat]:
    """The stored messageFormat of those of these services that exist: what a refused
    topology is compared with to tell a format change from other conflicts."""
    cursor = await conn.execute(
        "SELECT name, message_format FROM services WHERE name = ANY(%s)", (list(names),)
    )
    return {row.name: MessageFormat(row.message_format) for row in await cursor.fetchall()}


# Clients and operators are kept apart: each table is the only one its API reads.
_PRINCIPALS = {"client": ("clients", "client_id"), "operator": ("operators", "operator_id")}
_ARTICLE = {"client": "a client", "operator": "an operator"}
_OTHER = {"client": "operator", "operator": "client"}

# Held to the end of the transaction by every command that writes clients or operators, taken
# before anything else: two concurrent commands cannot both find an id free and make it a
# client in one table and an operator in the other.
_PRINCIPALS_LOCK = "SELECT pg_advisory_xact_lock(hashtext('conveyor.principals'))"


async def _own_hash(conn: AsyncConnection[Any], ident: str, kind: str) -> str | None:
    """`ident`'s stored hash as a `kind`; an id the other kind holds is refused (SPEC §11.6)."""
    other = _OTHER[kind]
    if await _stored_hash(conn, ident, other) is not None:
        way_out = f" or `conveyor admin client delete {ident}` first" if other == "client" else ""
        raise PlatformError(
            f"{ident} is {_ARTICLE[other]} already and cannot be {_ARTICLE[kind]} too"
            f" (clients are never operators): choose another id{way_out}"
        )
    return await _stored_hash(conn, ident, kind)


async def _stored_hash(conn: AsyncConnection[Any], ident: str, kind: str) -> str | None:
    table, column = _PRINCIPALS[kind]
    cursor = await conn.execute(
        f"SELECT secret_hash FROM {table} WHERE {column} = %s",  # table and column: fixed names
        (ident,),
    )
    row = await cursor.fetchone()
    return None if row is None else row.secret_hash


def _hash_for(spec: OperatorSpec, stored: str | None) -> str:
    if spec.secretHash is not None:
        return spec.secretHash
    assert spec.secret is not None
    if stored is not None:
        try:
            if bcrypt.checkpw(spec.secret.encode(), stored.encode()):
                return stored
        except ValueError:
            pass
    return hash_secret(spec.secret)


async def upsert_client(conn: AsyncConnection[Any], spec: ClientSpec) -> Change:
    stored = await _own_hash(conn, spec.id, "client")
    if stored is None:
        await _refuse_a_former_clients_id(conn, spec.id)
    wanted = _hash_for(spec, stored)
    action = "unchanged"
    if stored is None:
        action = "created"
    elif stored != wanted:
        action = "updated"
    if action != "unchanged":
        await _set_secret_hash(conn, spec.id, wanted)
    if await _set_grants(conn, spec) and action == "unchanged":
        action = "updated"
    return Change("client", spec.id, action)


async def _refuse_a_former_clients_id(conn: AsyncConnection[Any], client_id: str) -> None:
    """A new client is refused the id of a deleted one while that one's tasks remain: tasks
    name their owner by id only, so the newcomer would read them and share their
    Idempotency-Keys. No index leads with tasks.client_id: this scans the tasks, once per
    client created (never on a client that exists)."""
    cursor = await conn.execute(
        "SELECT EXISTS (SELECT 1 FROM tasks WHERE client_id = %s) AS remain", (client_id,)
    )
    row = await cursor.fetchone()
    if row is not None and row.remain:
        raise PlatformError(
            f"client {client_id}: tasks of a deleted client of that id remain, and a new client"
            " would read them: choose another id, or wait until they are gone (finished tasks"
            " go past their service's retention, with `conveyor purge`)"
        )


async def _set_secret_hash(
    conn: AsyncConnection[Any], ident: str, secret_hash: str, kind: str = "client"
) -> None:
    table, column = _PRINCIPALS[kind]
    await conn.execute(
        f"""
        INSERT INTO {table} ({column}, secret_hash) VALUES (%(id)s, %(hash)s)
        ON CONFLICT ({column}) DO UPDATE SET secret_hash = EXCLUDED.secret_hash,
                                             updated_at = now()
        """,  # table and column: fixed names
        {"id": ident, "hash": secret_hash},
    )


async def upsert_operator(conn: AsyncConnection[Any], spec: OperatorSpec) -> Change:
    stored = await _own_hash(conn, spec.id, "operator")
    wanted = _hash_for(spec, stored)
    if stored == wanted:
        return Change("operator", spec.id, "unchanged")
    await _set_secret_hash(conn, spec.id, wanted, "operator")
    return Change("operator", spec.id, "created" if stored is None else "updated")


async def _set_grants(conn: AsyncConnection[Any], spec: ClientSpec) -> bool:
    cursor = await conn.execute(
        "SELECT service, capacity FROM authorizations WHERE client_id = %s", (spec.id,)
    )
    current = {row.service: row.capacity for row in await cursor.fetchall()}
    wanted = {g.service: g.capacity for g in spec.grants}
    if current == wanted:
        return False
    for service in set(current) - set(wanted):
        await revoke(conn, spec.id, service)
    for service, capacity in wanted.items():
        if current.get(service, ...) != capacity:
            await grant(conn, spec.id, service, capacity)
    return True


async def apply(conn: AsyncConnection[Any], spec: PlatformSpec) -> list[Change]:
    """The whole file in one transaction: a refused entry leaves nothing half-applied."""
    async with conn.transaction():
        await conn.execute(_PRINCIPALS_LOCK)
        changes = [await upsert_service(conn, s) for s in spec.services]
        cursor = await conn.execute("SELECT name FROM services")
        known = {row.name for row in await cursor.fetchall()}
        for client in spec.clients:
            for g in client.grants:
                if g.service not in known:
                    raise PlatformError(
                        f"client {client.id}: grant to unknown service '{g.service}'"
                    )
            changes.append(await upsert_client(conn, client))
        changes += [await upsert_operator(conn, o) for o in spec.operators]
    return changes


# -- imperative commands -----------------------------------------------------


async def create_client(conn: AsyncConnection[Any], client_id: str) -> str:
    """Creates a client with a generated secret, returned once and never stored in clear."""
    await conn.execute(_PRINCIPALS_LOCK)
    if await _own_hash(conn, client_id, "client") is not None:
        raise PlatformError(f"client {client_id} already exists")
    await _refuse_a_former_clients_id(conn, client_id)
    secret = generate_secret()
    await _set_secret_hash(conn, client_id, hash_secret(secret))
    return secret


async def delete_client(conn: AsyncConnection[Any], client_id: str) -> bool:
    return await _delete_principal(conn, client_id, "client")


async def delete_operator(conn: AsyncConnection[Any], operator_id: str) -> bool:
    """The operator's row: `apply` leaves operators missing from the file alone. A client of
    that id is not one (SPEC §11.6). The gateways forget its verified secret when they hear
    the change (gateway.credentials): its next request is refused."""
    return await _delete_principal(conn, operator_id, "operator")


async def _delete_principal(conn: AsyncConnection[Any], ident: str, kind: str) -> bool:
    table, column = _PRINCIPALS[kind]
    cursor = await conn.execute(
        f"DELETE FROM {table} WHERE {column} = %s",  # table and column: fixed names
        (ident,),
    )
    return bool(cursor.rowcount)


async def operators(conn: AsyncConnection[Any]) -> list[dict[str, Any]]:
    cursor = await conn.execute("SELECT operator_id FROM operators ORDER BY 1")
    return [row._asdict() for row in await cursor.fetchall()]


async def running_gateways(conn: AsyncConnection[Any]) -> int:
    """Gateway processes connected to this database: each holds one listening connection,
    named so (`gateway.listener`), whether it runs the background loops or the API only."""
    cursor = await conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = %s",
        (LISTENER_NAME,),
    )
    row = await cursor.fetchone()
    return int(row[0]) if row else 0


@dataclass(frozen=True, slots=True)
class DeletedService:
    """The tasks a delete ended, and where dispatchers may still run or hold them: the
    cancels' queue names (the service's, whatever its format, and those it moved away from)."""

    ended: list[uuid.UUID]
    queue_names: list[str]


async def delete_service(conn: AsyncConnection[Any], name: str) -> DeletedService | None:
    """The service, its grants and its unfinished tasks' chances: no gateway consumes its
    results once it is gone, so they end FAILURE now rather than wait for the watchdog or
    the PENDING time to live. The queues are left to the operator. It holds the service's
    writer lock, as every submission does until it commits: a submission under way is in
    the sweep, and one that waits for the lock finds no service once it has it."""
    async with conn.transaction():
        await conn.execute(store.WRITER_LOCK, {"service": name})
        cursor = await conn.execute(  # before the delete takes them with it (ON DELETE CASCADE)
            "SELECT queue_name FROM moved_queues WHERE service = %s", (name,)
        )
        left = [row[0] for row in await cursor.fetchall()]
        cursor = await conn.execute(
            "DELETE FROM services WHERE name = %s RETURNING queue_name",
            (name,),
        )
        deleted = await cursor.fetchone()
        if deleted is None:
            return None
        ended = await lifecycle.end_service_tasks(conn, name)
        queue_names = [deleted[0], *left]
        # Kept until the broker takes them: the caller tells them at once, and a gateway
        # does if it cannot (the broker away: they were lost, a sweep's 50 functions called).
        await cancel.keep(conn, name, queue_names, ended)
    return DeletedService(ended, queue_names)


async def grant(
    conn: AsyncConnection[Any],
    client_id: str,
    service: str,
    capacity: int | None,
    *,
    keep_capacity: bool = False,
) -> int | None:
    """The grant, with `capacity` (None: unlimited), or with the capacity it has already
    when `keep_capacity` (the CLI's `grant` without --capacity); returns the capacity now."""
    cursor = await conn.execute(
        "SELECT EXISTS (SELECT 1 FROM clients WHERE client_id = %s) AS client,"
        " EXISTS (SELECT 1 FROM services WHERE name = %s) AS service",
        (client_id, service),
    )
    found = await cursor.fetchone()
    assert found is not None
    has_client, has_service = found
    if not has_client:
        raise PlatformError(f"unknown client '{client_id}'")
    if not has_service:
        raise PlatformError(f"unknown service '{service}'")
    cursor = await conn.execute(
        """
        INSERT INTO authorizations (client_id, service, capacity) VALUES (%(c)s, %(s)s, %(n)s)
        ON CONFLICT (client_id, service) DO UPDATE SET capacity = CASE WHEN %(keep)s
            THEN authorizations.capacity ELSE EXCLUDED.capacity END
        RETURNING capacity
        """,
        {"c": client_id, "s": service, "n": capacity, "keep": keep_capacity},
    )
    granted = await cursor.fetchone()
    assert granted is not None
    return granted.capacity


async def revoke(conn: AsyncConnection[Any], client_id: str, service: str) -> bool:
    cursor = await conn.execute(
        "DELETE FROM authorizations WHERE client_id = %s AND service = %s", (client_id, service)
    )
    return bool(cursor.rowcount)


async def left_behind(conn: AsyncConnection[Any]) -> list[str]:
    """The queue names cloudevents services moved away from, which they still read."""
    cursor = await conn.execute(
        "SELECT m.queue_name FROM moved_queues m JOIN services s ON s.name = m.service"
        " WHERE s.message_format <> %s ORDER BY 1",
        (MessageFormat.LEGACY.value,),
    )
    return [row[0] for row in await cursor.fetchall()]


async def listing(conn: AsyncConnection[Any]) -> dict[str, list[dict[str, Any]]]:
    services = await conn.execute(
        "SELECT name, queue_name, capacity, message_format, task_timeout, max_attempts,"
        " retention_seconds FROM services ORDER BY name"
    )
    service_rows = [row._asdict() for row in await services.fetchall()]
    clients = await conn.execute(  # each grant with its capacity (null: unlimited)
        "SELECT c.client_id, coalesce(json_agg(json_build_object('service', a.service,"
        " 'capacity', a.capacity) ORDER BY a.service) FILTER (WHERE a.service IS NOT NULL),"
        " '[]') AS grants FROM clients c"
        " LEFT JOIN authorizations a USING (client_id) GROUP BY c.client_id ORDER BY 1"
    )
    return {
        "services": service_rows,
        "clients": [row._asdict() for row in await clients.fetchall()],
        "operators": await operators(conn),
    }


__all__ = ["Change", "MessageFormat", "PlatformError", "apply"]
