"""An Idempotency-Key means one request per client and service (SPEC §3.1, §11.2).

Found by an audit: a key used on `…/tasks/batch` and then on `…/tasks` made two tasks (the
two kinds had separate namespaces); a repeat with another body under the same key answered
`200` with the first task, silently; and a batch with as many items but other bodies answered
`200` with the first batch's ids. A key is now kept with a fingerprint of its request: a true
repeat answers `200` with the same ids, anything else under the key `400 400002` naming the
`Idempotency-Key` (once the request passes its own checks), for single tasks and batches alike. Rows from before the fingerprints
(migration 0013) have none, and match any request, as before.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from typing import Any

import httpx

from tests.security.helpers import auth_header, raw_exchange, request_bytes
from tests.support.gateway import GatewayProcess, Platform


def _key() -> dict[str, str]:
    return {"Idempotency-Key": f"key-{uuid.uuid4().hex}"}


def _refused(answer: httpx.Response) -> None:
    """`400 400002`, its `errors` naming the header."""
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["number"] == 400002, error
    assert [e["path"] for e in error["errors"]] == ["Idempotency-Key"], error
    assert "different request" in error["errors"][0]["message"], error


def _tasks(platform: Platform, service: str) -> int:
    return platform.sql("SELECT count(*) FROM tasks WHERE service = %(s)s", {"s": service})[0][0]


def test_a_key_used_for_a_batch_is_refused_for_a_single_task_and_the_reverse(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service()
    url = gateway.tasks_url(svc.name)
    batch_first, single_first = _key(), _key()
    with gateway.http(svc.clients[0]) as http:
        batch = http.post(f"{url}/batch", json={"tasks": [{"body": {}}]}, headers=batch_first)
        single_after_batch = http.post(url, json={"body": {}}, headers=batch_first)
        single = http.post(url, json={"body": {}}, headers=single_first)
        batch_after_single = http.post(
            f"{url}/batch", json={"tasks": [{"body": {}}]}, headers=single_first
        )
        # and the keys still answer the requests they were used for
        batch_again = http.post(f"{url}/batch", json={"tasks": [{"body": {}}]}, headers=batch_first)
        single_again = http.post(url, json={"body": {}}, headers=single_first)
    assert (batch.status_code, single.status_code) == (201, 201)
    _refused(single_after_batch)
    _refused(batch_after_single)
    assert batch_again.status_code == 200
    assert batch_again.json()["data"] == batch.json()["data"]
    assert single_again.status_code == 200
    assert single_again.json()["data"]["taskId"] == single.json()["data"]["taskId"]
    assert _tasks(platform, svc.name) == 2


def test_a_key_reused_for_another_single_request_is_refused(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service()
    url = gateway.tasks_url(svc.name)
    key = _key()
    hook = {"type": "https", "url": "https://localhost:9/hook"}  # an allowed host here
    first_request = {"body": {"a": 1, "b": [1, 2]}, "delaySeconds": 600}
    with gateway.http(svc.clients[0]) as http:
        first = http.post(url, json=first_request, headers=key)
        task_id = first.json()["data"]["taskId"]
        # the same request: keys in another order, other spacing, a field given as null
        raw = b'{ "delaySeconds": 600, "callback": null, "body": {"b": [1, 2], "a": 1} }'
        same = http.post(url, content=raw, headers={**key, "Content-Type": "application/json"})
        others = [
            {"body": {"a": 2, "b": [1, 2]}, "delaySeconds": 600},  # another body
            {"body": {"a": 1, "b": [2, 1]}, "delaySeconds": 600},
            {"body": {"a": 1, "b": [1, 2]}, "delaySeconds": 601},  # another time
            {"body": {"a": 1, "b": [1, 2]}},
            {**first_request, "callback": hook},  # a callback
        ]
        refused = [http.post(url, json=other, headers=key) for other in others]
        again = http.post(url, json=first_request, headers=key)
    assert first.status_code == 201, first.text
    assert same.status_code == 200 and same.json()["data"]["taskId"] == task_id, same.text
    for answer in refused:
        _refused(answer)
    assert again.status_code == 200 and again.json()["data"]["taskId"] == task_id
    assert _tasks(platform, svc.name) == 1


def test_a_key_reused_for_another_batch_is_refused(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service()
    url = gateway.tasks_url(svc.name) + "/batch"
    key = _key()
    items = [{"body": {"n": 1}}, {"body": {"n": 2}, "delaySeconds": 60}]
    with gateway.http(svc.clients[0]) as http:
        first = http.post(url, json={"tasks": items}, headers=key)
        ids = [t["taskId"] for t in first.json()["data"]["tasks"]]
        others = [
            [{"body": {"n": 1}}, {"body": {"n": 3}, "delaySeconds": 60}],  # as many, another body
            list(reversed(items)),  # the same items in another order
            [{"body": {"n": 1}}, {"body": {"n": 2}}],  # another time
            items[:1],  # fewer
            [*items, {"body": {}}],  # more
        ]
        refused = [http.post(url, json={"tasks": other}, headers=key) for other in others]
        again = http.post(url, json={"tasks": items}, headers=key)
    assert first.status_code == 201, first.text
    for answer in refused:
        _refused(answer)
    assert again.status_code == 200
    assert [t["taskId"] for t in again.json()["data"]["tasks"]] == ids
    assert _tasks(platform, svc.name) == 2


def test_rows_from_before_the_fingerprints_match_any_request(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """Keys written before migration 0013 have no fingerprint: they answer as they did."""
    svc = platform.service()
    url = gateway.tasks_url(svc.name)
    single, batch = _key(), _key()
    with gateway.http(svc.clients[0]) as http:
        task = http.post(url, json={"body": {"n": 1}}, headers=single).json()["data"]
        tasks = http.post(
            f"{url}/batch", json={"tasks": [{"body": {"n": 1}}] * 2}, headers=batch
        ).json()["data"]["tasks"]
        stored = platform.sql(
            "SELECT count(*) FROM tasks WHERE service = %(s)s AND idempotency_fingerprint IS NULL",
            {"s": svc.name},
        )
        assert stored == [(0,)]
        platform.sql(
            "UPDATE tasks SET idempotency_fingerprint = NULL WHERE service = %(s)s",
            {"s": svc.name},
        )
        old_single = http.post(url, json={"body": {"n": 2}}, headers=single)
        old_batch = http.post(
            f"{url}/batch", json={"tasks": [{"body": {"n": 2}}] * 2}, headers=batch
        )
    assert old_single.status_code == 200
    assert old_single.json()["data"]["taskId"] == task["taskId"]
    assert old_batch.status_code == 200
    assert [t["taskId"] for t in old_batch.json()["data"]["tasks"]] == [t["taskId"] for t in tasks]


async def _burst(
    gateway: GatewayProcess, auth: tuple[str, str], requests: list[tuple[str, dict[str, Any]]]
) -> list[tuple[int, Any]]:
    """All of `requests` (path, JSON) at once, under one key: each answer's status and what
    it names (the task ids, or the error's number)."""
    headers = _key()
    n = len(requests)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(
        base_url=gateway.url, auth=auth, limits=limits, timeout=60
    ) as http:
        await http.get("/v1/services/none/tasks/x")  # the credentials cached: a race on the key
        start = asyncio.Event()

        async def one(path: str, payload: dict[str, Any]) -> tuple[int, Any]:
            await start.wait()
            answer = await http.post(path, content=json.dumps(payload), headers=headers)
            body = answer.json()
            if "data" in body:
                data = body["data"]
                return answer.status_code, [t["taskId"] for t in data.get("tasks", [data])]
            return answer.status_code, body["error"]["number"]

        jobs = [asyncio.create_task(one(path, payload)) for path, payload in requests]
        await asyncio.sleep(0.05)
        start.set()
        return list(await asyncio.gather(*jobs))


def test_concurrent_requests_under_one_key_make_one_task(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """30 at once: the same request, another body, or a batch. One of them is stored; the
    repeats of that one answer it, the others are refused."""
    svc = platform.service()
    url = gateway.tasks_url(svc.name)
    client = svc.clients[0]
    same = asyncio.run(_burst(gateway, client.auth, [(url, {"body": {"n": 1}})] * 30))
    assert Counter(status for status, _ in same) == Counter({201: 1, 200: 29}), same
    assert len({tuple(ids) for _, ids in same}) == 1, same
    assert _tasks(platform, svc.name) == 1

    mixed = (
        [(url, {"body": {"n": 1}})] * 10
        + [(url, {"body": {"n": 2}})] * 10
        + [(f"{url}/batch", {"tasks": [{"body": {"n": 1}}]})] * 10
    )
    answers = asyncio.run(_burst(gateway, client.auth, mixed))
    stored = [ids for status, ids in answers if status == 201]
    assert len(stored) == 1, answers
    # every other answer is the same request's repeat (200, the same ids) or a refusal
    groups = [answers[:10], answers[10:20], answers[20:]]
    winner = next(g for g in groups if (201, stored[0]) in g)
    assert all(answer in ((201, stored[0]), (200, stored[0])) for answer in winner), answers
    losers = [answer for g in groups if g is not winner for answer in g]
    assert all(answer == (400, 400002) for answer in losers), answers
    assert _tasks(platform, svc.name) == 2


def test_a_repeat_is_answered_with_its_task_after_the_service_got_stricter(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """Found by a black-box test: a repeat was checked against today's configuration before
    its key was looked up, so a client retrying after a lost answer was told `400 400001`
    once the service's schema had become stricter (or `400002` once the longest delay or the
    callback policy had), although its task existed and ran. A repeat answers its task."""
    svc = platform.service()
    url = gateway.tasks_url(svc.name)
    single, batch = _key(), _key()
    with gateway.http(svc.clients[0]) as http:
        first = http.post(url, json={"body": {"n": 1}}, headers=single)
        first_batch = http.post(
            f"{url}/batch", json={"tasks": [{"body": {"n": 2}}, {"body": {"n": 3}}]}, headers=batch
        )
        assert (first.status_code, first_batch.status_code) == (201, 201)
        strict = {"type": "object", "required": ["sleep"]}
        platform.apply(
            {"services": [{"name": svc.name, "queueName": svc.queue_name, "jsonSchema": strict}]}
        )
        for _ in range(100):  # until this gateway has the new schema
            if http.post(url, json={"body": {"n": 0}}).status_code == 400:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the stricter schema never applied")
        again = http.post(url, json={"body": {"n": 1}}, headers=single)
        batch_again = http.post(
            f"{url}/batch", json={"tasks": [{"body": {"n": 2}}, {"body": {"n": 3}}]}, headers=batch
        )
        other = http.post(url, json={"body": {"n": 9}}, headers=single)
        fresh = http.post(url, json={"body": {"n": 1}}, headers=_key())
    assert again.status_code == 200, again.text
    assert again.json()["data"]["taskId"] == first.json()["data"]["taskId"]
    assert batch_again.status_code == 200, batch_again.text
    ids = [t["taskId"] for t in batch_again.json()["data"]["tasks"]]
    assert ids == [t["taskId"] for t in first_batch.json()["data"]["tasks"]]
    # another request under the key, which fails today's schema: refused for that first
    # (docs/api.md's order), the key's reuse only for a request that passes every check
    assert other.status_code == 400 and other.json()["error"]["number"] == 400001
    assert fresh.status_code == 400 and fresh.json()["error"]["number"] == 400001


def test_a_key_given_on_two_header_lines_is_refused(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """Found by a black-box test: two `Idempotency-Key` lines made the first one the key, so
    whether a retry found its task depended on any proxy that joins them into one line (RFC
    9110 §5.3). Two lines are refused; one line, whatever it holds, is one key."""
    svc = platform.service()
    url = gateway.tasks_url(svc.name)
    with gateway.http(svc.clients[0]) as http:
        both = http.post(
            url,
            json={"body": {}},
            headers=[("Idempotency-Key", "key-a"), ("Idempotency-Key", "key-b")],
        )
        batch = http.post(
            f"{url}/batch",
            json={"tasks": [{"body": {}}]},
            headers=[("Idempotency-Key", "key-a"), ("Idempotency-Key", "key-b")],
        )
    for answer in (both, batch):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["number"] == 400002
        assert error["errors"] == [{"path": "Idempotency-Key", "message": "given more than once"}]
    assert _tasks(platform, svc.name) == 0


def test_a_key_reused_for_an_invalid_request_is_refused_for_what_is_wrong_with_it(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """docs/api.md's order: the request's own errors (the schema's 400001, then its fields'
    400002) before a key already used for another request. The key's refusal hid them: a
    client fixing its request was told about the key first (found by a black-box test)."""
    svc = platform.service(jsonSchema={"type": "object", "properties": {"n": {"type": "number"}}})
    url = gateway.tasks_url(svc.name)
    key = _key()
    with gateway.http(svc.clients[0]) as http:
        assert http.post(url, json={"body": {"n": 1}}, headers=key).status_code == 201
        assert (
            http.post(f"{url}/batch", json={"tasks": [{"body": {"n": 1}}]}, headers=key).status_code
            == 400
        )
        answers = {
            "schema": http.post(url, json={"body": {"n": "x"}}, headers=key),
            "field": http.post(url, json={"body": {"n": 1}, "zzz": 1}, headers=key),
            "batch schema": http.post(
                f"{url}/batch", json={"tasks": [{"body": {"n": "x"}}]}, headers=key
            ),
            "batch field": http.post(
                f"{url}/batch", json={"tasks": [{"body": {}, "zzz": 1}]}, headers=key
            ),
        }
    paths = {
        what: (
            answer.json()["error"]["number"],
            [e["path"] for e in answer.json()["error"]["errors"]],
        )
        for what, answer in answers.items()
    }
    assert paths == {
        "schema": (400001, ["body/n"]),
        "field": (400002, ["zzz"]),
        "batch schema": (400001, ["tasks/0/body/n"]),
        "batch field": (400002, ["tasks/0/zzz"]),
    }
    assert _tasks(platform, svc.name) == 1


def test_whitespace_around_a_key_is_not_part_of_it(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """Found by a black-box sweep: `Idempotency-Key: k ` made another task than `k` (the
    server dropped the spaces before a value, not after it), so a retry through a client or
    proxy that writes the header another way ran the task twice. Whitespace around a header's
    value is not part of it (RFC 9110 §5.5)."""
    svc = platform.service()
    key = f"key-{uuid.uuid4().hex}"
    statuses = []
    for written in (key, f"{key} ", f"{key}\t \t", f"   {key}  "):
        headers = {
            "Authorization": auth_header(svc.clients[0]),
            "Content-Type": "application/json",
            "Content-Length": "11",
            "Idempotency-Key": written,
        }
        answer = raw_exchange(
            gateway, request_bytes("POST", gateway.tasks_url(svc.name), headers, b'{"body":{}}')
        )
        statuses.append(answer.status)
    assert statuses == [201, 200, 200, 200], statuses
    assert _tasks(platform, svc.name) == 1
    [(stored,)] = platform.sql(
        "SELECT idempotency_key FROM tasks WHERE service = %(s)s", {"s": svc.name}
    )
    assert stored == key
