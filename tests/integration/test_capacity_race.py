"""Capacity holds under concurrency: 200 simultaneous POSTs against capacity 50; a repeated
Idempotency-Key at full capacity is a repeat (200), never a refusal (429)."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import httpx

from tests.support.gateway import GatewayProcess, Platform


async def _burst(
    gateway: GatewayProcess,
    url: str,
    auth: tuple[str, str],
    n: int,
    headers: dict[str, str] | None = None,
) -> Counter:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(
        base_url=gateway.url, auth=auth, limits=limits, timeout=60
    ) as http:
        # Warm the credential cache first so the race is on the capacity, not on bcrypt.
        await http.get("/v1/services/none/tasks/x")
        start = asyncio.Event()

        async def one() -> tuple[int, int | str | None]:
            await start.wait()
            answer = await http.post(url, json={"body": {}}, headers=headers)
            body = answer.json()
            if headers and "data" in body:  # repeats of one key: which task each answer names
                return answer.status_code, body["data"]["taskId"]
            return answer.status_code, body.get("error", {}).get("number")

        jobs = [asyncio.create_task(one()) for _ in range(n)]
        await asyncio.sleep(0.05)
        start.set()
        return Counter(await asyncio.gather(*jobs))


def _answers(counts: Counter) -> Counter:
    """(status, taskId or error number) → how many, with task ids replaced by 'task'."""
    return Counter(
        {(status, "task" if isinstance(x, str) else x): n for (status, x), n in counts.items()}
    )


def test_200_parallel_posts_against_capacity_50(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service(capacity=50)
    counts = asyncio.run(_burst(gateway, gateway.tasks_url(svc.name), svc.clients[0].auth, 200))
    assert counts == Counter({(201, None): 50, (429, 429001): 150}), counts
    pending = platform.sql(
        "SELECT count(*) FROM tasks WHERE service = %(s)s AND status = 'PENDING'", {"s": svc.name}
    )
    assert pending[0][0] == 50


def test_client_capacity_under_concurrency(gateway: GatewayProcess, platform: Platform) -> None:
    svc = platform.service(capacity=100, client_capacity=7)
    counts = asyncio.run(_burst(gateway, gateway.tasks_url(svc.name), svc.clients[0].auth, 60))
    assert counts == Counter({(201, None): 7, (429, 429002): 53})


def test_idempotent_repeat_at_full_capacity_is_200(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service(capacity=1)
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    with gateway.http(svc.clients[0]) as http:
        first = http.post(gateway.tasks_url(svc.name), json={"body": {}}, headers=headers)
        repeat = http.post(gateway.tasks_url(svc.name), json={"body": {}}, headers=headers)
        other = http.post(gateway.tasks_url(svc.name), json={"body": {}})
    assert first.status_code == 201, first.text
    assert repeat.status_code == 200, repeat.text
    assert repeat.json()["data"]["taskId"] == first.json()["data"]["taskId"]
    assert other.status_code == 429  # the service is full for any other submission


def test_concurrent_repeats_of_one_key_at_capacity_1(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """All at once, so most repeats look the key up before the first one commits."""
    for capacity in ({"capacity": 1}, {"client_capacity": 1}):
        svc = platform.service(**capacity)
        headers = {"Idempotency-Key": uuid.uuid4().hex}
        url = gateway.tasks_url(svc.name)
        counts = asyncio.run(_burst(gateway, url, svc.clients[0].auth, 30, headers))
        assert _answers(counts) == Counter({(201, "task"): 1, (200, "task"): 29}), counts
        assert len({task_id for _, task_id in counts}) == 1, counts  # one task for all
        pending = platform.sql("SELECT count(*) FROM tasks WHERE service = %(s)s", {"s": svc.name})
        assert pending[0][0] == 1
