"""Capacity holds under concurrency: 200 simultaneous POSTs against capacity 50."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from tests.support.gateway import GatewayProcess, Platform


async def _burst(gateway: GatewayProcess, url: str, auth: tuple[str, str], n: int) -> Counter:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(
        base_url=gateway.url, auth=auth, limits=limits, timeout=60
    ) as http:
        # Warm the credential cache first so the race is on the capacity, not on bcrypt.
        await http.get("/v1/services/none/tasks/x")
        start = asyncio.Event()

        async def one() -> tuple[int, int | None]:
            await start.wait()
            answer = await http.post(url, json={"body": {}})
            body = answer.json()
            return answer.status_code, body.get("error", {}).get("number")

        jobs = [asyncio.create_task(one()) for _ in range(n)]
        await asyncio.sleep(0.05)
        start.set()
        return Counter(await asyncio.gather(*jobs))


def test_200_parallel_posts_against_capacity_50(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service(capacity=50)
    counts = asyncio.run(_burst(gateway, gateway.tasks_url(svc.name), svc.clients[0].auth, 200))
    assert counts == Counter({(201, None): 50, (429, 429001): 150})
    pending = platform.sql(
        "SELECT count(*) FROM tasks WHERE service = %(s)s AND status = 'PENDING'", {"s": svc.name}
    )
    assert pending[0][0] == 50


def test_client_capacity_under_concurrency(gateway: GatewayProcess, platform: Platform) -> None:
    svc = platform.service(capacity=100, client_capacity=7)
    counts = asyncio.run(_burst(gateway, gateway.tasks_url(svc.name), svc.clients[0].auth, 60))
    assert counts == Counter({(201, None): 7, (429, 429002): 53})
