"""POST …/tasks/batch (SPEC §11.2): all or nothing, capacity for the whole batch,
idempotency for the batch, its own size limit; every accepted task is published."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import httpx

from conveyor import strict_json
from conveyor.client import AsyncConveyorClient, ConveyorClient, Submitted
from conveyor.events import decode_submission
from tests.support.amqp import collect, wait_for_queues
from tests.support.gateway import GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes

SCHEMA = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}


def _batch_url(gateway: GatewayProcess, service: str) -> str:
    return gateway.tasks_url(service) + "/batch"


def _count(platform: Platform, service: str) -> int:
    return platform.sql("SELECT count(*) FROM tasks WHERE service = %(s)s", {"s": service})[0][0]


def test_a_batch_is_accepted_in_order_and_published(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    svc = platform.service()
    items = [{"body": {"n": i}} for i in range(100)]
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(_batch_url(gateway, svc.name), json={"tasks": items})
        assert answer.status_code == 201, answer.text
        tasks = answer.json()["data"]["tasks"]
        assert [t["taskPosition"] for t in tasks] == list(range(1, 101))
        assert len({t["taskId"] for t in tasks}) == 100
        for i in (0, 57, 99):
            polled = http.get(f"{gateway.tasks_url(svc.name)}/{tasks[i]['taskId']}").json()
            assert polled["data"]["status"] == "PENDING"
    stored = platform.sql(
        "SELECT task_id::text, request FROM tasks WHERE service = %(s)s", {"s": svc.name}
    )
    assert {row[0]: row[1]["n"] for row in stored} == {t["taskId"]: i for i, t in enumerate(tasks)}
    # Every task published (at least once: a confirm slower than the publish timeout leaves
    # the row to the relay, which publishes it again).
    wait_for_queues(amqp_url, [f"{svc.queue_name}-in"])
    published = collect(amqp_url, f"{svc.queue_name}-in", expected=100, timeout=15, settle=0.2)
    assert {decode_submission(m).task_id for m in published} == {t["taskId"] for t in tasks}
    # each says how many crashes its workers may have: -in's x-delivery-limit (SPEC §7.1)
    assert {decode_submission(m).delivery_limit for m in published} == {5}


def test_one_invalid_item_refuses_the_whole_batch(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service(jsonSchema=SCHEMA)
    with gateway.http(svc.clients[0]) as http:
        shape = http.post(
            _batch_url(gateway, svc.name),
            json={"tasks": [{"body": {"n": 1}}, {"body": {"n": 2}}, {"body": [1]}]},
        )
        schema = http.post(
            _batch_url(gateway, svc.name),
            json={"tasks": [{"body": {"n": 1}}, {"body": {"n": "two"}}]},
        )
        callback = http.post(
            _batch_url(gateway, svc.name),
            json={"tasks": [{"body": {"n": 1}, "callback": {"type": "https", "url": "nope"}}]},
        )
        unknown = http.post(
            _batch_url(gateway, svc.name), json={"tasks": [{"body": {"n": 1}, "extra": 1}]}
        )
    assert (shape.status_code, shape.json()["error"]["number"]) == (400, 400002)
    assert [e["path"] for e in shape.json()["error"]["errors"]] == ["tasks/2/body"]
    assert (schema.status_code, schema.json()["error"]["number"]) == (400, 400001)
    assert schema.json()["error"]["errors"][0]["path"] == "tasks/1/body/n"
    assert callback.json()["error"]["number"] == 400002
    assert callback.json()["error"]["errors"][0]["path"] == "tasks/0/callback/url"
    assert unknown.json()["error"]["errors"][0]["path"] == "tasks/0/extra"
    assert _count(platform, svc.name) == 0


def test_the_list_itself_is_checked(gateway: GatewayProcess, platform: Platform) -> None:
    svc = platform.service()
    with gateway.http(svc.clients[0]) as http:
        for payload in ({"tasks": []}, {"tasks": {}}, {}, {"tasks": [{"body": {}}], "x": 1}):
            answer = http.post(_batch_url(gateway, svc.name), json=payload)
            assert (answer.status_code, answer.json()["error"]["number"]) == (400, 400002)
        too_many = http.post(_batch_url(gateway, svc.name), json={"tasks": [{"body": {}}] * 1001})
        assert too_many.json()["error"]["errors"][0]["path"] == "tasks"
    assert _count(platform, svc.name) == 0


def test_capacity_counts_the_whole_batch(gateway: GatewayProcess, platform: Platform) -> None:
    svc = platform.service(capacity=5)
    limited = platform.service(client_capacity=3)
    with gateway.http(svc.clients[0]) as http:
        over = http.post(_batch_url(gateway, svc.name), json={"tasks": [{"body": {}}] * 6})
        assert (over.status_code, over.json()["error"]["number"]) == (429, 429001)
        fits = http.post(_batch_url(gateway, svc.name), json={"tasks": [{"body": {}}] * 5})
        assert fits.status_code == 201
    with gateway.http(limited.clients[0]) as http:
        over = http.post(_batch_url(gateway, limited.name), json={"tasks": [{"body": {}}] * 4})
        assert (over.status_code, over.json()["error"]["number"]) == (429, 429002)
    assert _count(platform, svc.name) == 5
    assert _count(platform, limited.name) == 0


def test_two_batches_racing_for_the_last_places(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service(capacity=10, clients=2)
    answers: list[int] = []

    def submit(client_index: int) -> None:
        with gateway.http(svc.clients[client_index]) as http:
            answer = http.post(_batch_url(gateway, svc.name), json={"tasks": [{"body": {}}] * 6})
            answers.append(answer.status_code)

    threads = [threading.Thread(target=submit, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answers) == [201, 429]
    assert _count(platform, svc.name) == 6


def test_idempotency_key_applies_to_the_batch(gateway: GatewayProcess, platform: Platform) -> None:
    svc = platform.service()
    key = {"Idempotency-Key": f"batch-{uuid.uuid4().hex}"}
    items = {"tasks": [{"body": {"n": i}} for i in range(3)]}
    with gateway.http(svc.clients[0]) as http:
        first = http.post(_batch_url(gateway, svc.name), json=items, headers=key)
        again = http.post(_batch_url(gateway, svc.name), json=items, headers=key)
        other = http.post(
            _batch_url(gateway, svc.name), json={"tasks": [{"body": {}}] * 2}, headers=key
        )
        single = http.post(gateway.tasks_url(svc.name), json={"body": {}}, headers=key)
    assert first.status_code == 201 and again.status_code == 200
    ids = [t["taskId"] for t in first.json()["data"]["tasks"]]
    assert [t["taskId"] for t in again.json()["data"]["tasks"]] == ids
    assert (other.status_code, other.json()["error"]["number"]) == (400, 400002)
    # the key is the batch's: a single task under it is another request (test_idempotency.py)
    assert (single.status_code, single.json()["error"]["number"]) == (400, 400002)
    assert _count(platform, svc.name) == 3


def test_its_own_size_limit(
    platform: Platform, database_url: str, amqp_url: str, procs: Processes
) -> None:
    svc = platform.service()
    env = gateway_env(database_url, amqp_url, CONVEYOR_MAX_BATCH_BYTES="2000")
    gateway = GatewayProcess(procs, env, "gateway-small-batches", "--no-background")
    with gateway.http(svc.clients[0]) as http:
        big = http.post(
            _batch_url(gateway, svc.name), json={"tasks": [{"body": {"x": "y" * 3000}}]}
        )
        small = http.post(_batch_url(gateway, svc.name), json={"tasks": [{"body": {}}]})
        single = http.post(gateway.tasks_url(svc.name), json={"body": {"x": "y" * 3000}})
    assert (big.status_code, big.json()["error"]["number"]) == (413, 413001)
    assert small.status_code == 201
    assert single.status_code == 201  # the single-task limit is another setting


def test_each_item_obeys_the_single_task_limit(
    platform: Platform, database_url: str, amqp_url: str, procs: Processes
) -> None:
    """An item is measured as it would be sent alone (compact JSON) against
    CONVEYOR_MAX_BODY_BYTES: a batch is no way around the single-task limit."""
    svc = platform.service()
    env = gateway_env(database_url, amqp_url, CONVEYOR_MAX_BODY_BYTES="1000")
    gateway = GatewayProcess(procs, env, "gateway-small-bodies", "--no-background")

    def item(size: int) -> bytes:  # compact JSON of exactly `size` bytes
        return b'{"body":{"x":"' + b"y" * (size - len(b'{"body":{"x":""}}')) + b'"}}'

    json_type = {"Content-Type": "application/json"}
    with gateway.http(svc.clients[0]) as http:
        alone = [
            http.post(gateway.tasks_url(svc.name), content=item(n), headers=json_type)
            for n in (1000, 1001)
        ]
        batches = [
            http.post(
                _batch_url(gateway, svc.name),
                content=b'{"tasks":[' + b",".join(items) + b"]}",
                headers=json_type,
            )
            for items in ([item(1001)], [item(20), item(1001)], [item(1000), item(1000)])
        ]
    assert [a.status_code for a in alone] == [201, 413]
    assert [b.status_code for b in batches] == [413, 413, 201], batches[0].text
    for answer, path in zip(batches[:2], ["tasks/0", "tasks/1"], strict=True):
        assert answer.json()["error"]["number"] == 413001
        assert answer.json()["error"]["errors"][0]["path"] == path
    assert _count(platform, svc.name) == 3


def test_each_item_may_nest_as_deep_as_a_single_task(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """Found by a sweep: a body accepted alone was refused in a batch (400002) at nesting
    126 and 127: depth was counted from the batch's root, two levels above its items'. An
    item is measured as it would be sent alone, as for its size."""
    svc = platform.service()

    def item(levels: int) -> bytes:  # a task whose request nests `levels` deep
        return b'{"body":' + b'{"a":' * (levels - 1) + b"1" + b"}" * levels

    json_type = {"Content-Type": "application/json"}
    verdicts = []
    with gateway.http(svc.clients[0]) as http:
        for levels in (127, 128, 129):
            alone = http.post(gateway.tasks_url(svc.name), content=item(levels), headers=json_type)
            batch = http.post(
                _batch_url(gateway, svc.name),
                content=b'{"tasks":[' + item(levels) + b"]}",
                headers=json_type,
            )
            verdicts.append((levels, alone.status_code, batch.status_code))
    assert verdicts == [(127, 201, 201), (128, 201, 201), (129, 400, 400)]


def test_openapi_documents_the_batch(gateway: GatewayProcess) -> None:
    document = httpx.get(f"{gateway.url}/openapi.json").json()
    batch = document["paths"]["/v1/services/{service}/tasks/batch"]["post"]
    assert {"201", "200", "400", "403", "404", "413", "429"} <= set(batch["responses"])


def test_the_cli_and_the_sdk_submit_batches(
    gateway: GatewayProcess, platform: Platform, tmp_path: Path
) -> None:
    svc = platform.service()
    client = svc.clients[0]
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps([{"body": {"n": i}} for i in range(3)]))
    env = {
        **os.environ,
        "CONVEYOR_GATEWAY_URL": gateway.url,
        "CONVEYOR_CLIENT_ID": client.client_id,
        "CONVEYOR_CLIENT_SECRET": client.secret,
    }
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "task", "submit", svc.name, "--batch", str(batch)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [int(position) for _, position in lines] == [1, 2, 3]

    async def with_the_async_sdk() -> list[Submitted]:
        async with AsyncConveyorClient(gateway.url, client.client_id, client.secret) as sdk:
            return await sdk.submit_batch(svc.name, [{"body": {"n": 9}}] * 2)

    with ConveyorClient(gateway.url, client.client_id, client.secret) as sdk:
        sync = sdk.submit_batch(svc.name, [{"body": {"n": 5}}], idempotency_key="k1")
        again = sdk.submit_batch(svc.name, [{"body": {"n": 5}}], idempotency_key="k1")
    assert sync[0].created and not again[0].created and again[0].task_id == sync[0].task_id
    assert [s.position for s in asyncio.run(with_the_async_sdk())] == [5, 6]
    assert _count(platform, svc.name) == 6


def test_a_batch_of_large_bodies_within_the_limits_is_stored(
    platform: Platform, database_url: str, amqp_url: str, procs: Processes
) -> None:
    """15 bodies of 1 MB of backslashes and quotes (a 15 MB batch, under the 16 MiB limit):
    PostgreSQL read the insert's array literal in quadratic time (7 s), past the statement
    timeout, and the batch was answered 503 503001 ("retry") at every try (found by a
    black-box test, with bodies of 340,000 empty objects). The bodies now go as a binary
    array of text, each cast on its own (0.1 s). A gateway whose statements may take 3 s."""
    svc = platform.service()
    env = gateway_env(database_url, amqp_url, CONVEYOR_DB_TIMEOUT="5")
    gateway = GatewayProcess(procs, env, "gateway-short-statements", "--no-background")
    bodies = [{"x": "\\" * 500_000}, {"x": ['"'] * 200_000}] * 7 + [{"x": "\\" * 500_000}]
    payload = strict_json.dumps({"tasks": [{"body": b, "delaySeconds": 600} for b in bodies]})
    assert 15_000_000 < len(payload) < 16 * 1024 * 1024
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(
            _batch_url(gateway, svc.name),
            content=payload,
            headers={"Content-Type": "application/json"},
        )
    assert answer.status_code == 201, answer.text
    stored = platform.sql(
        "SELECT request FROM tasks WHERE service = %(s)s ORDER BY id", {"s": svc.name}
    )
    assert [row[0] for row in stored] == bodies
