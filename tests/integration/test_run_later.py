"""Run later (SPEC §11.4): `notBefore` / `delaySeconds` on a create or a batch item.

A delayed task is PENDING with `notBefore` in its poll, is published by the outbox relay once
due (never before, within about a second after), is counted by capacity but not in positions,
and is published exactly once even with two gateways and one of them killed around its time.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from conveyor.client import ConveyorClient
from conveyor.events import WireMessage, decode_submission
from tests.support.amqp import collect, message_count, take_all, wait_for_queues
from tests.support.gateway import GatewayProcess, Platform, Service, gateway_env
from tests.support.processes import Processes


def _rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _id(message: WireMessage) -> str:
    return decode_submission(message).task_id


def _service(platform: Platform, amqp_url: str, **options: Any) -> Service:
    """A new service, once the gateway has declared its queues (the fast path needs them)."""
    svc = platform.service(**options)
    wait_for_queues(amqp_url, [f"{svc.queue_name}-in"])
    return svc


def _published(
    url: str, queue: str, count: int, timeout: float, settle: float = 0.5
) -> list[WireMessage]:
    """The next `count` submissions on the service's `-in`."""
    return collect(url, f"{queue}-in", count, timeout=timeout, settle=settle)


def test_a_delayed_task_waits_then_is_published_once(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    svc = _service(platform, amqp_url)
    at = datetime.now(UTC) + timedelta(seconds=3)
    with gateway.http(svc.clients[0]) as http:
        by_time = http.post(
            gateway.tasks_url(svc.name), json={"body": {"n": 1}, "notBefore": _rfc3339(at)}
        )
        by_delay = http.post(
            gateway.tasks_url(svc.name), json={"body": {"n": 2}, "delaySeconds": 3}
        )
        now = http.post(gateway.tasks_url(svc.name), json={"body": {"n": 3}})
        assert by_time.status_code == by_delay.status_code == now.status_code == 201
        # Only the task that is due counts in positions.
        assert now.json()["data"]["taskPosition"] == 1
        assert by_time.json()["data"]["taskPosition"] == 0
        polled = http.get(f"{gateway.tasks_url(svc.name)}/{by_time.json()['data']['taskId']}")
        data = polled.json()["data"]
        assert data["status"] == "PENDING" and data["notBefore"] == _rfc3339(at)
        assert (
            "notBefore"
            not in http.get(f"{gateway.tasks_url(svc.name)}/{now.json()['data']['taskId']}").json()[
                "data"
            ]
        )
    first = _published(amqp_url, svc.queue_name, 1, timeout=5, settle=0.5)
    assert [_id(m) for m in first] == [now.json()["data"]["taskId"]]
    assert datetime.now(UTC) < at  # nothing else went out before its time
    later = _published(amqp_url, svc.queue_name, 2, timeout=10, settle=2.0)
    published_at = datetime.now(UTC)
    assert sorted(_id(m) for m in later) == sorted(
        [by_time.json()["data"]["taskId"], by_delay.json()["data"]["taskId"]]
    )
    assert published_at - at < timedelta(seconds=3 + 2.0 + 1.0)  # 2 s of settle included


def test_a_task_not_yet_due_answers_position_0_behind_due_ones(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    """Found by a sweep: behind two due tasks a delayed one answered `taskPosition` 2, on
    create, poll and a repeated Idempotency-Key alike; only due tasks have a place (§11.4)."""
    svc = _service(platform, amqp_url)
    url = gateway.tasks_url(svc.name)
    later = {"body": {}, "delaySeconds": 600}
    with gateway.http(svc.clients[0]) as http:
        due = [http.post(url, json={"body": {}}).json()["data"]["taskPosition"] for _ in "ab"]
        created = http.post(url, json=later, headers={"Idempotency-Key": "later"})
        repeated = http.post(url, json=later, headers={"Idempotency-Key": "later"})
        task_id = created.json()["data"]["taskId"]
        polled = http.get(f"{url}/{task_id}").json()["data"]
        batch = http.post(f"{url}/batch", json={"tasks": [later]}, headers={"Idempotency-Key": "b"})
        batch_again = http.post(
            f"{url}/batch", json={"tasks": [later]}, headers={"Idempotency-Key": "b"}
        )
        after = http.post(url, json={"body": {}}).json()["data"]["taskPosition"]
    assert due == [1, 2]
    assert (created.status_code, repeated.status_code) == (201, 200)
    assert created.json()["data"]["taskPosition"] == 0
    assert repeated.json()["data"] == created.json()["data"]
    assert polled["status"] == "PENDING" and polled["taskPosition"] == 0
    assert batch.json()["data"]["tasks"][0]["taskPosition"] == 0
    assert batch_again.json()["data"] == batch.json()["data"]
    assert after == 3  # and the delayed ones take no place from the next due one


def test_delay_seconds_count_on_the_database_clock_as_every_other_date(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    """Found by a sweep: `delaySeconds` was added to the gateway's own clock, where every
    other date (the submission, its due time, the relay's) is the database's: a gateway an
    hour behind ran tasks asked to wait 20 s at once. The due time is now the submission's
    date plus the delay, to the microsecond, one and the other from one statement."""
    svc = _service(platform, amqp_url)
    url = gateway.tasks_url(svc.name)
    with gateway.http(svc.clients[0]) as http:
        single = http.post(url, json={"body": {}, "delaySeconds": 600}).json()["data"]["taskId"]
        batch = http.post(f"{url}/batch", json={"tasks": [{"body": {}, "delaySeconds": 60}]})
    in_batch = batch.json()["data"]["tasks"][0]["taskId"]
    rows = platform.sql(
        "SELECT task_id::text, extract(epoch FROM not_before - submission_date)::float8"
        " FROM tasks WHERE task_id = ANY(%(ids)s::uuid[])",
        {"ids": [single, in_batch]},
    )
    assert dict(rows) == {single: 600.0, in_batch: 60.0}


def test_a_past_not_before_is_published_at_once(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    svc = _service(platform, amqp_url)
    past = _rfc3339(datetime.now(UTC) - timedelta(hours=1))
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(gateway.tasks_url(svc.name), json={"body": {}, "notBefore": past})
    assert answer.status_code == 201 and answer.json()["data"]["taskPosition"] == 1
    assert len(_published(amqp_url, svc.queue_name, 1, timeout=5, settle=0.5)) == 1


def test_a_time_long_past_means_now(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    """A time already past means now: stored as the submission's, so that the time to live
    counts from the submission (a 1970 `notBefore` was expired by the next reaper pass), and a
    time before year 1 in UTC (`0001-01-01T00:00:00+14:00`) no longer makes every read of
    the task fail (found by a black-box test)."""
    svc = _service(platform, amqp_url)
    ids = []
    with gateway.http(svc.clients[0]) as http:
        for past in ("1970-01-01T00:00:00Z", "0001-01-01T00:00:00+14:00"):
            answer = http.post(gateway.tasks_url(svc.name), json={"body": {}, "notBefore": past})
            assert answer.status_code == 201, answer.text
            ids.append(answer.json()["data"]["taskId"])
        for task_id in ids:
            polled = http.get(f"{gateway.tasks_url(svc.name)}/{task_id}")
            assert polled.status_code == 200, polled.text
            data = polled.json()["data"]
            assert data["notBefore"] == data["submitionDate"], data
    rows = platform.sql(
        "SELECT count(*) FROM tasks WHERE task_id = ANY(%(ids)s::uuid[])"
        " AND not_before = submission_date",
        {"ids": ids},
    )
    assert rows == [(2,)]


@pytest.mark.parametrize(
    ("item", "path"),
    [
        ({"notBefore": "2026-11-24T10:00:00Z", "delaySeconds": 5}, "delaySeconds"),
        ({"delaySeconds": 31 * 24 * 3600}, "delaySeconds"),
        ({"delaySeconds": -1}, "delaySeconds"),
        ({"delaySeconds": 1.5}, "delaySeconds"),
        ({"delaySeconds": True}, "delaySeconds"),
        ({"delaySeconds": "10"}, "delaySeconds"),
        ({"notBefore": "tomorrow"}, "notBefore"),
        ({"notBefore": "2026-11-24T10:00:00"}, "notBefore"),  # no offset
        ({"notBefore": 1795562511}, "notBefore"),
        ({"notBefore": "2999-01-01T00:00:00Z"}, "notBefore"),  # past the maximum delay
        ({"notBefore": "9999-12-31T23:59:59-23:59"}, "notBefore"),  # after year 9999 in UTC
        ({"notBefore": "2026-11-24T10:00:00Z" + "0" * 100}, "notBefore"),
        # ISO 8601 forms that are not RFC 3339 date-times (§5.6)
        ({"notBefore": "2026-W48-5T18:00:00Z"}, "notBefore"),  # week date
        ({"notBefore": "20261127T190000Z"}, "notBefore"),  # basic format
        ({"notBefore": "2026-11-27 19:00:00Z"}, "notBefore"),  # space for T
        ({"notBefore": "2026-11-27T19:00Z"}, "notBefore"),  # no seconds
        ({"notBefore": "2026-11-27T19Z"}, "notBefore"),  # hours alone
        ({"notBefore": "2026-11-27T19:00:00,5Z"}, "notBefore"),  # comma fraction
        ({"notBefore": "2026-11-27T19:00:00.Z"}, "notBefore"),  # empty fraction
        ({"notBefore": "2026-11-27T19:00:00+0100"}, "notBefore"),  # offset without colon
        ({"notBefore": "2026-11-27T19:00:00+01"}, "notBefore"),  # offset hours alone
        ({"notBefore": "2026-11-27T19:00:00+01:00:30"}, "notBefore"),  # offset seconds
        ({"notBefore": "\uff12\uff10\uff12\uff16-11-27T19:00:00Z"}, "notBefore"),  # not ASCII
    ],
)
def test_bad_times_are_400002_naming_the_field(
    gateway: GatewayProcess, platform: Platform, item: dict[str, Any], path: str
) -> None:
    svc = platform.service()
    with gateway.http(svc.clients[0]) as http:
        single = http.post(gateway.tasks_url(svc.name), json={"body": {}, **item})
        batch = http.post(
            gateway.tasks_url(svc.name) + "/batch",
            json={"tasks": [{"body": {}}, {"body": {}, **item}]},
        )
    for answer, expected in ((single, path), (batch, f"tasks/1/{path}")):
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["number"] == 400002
        assert answer.json()["error"]["errors"][0]["path"] == expected
    assert platform.sql("SELECT count(*) FROM tasks WHERE service = %(s)s", {"s": svc.name}) == [
        (0,)
    ]


def test_rfc3339_times_are_read_whatever_their_case_and_fraction(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """RFC 3339 §5.6: `T` and `Z` may be lower case, the fraction has any number of digits."""
    svc = platform.service()
    when = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    stamp = when.strftime("%Y-%m-%dt%H:%M:%S")
    spellings = [f"{stamp}z", f"{stamp}.123456789z", f"{stamp}+00:00", f"{stamp}.5-00:00"]
    with gateway.http(svc.clients[0]) as http:
        for spelling in spellings:
            single = http.post(
                gateway.tasks_url(svc.name), json={"body": {}, "notBefore": spelling}
            )
            batch = http.post(
                gateway.tasks_url(svc.name) + "/batch",
                json={"tasks": [{"body": {}, "notBefore": spelling}]},
            )
            assert (single.status_code, batch.status_code) == (201, 201), (spelling, single.text)
            polled = http.get(f"{gateway.tasks_url(svc.name)}/{single.json()['data']['taskId']}")
            got = datetime.fromisoformat(polled.json()["data"]["notBefore"])
            assert abs(got - when) < timedelta(seconds=1), (spelling, got)


def test_offsets_beyond_what_postgresql_takes_are_read_too(
    gateway: GatewayProcess, platform: Platform
) -> None:
    """Found by a sweep: RFC 3339 offsets go to ±23:59, PostgreSQL's to ±15:59, and a
    `notBefore` at +16:00 or -20:00 was 500 500001 (a single, a batch, a keyed submission
    alike), as was one long past at +23:59. Each is read as the instant it names."""
    svc = platform.service()
    when = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    ahead = [
        (when + timedelta(hours=16)).strftime("%Y-%m-%dT%H:%M:%S+16:00"),
        (when - timedelta(hours=20)).strftime("%Y-%m-%dT%H:%M:%S-20:00"),
        (when + timedelta(hours=23, minutes=59)).strftime("%Y-%m-%dT%H:%M:%S+23:59"),
    ]
    past = ["2020-01-01T00:00:00+23:00", "0001-01-01T00:00:00+23:59", "0001-01-01T00:00:00-23:59"]
    with gateway.http(svc.clients[0]) as http:
        for n, spelling in enumerate(ahead + past):
            single = http.post(
                gateway.tasks_url(svc.name), json={"body": {}, "notBefore": spelling}
            )
            keyed = http.post(
                gateway.tasks_url(svc.name),
                json={"body": {}, "notBefore": spelling},
                headers={"Idempotency-Key": f"offset-{n}"},
            )
            batch = http.post(
                gateway.tasks_url(svc.name) + "/batch",
                json={"tasks": [{"body": {}, "notBefore": spelling}]},
            )
            answers = (single.status_code, keyed.status_code, batch.status_code)
            assert answers == (201, 201, 201), (spelling, single.text, keyed.text, batch.text)
            polled = http.get(f"{gateway.tasks_url(svc.name)}/{single.json()['data']['taskId']}")
            data = polled.json()["data"]
            if spelling in ahead:
                got = datetime.fromisoformat(data["notBefore"])
                assert abs(got - when) < timedelta(seconds=1), (spelling, got)
            else:
                assert data["notBefore"] == data["submitionDate"], (spelling, data)


def test_batch_items_wait_for_their_own_time_and_capacity_counts_them(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    svc = _service(platform, amqp_url, capacity=3)
    items = [{"body": {"n": 0}}, {"body": {"n": 1}, "delaySeconds": 2}, {"body": {"n": 2}}]
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(gateway.tasks_url(svc.name) + "/batch", json={"tasks": items})
        assert answer.status_code == 201, answer.text
        tasks = answer.json()["data"]["tasks"]
        assert [t["taskPosition"] for t in tasks] == [1, 0, 2]  # the delayed one is not due
        full = http.post(gateway.tasks_url(svc.name), json={"body": {}, "delaySeconds": 60})
        assert (full.status_code, full.json()["error"]["number"]) == (429, 429001)
    now = _published(amqp_url, svc.queue_name, 2, timeout=5, settle=0.5)
    assert {_id(m) for m in now} == {
        tasks[0]["taskId"],
        tasks[2]["taskId"],
    }
    later = _published(amqp_url, svc.queue_name, 1, timeout=8, settle=0.5)
    assert [_id(m) for m in later] == [tasks[1]["taskId"]]


def test_two_gateways_and_a_kill_publish_a_due_task_exactly_once(
    procs: Processes, platform: Platform, database_url: str, amqp_url: str
) -> None:
    """Both relays see the due rows; one of them dies around their time, and comes back."""
    env = gateway_env(database_url, amqp_url)
    first, second = GatewayProcess(procs, env, "gw-a"), GatewayProcess(procs, env, "gw-b")
    svc = _service(platform, amqp_url)
    with ConveyorClient(first.url, *svc.clients[0].auth) as client:
        submitted = client.submit_batch(
            svc.name, [{"body": {"n": i}, "delaySeconds": 2} for i in range(50)]
        )
    ids = {s.task_id for s in submitted}
    time.sleep(1.5)
    first.proc.kill()  # close to the due time: its claims, if any, run out on their lease
    got = _published(amqp_url, svc.queue_name, 50, timeout=15, settle=3.0)
    restarted = GatewayProcess(procs, env, "gw-a2")
    time.sleep(2.0)  # a restarted relay must not publish them again either
    got += take_all(amqp_url, f"{svc.queue_name}-in")
    task_ids = [_id(m) for m in got]
    assert sorted(task_ids) == sorted(ids), f"{len(task_ids)} published for 50 tasks"
    assert message_count(amqp_url, f"{svc.queue_name}-in") == 0
    second.proc.kill()
    restarted.proc.kill()


def test_the_sdk_schedules_tasks(gateway: GatewayProcess, platform: Platform) -> None:
    svc = platform.service()
    at = datetime.now(UTC) + timedelta(minutes=5)
    with ConveyorClient(gateway.url, *svc.clients[0].auth) as client:
        delayed = client.submit(svc.name, {"n": 1}, delay_seconds=600)
        timed = client.submit(svc.name, {"n": 2}, not_before=at)
        task = client.get(svc.name, timed.task_id)
        assert task.status == "PENDING" and task.not_before is not None
        assert abs((task.not_before - at).total_seconds()) < 0.01
        later = client.get(svc.name, delayed.task_id).not_before
        assert later is not None and later > datetime.now(UTC) + timedelta(seconds=590)


def test_a_task_once_due_joins_the_queue_behind_those_already_in_it(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    """Found by an audit: A (`delaySeconds` 2), then B and C, answered 0, 1, 2; once A was due
    the polls said A=1, B=2, C=3, while A went out behind B and C (a dispatcher ran B, C, A)
    and B was moved back. A task's place counts from when it became due: B=1, C=2, A=3, and a
    delayed batch item after A is 4; a task submitted then is 5 (SPEC §3.1, §11.4)."""
    svc = _service(platform, amqp_url)
    url = gateway.tasks_url(svc.name)
    later = {"body": {}, "delaySeconds": 2}
    with gateway.http(svc.clients[0]) as http:
        a = http.post(url, json=later, headers={"Idempotency-Key": "a"}).json()["data"]
        batch = http.post(f"{url}/batch", json={"tasks": [later]}, headers={"Idempotency-Key": "d"})
        d = batch.json()["data"]["tasks"][0]
        b = http.post(url, json={"body": {}}).json()["data"]
        c = http.post(url, json={"body": {}}).json()["data"]
        assert [t["taskPosition"] for t in (a, d, b, c)] == [0, 0, 1, 2]
        # B and C go out at once, A and D once due, behind them
        published = [_id(m) for m in _published(amqp_url, svc.queue_name, 4, timeout=8)]
        assert published[:2] == [b["taskId"], c["taskId"]], published
        assert sorted(published[2:]) == sorted([a["taskId"], d["taskId"]]), published

        def place(task: dict[str, Any]) -> int:
            polled = http.get(f"{url}/{task['taskId']}").json()["data"]
            assert polled["status"] == "PENDING", polled
            return polled["taskPosition"]

        assert [place(t) for t in (b, c, a, d)] == [1, 2, 3, 4]
        again = http.post(url, json=later, headers={"Idempotency-Key": "a"})
        assert (again.status_code, again.json()["data"]["taskPosition"]) == (200, 3)
        batch_again = http.post(
            f"{url}/batch", json={"tasks": [later]}, headers={"Idempotency-Key": "d"}
        )
        assert batch_again.status_code == 200
        assert batch_again.json()["data"]["tasks"][0]["taskPosition"] == 4
        e = http.post(url, json={"body": {}}).json()["data"]
        assert e["taskPosition"] == 5
        assert [place(t) for t in (b, c, a, d, e)] == [1, 2, 3, 4, 5]


def test_tasks_the_relay_publishes_reach_the_queue_in_their_order(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    """Found by a black-box sweep: tasks due at once ran up to 199 places out of order (the
    relay's claim returned its batch of 200 in no particular order), where their places said
    otherwise: a batch of run-later tasks reaches `-in` in the batch's order."""
    svc = _service(platform, amqp_url)
    url = gateway.tasks_url(svc.name)
    items = [{"body": {"n": n}, "delaySeconds": 2} for n in range(300)]
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(f"{url}/batch", json={"tasks": items})
    assert answer.status_code == 201, answer.text
    submitted = [task["taskId"] for task in answer.json()["data"]["tasks"]]
    wait_until_count = time.monotonic() + 20
    while message_count(amqp_url, f"{svc.queue_name}-in") < 300:
        assert time.monotonic() < wait_until_count, "not all published"
        time.sleep(0.2)
    published = [_id(m) for m in take_all(amqp_url, f"{svc.queue_name}-in")]
    assert published == submitted


def test_the_relay_publishes_a_body_as_the_fast_path_does(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    """Found by a black-box sweep: the relay read the body back from `jsonb`, which writes a
    number's exponent out in full, so a delayed task of 0.9 MB reached its function as 46 MB
    (and FAILed there), its floats as integers, its keys reordered, where the same task
    published at once went out as sent. Both paths now publish the same bytes."""
    svc = _service(platform, amqp_url)
    body = b'{"b": 1.5e20, "a": [1e308, 1e-300, 1.0, 10, -0.0], "c": {"z": 1, "y": "\\u00e9"}}'
    with gateway.http(svc.clients[0]) as http:
        for tail in (b"}", b', "delaySeconds": 1}'):
            answer = http.post(
                gateway.tasks_url(svc.name),
                content=b'{"body": ' + body + tail,
                headers={"content-type": "application/json"},
            )
            assert answer.status_code == 201, answer.text
    now, later = _published(amqp_url, svc.queue_name, 2, timeout=10, settle=0.5)
    assert later.body == now.body, (now.body, later.body[:200])
    assert len(now.body) < 2 * len(body)
