"""Services and grants are cached by the gateway, yet every change takes effect at once.

The cache (`gateway.access_cache`) is emptied by PostgreSQL notifications sent by
migration 0002's triggers, so a revoked grant, a new capacity or a deleted service
is seen by the very next request, on a gateway that has already cached them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import psycopg
import pytest

from gateway.access_cache import AccessCache
from gateway.database_url import libpq
from gateway.listener import LISTENER_NAME, Listener
from gateway.pgpool import Pool
from tests.support.gateway import GatewayProcess, Platform

BODY = {"body": {"x": 1}}


def _post(gateway: GatewayProcess, service, client) -> tuple[int, int | None]:  # type: ignore[no-untyped-def]
    with gateway.http(client) as http:
        answer = http.post(gateway.tasks_url(service.name), json=BODY)
    number = answer.json()["error"]["number"] if answer.status_code >= 400 else None
    return answer.status_code, number


def _warm(gateway: GatewayProcess, service, client) -> None:  # type: ignore[no-untyped-def]
    for _ in range(3):  # the first request reads the database, the next ones the cache
        assert _post(gateway, service, client) == (201, None)


def test_revoked_grant_refused_by_the_next_request(
    gateway: GatewayProcess, platform: Platform
) -> None:
    service = platform.service()
    client = service.clients[0]
    _warm(gateway, service, client)
    platform.sql(
        "DELETE FROM authorizations WHERE client_id = %(c)s AND service = %(s)s",
        {"c": client.client_id, "s": service.name},
    )
    assert _post(gateway, service, client) == (403, 403001)
    platform.sql(
        "INSERT INTO authorizations (client_id, service) VALUES (%(c)s, %(s)s)",
        {"c": client.client_id, "s": service.name},
    )
    assert _post(gateway, service, client) == (201, None)


def test_new_capacity_applies_to_the_next_request(
    gateway: GatewayProcess, platform: Platform
) -> None:
    service = platform.service()
    client = service.clients[0]
    _warm(gateway, service, client)  # 3 PENDING tasks (no dispatcher)
    platform.sql("UPDATE services SET capacity = 3 WHERE name = %(s)s", {"s": service.name})
    assert _post(gateway, service, client) == (429, 429001)


def test_deleted_service_is_unknown_to_the_next_request(
    gateway: GatewayProcess, platform: Platform
) -> None:
    service = platform.service()
    client = service.clients[0]
    _warm(gateway, service, client)
    platform.sql("DELETE FROM tasks WHERE service = %(s)s", {"s": service.name})
    platform.sql("DELETE FROM authorizations WHERE service = %(s)s", {"s": service.name})
    platform.sql("DELETE FROM services WHERE name = %(s)s", {"s": service.name})
    assert _post(gateway, service, client) == (404, 404001)


@pytest.fixture
async def cache(database_url: str) -> AsyncIterator[AccessCache]:
    pool = Pool(database_url, size=2)
    listening = Listener(database_url)
    cache = AccessCache(pool, listening)
    listener = asyncio.create_task(listening.listen_loop())
    deadline = time.monotonic() + 10
    while not cache.active and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert cache.active
    yield cache
    listener.cancel()
    await asyncio.gather(listener, return_exceptions=True)
    await pool.close()


async def test_cache_serves_repeats_and_forgets_on_notification(
    cache: AccessCache, platform: Platform, database_url: str
) -> None:
    service = platform.service()
    client = service.clients[0].client_id
    first = await _settled(cache, client, service.name)
    assert first is not None and first.granted and first.service.capacity is None

    async with await psycopg.AsyncConnection.connect(libpq(database_url), autocommit=True) as c:
        await c.execute("UPDATE services SET capacity = 7 WHERE name = %s", [service.name])
    deadline = time.monotonic() + 5
    while (await cache.access(client, service.name)) is first and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    fresh = await cache.access(client, service.name)
    assert fresh is not first and fresh is not None and fresh.service.capacity == 7


async def _settled(cache: AccessCache, client: str, service: str):  # type: ignore[no-untyped-def]
    """Once the notifications of the service's creation have arrived, repeats are served
    from memory: the same object, not a new read."""
    deadline = time.monotonic() + 5
    first = await cache.access(client, service)
    while time.monotonic() < deadline:
        again = await cache.access(client, service)
        if again is first:
            return first
        first = again
        await asyncio.sleep(0.05)
    raise AssertionError("every read went to the database")


async def test_unknown_services_are_not_cached(cache: AccessCache) -> None:
    for i in range(50):
        assert await cache.access("nobody", f"no-such-service-{i}") is None
    assert cache._entries == {}


async def test_without_the_listener_every_read_goes_to_the_database(
    database_url: str, platform: Platform
) -> None:
    service = platform.service()
    client = service.clients[0].client_id
    pool = Pool(database_url, size=1)
    try:
        cache = AccessCache(pool, Listener(database_url))  # never listening: not trusted
        first = await cache.access(client, service.name)
        second = await cache.access(client, service.name)
        assert first is not None and second is not None and first is not second
    finally:
        await pool.close()


async def test_listener_loss_turns_the_cache_off(cache: AccessCache, database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(libpq(database_url), autocommit=True) as c:
        await c.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = %s AND datname = current_database()",
            [LISTENER_NAME],
        )
    deadline = time.monotonic() + 5
    while cache.active and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not cache.active
    deadline = time.monotonic() + 10  # then it comes back by itself
    while not cache.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert cache.active


async def test_a_database_without_the_triggers_is_never_trusted(database_url: str) -> None:
    """Migration 0002 not applied: no notification would ever come, so no caching."""
    from gateway.migrate import downgrade, upgrade

    name = f"conveyor_nocache_{uuid.uuid4().hex[:8]}"
    admin = libpq(database_url)
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as c:
        await c.execute(f'CREATE DATABASE "{name}"')
    url = database_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        await asyncio.to_thread(upgrade, url, "0001")
        pool = Pool(url, size=1)
        listening = Listener(url)
        cache = AccessCache(pool, listening)
        listener = asyncio.create_task(listening.listen_loop(unmigrated_pause=0.1))
        try:
            await asyncio.sleep(1.0)
            assert not cache.active
            await asyncio.to_thread(upgrade, url, "head")  # the triggers arrive: cache on
            deadline = time.monotonic() + 10
            while not cache.active and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert cache.active
            await asyncio.to_thread(downgrade, url, "0001")
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
            await pool.close()
    finally:
        async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as c:
            await c.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
