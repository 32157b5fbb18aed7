"""Operator actions on services, clients and grants (SPEC §4).

`apply` is declarative and idempotent: applying the same file twice reports
every entry unchanged and writes nothing. A plaintext secret in the file is
re-hashed only when it no longer matches the stored hash. A client's grants
become exactly those listed for it; services and clients missing from the file
are left alone (delete them explicitly), so a partial file is never
destructive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import bcrypt
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from conveyor.events import MessageFormat
from gateway.auth import generate_secret, hash_secret
from gateway.platform_file import ClientSpec, PlatformError, PlatformSpec, ServiceSpec


@dataclass(frozen=True, slots=True)
class Change:
    kind: str
    name: str
    action: str  # created | updated | unchanged | deleted

    def __str__(self) -> str:
        return f"{self.kind} {self.name}: {self.action}"


_SERVICE_UPSERT = text(
    """
    INSERT INTO services (name, queue_name, capacity, json_schema, message_format,
                          task_timeout, max_attempts, retention_seconds)
    VALUES (:name, :queue_name, :capacity, :json_schema, :message_format,
            :task_timeout, :max_attempts, :retention_seconds)
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
).bindparams(bindparam("json_schema", type_=JSONB))


def _service_params(spec: ServiceSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "queue_name": spec.queue,
        "capacity": spec.capacity,
        "json_schema": spec.jsonSchema,
        "message_format": spec.messageFormat.value,
        "task_timeout": spec.taskTimeout,
        "max_attempts": spec.maxAttempts,
        "retention_seconds": spec.retention,
    }


async def upsert_service(conn: AsyncConnection, spec: ServiceSpec) -> Change:
    row = (await conn.execute(_SERVICE_UPSERT, _service_params(spec))).first()
    action = "unchanged" if row is None else ("created" if row.created else "updated")
    return Change("service", spec.name, action)


async def _stored_hash(conn: AsyncConnection, client_id: str) -> str | None:
    row = await conn.execute(
        text("SELECT secret_hash FROM clients WHERE client_id = :id"), {"id": client_id}
    )
    return row.scalar_one_or_none()


def _hash_for(spec: ClientSpec, stored: str | None) -> str:
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


async def upsert_client(conn: AsyncConnection, spec: ClientSpec) -> Change:
    stored = await _stored_hash(conn, spec.id)
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


async def _set_secret_hash(conn: AsyncConnection, client_id: str, secret_hash: str) -> None:
    await conn.execute(
        text(
            """
            INSERT INTO clients (client_id, secret_hash) VALUES (:id, :hash)
            ON CONFLICT (client_id) DO UPDATE SET secret_hash = EXCLUDED.secret_hash,
                                                  updated_at = now()
            """
        ),
        {"id": client_id, "hash": secret_hash},
    )


async def _set_grants(conn: AsyncConnection, spec: ClientSpec) -> bool:
    current = {
        row.service: row.capacity
        for row in await conn.execute(
            text("SELECT service, capacity FROM authorizations WHERE client_id = :id"),
            {"id": spec.id},
        )
    }
    wanted = {g.service: g.capacity for g in spec.grants}
    if current == wanted:
        return False
    for service in set(current) - set(wanted):
        await revoke(conn, spec.id, service)
    for service, capacity in wanted.items():
        if current.get(service, ...) != capacity:
            await grant(conn, spec.id, service, capacity)
    return True


async def apply(engine: AsyncEngine, spec: PlatformSpec) -> list[Change]:
    async with engine.begin() as conn:
        changes = [await upsert_service(conn, s) for s in spec.services]
        known = {row.name for row in await conn.execute(text("SELECT name FROM services"))}
        for client in spec.clients:
            for g in client.grants:
                if g.service not in known:
                    raise PlatformError(
                        f"client {client.id}: grant to unknown service '{g.service}'"
                    )
            changes.append(await upsert_client(conn, client))
    return changes


# -- imperative commands -----------------------------------------------------


async def create_client(conn: AsyncConnection, client_id: str) -> str:
    """Creates a client with a generated secret, returned once and never stored in clear."""
    if await _stored_hash(conn, client_id) is not None:
        raise PlatformError(f"client {client_id} already exists")
    secret = generate_secret()
    await _set_secret_hash(conn, client_id, hash_secret(secret))
    return secret


async def delete_client(conn: AsyncConnection, client_id: str) -> bool:
    result = await conn.execute(
        text("DELETE FROM clients WHERE client_id = :id"), {"id": client_id}
    )
    return bool(result.rowcount)


async def delete_service(conn: AsyncConnection, name: str) -> bool:
    result = await conn.execute(text("DELETE FROM services WHERE name = :n"), {"n": name})
    return bool(result.rowcount)


async def grant(conn: AsyncConnection, client_id: str, service: str, capacity: int | None) -> None:
    exists = await conn.execute(
        text(
            "SELECT (SELECT 1 FROM clients WHERE client_id = :c), (SELECT 1 FROM services WHERE name = :s)"
        ),
        {"c": client_id, "s": service},
    )
    has_client, has_service = exists.one()
    if not has_client:
        raise PlatformError(f"unknown client '{client_id}'")
    if not has_service:
        raise PlatformError(f"unknown service '{service}'")
    await conn.execute(
        text(
            """
            INSERT INTO authorizations (client_id, service, capacity) VALUES (:c, :s, :cap)
            ON CONFLICT (client_id, service) DO UPDATE SET capacity = EXCLUDED.capacity
            """
        ),
        {"c": client_id, "s": service, "cap": capacity},
    )


async def revoke(conn: AsyncConnection, client_id: str, service: str) -> bool:
    result = await conn.execute(
        text("DELETE FROM authorizations WHERE client_id = :c AND service = :s"),
        {"c": client_id, "s": service},
    )
    return bool(result.rowcount)


async def listing(conn: AsyncConnection) -> dict[str, list[dict[str, Any]]]:
    services = [
        dict(row._mapping)
        for row in await conn.execute(
            text(
                "SELECT name, queue_name, capacity, message_format, task_timeout, max_attempts,"
                " retention_seconds FROM services ORDER BY name"
            )
        )
    ]
    clients = [
        dict(row._mapping)
        for row in await conn.execute(
            text(
                "SELECT c.client_id, coalesce(string_agg(a.service || coalesce('(' || a.capacity"
                " || ')', ''), ', ' ORDER BY a.service), '') AS grants FROM clients c"
                " LEFT JOIN authorizations a USING (client_id) GROUP BY c.client_id ORDER BY 1"
            )
        )
    ]
    return {"services": services, "clients": clients}


def service_spec(**values: Any) -> ServiceSpec:
    return ServiceSpec.model_validate({k: v for k, v in values.items() if v is not None})


__all__ = ["Change", "MessageFormat", "PlatformError", "apply"]
