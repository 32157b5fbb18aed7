"""The gateway's /metrics (SPEC §11.6) against a real gateway, PostgreSQL and RabbitMQ.

* API answers are labelled by their route's template, never by the raw path: every path
  no route took shares one label, so a scanner cannot grow the registry;
* a task's end is counted once, by the statement that ended it, with its queue wait and
  run time; duplicate and late terminal events count nothing; a cancel is a FAILURE.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

from conveyor import topology
from conveyor.events import EventKind, TaskEvent, WireMessage, encode_event
from gateway.app import _route_label
from tests.support.amqp import publish, queues_of, wait_for_queues, wait_until
from tests.support.gateway import GatewayProcess, Platform, Service
from tests.support.metrics import samples, value

TASKS = "/v1/services/{service}/tasks"


def _scrape(gateway: GatewayProcess) -> str:
    with gateway.http() as http:
        answer = http.get("/metrics")
    assert answer.status_code == 200
    return answer.text


def _requests(text: str, route: str, status: str) -> float:
    return value(text, "conveyor_gateway_requests_total", route=route, status=status)


def test_requests_are_labelled_by_route_template(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service()
    before = _scrape(gateway)
    with gateway.http(svc.clients[0]) as http:
        created = http.post(gateway.tasks_url(svc.name), json={"body": {}})
        assert created.status_code == 201, created.text
        task_id = created.json()["data"]["taskId"]
        assert http.get(f"{gateway.tasks_url(svc.name)}/{task_id}").status_code == 200
        assert http.get(f"{gateway.tasks_url(svc.name)}/{uuid.uuid4()}").status_code == 404
        probes = ("/wp-login.php", f"/nothing/{uuid.uuid4()}", "/v1/servicez")
        for probe in probes:
            assert http.get(probe).status_code == 404
        for page in ("/openapi.json", "/docs", "/docs/swagger-ui.css"):
            assert http.get(page).status_code == 200, page
    after = _scrape(gateway)

    assert _requests(after, TASKS, "201") == _requests(before, TASKS, "201") + 1
    poll = TASKS + "/{task_id}"
    assert _requests(after, poll, "200") == _requests(before, poll, "200") + 1
    assert _requests(after, poll, "404") == _requests(before, poll, "404") + 1
    assert _requests(after, "unmatched", "404") == _requests(before, "unmatched", "404") + 3
    assert _requests(after, "unmatched", "200") == _requests(before, "unmatched", "200")
    for route in ("/openapi.json", "/docs", "/docs/{name}"):  # the pages count as themselves
        assert _requests(after, route, "200") == _requests(before, route, "200") + 1, route
    routes = {
        dict(labels)["route"]
        for (name, labels), _ in samples(after).items()
        if name == "conveyor_gateway_requests_total"
    }
    # no raw path became a label: neither the probes nor anything naming this task
    assert not any(svc.name in r or task_id in r or r in probes for r in routes), routes
    latency = samples(after)
    assert latency[("conveyor_gateway_request_seconds_count", (("route", TASKS),))] >= 1


def test_a_submission_answer_is_timed_by_phase(gateway: GatewayProcess, platform: Platform) -> None:
    """`store` is the commit of each accepted request, `publish` the confirm it waited for: a
    task to run later is stored and answered without one."""
    svc = platform.service()
    before = samples(_scrape(gateway))
    with gateway.http(svc.clients[0]) as http:
        for body in ({"body": {}}, {"body": {}}, {"body": {}, "delaySeconds": 600}):
            answer = http.post(gateway.tasks_url(svc.name), json=body)
            assert answer.status_code == 201, answer.text
        assert http.post(gateway.tasks_url(svc.name), json=[]).status_code == 400
    after = samples(_scrape(gateway))

    def grew(name: str, phase: str) -> float:
        key = (f"conveyor_gateway_submit_phase_seconds_{name}", (("phase", phase),))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("count", "store") == 3
    assert grew("count", "publish") == 2
    assert 0 < grew("sum", "store") < 30 and 0 < grew("sum", "publish") < 30


def test_a_route_without_a_template_is_unmatched() -> None:
    """FastAPI's included-router node has no path of its own; a label is a template or
    `unmatched`, never None nor a raw path."""
    assert _route_label({"type": "http"}) == "unmatched"
    assert _route_label({"type": "http", "route": object()}) == "unmatched"
    assert _route_label({"type": "http", "route": SimpleNamespace(path=None)}) == "unmatched"
    assert _route_label({"type": "http", "route": SimpleNamespace(path=TASKS)}) == TASKS


def _event(svc: Service, kind: EventKind, task_id: str, **fields: Any) -> WireMessage:
    return encode_event(TaskEvent(kind=kind, task_id=task_id, **fields), svc.name)


def _submitted(gateway: GatewayProcess, svc: Service) -> tuple[str, datetime]:
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(gateway.tasks_url(svc.name), json={"body": {}})
        assert answer.status_code == 201, answer.text
        task_id = answer.json()["data"]["taskId"]
        polled = http.get(f"{gateway.tasks_url(svc.name)}/{task_id}").json()["data"]
    return task_id, datetime.fromisoformat(polled["submitionDate"].replace("Z", "+00:00"))


def test_a_task_end_is_counted_once_with_its_wait_and_run_time(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    svc = platform.service()
    wait_for_queues(amqp_url, queues_of(svc.queue_name))
    ran, ran_sub = _submitted(gateway, svc)
    never_started, _ = _submitted(gateway, svc)
    cancelled, _ = _submitted(gateway, svc)
    began, ended = ran_sub + timedelta(seconds=2), ran_sub + timedelta(seconds=5)
    publish(
        amqp_url,
        topology.out_queue(svc.queue_name),
        [
            _event(svc, EventKind.STARTED, ran, host="h", attempt="a", time=began),
            _event(svc, EventKind.SUCCEEDED, ran, response=1, attempt="a", time=ended),
            # the same end again (a redelivered message), then a late contradicting one
            _event(svc, EventKind.SUCCEEDED, ran, response=1, attempt="a", time=ended),
            _event(svc, EventKind.FAILED, ran, error_message="late", attempt="a", time=ended),
            # failed before any attempt started: counted, but it neither waited nor ran
            _event(svc, EventKind.FAILED, never_started, error_message="no", time=ended),
        ],
    )
    s = {"service": svc.name}

    def finished(text: str, outcome: str) -> float:
        return value(text, "conveyor_tasks_finished_total", outcome=outcome, **s)

    wait_until(
        lambda: (t := _scrape(gateway)) and finished(t, "SUCCESS") and finished(t, "FAILURE"),
        timeout=15,
        what="both ends counted",
    )
    time.sleep(0.5)  # the duplicates were in the same batch or an earlier one: room to miscount
    text = _scrape(gateway)
    assert finished(text, "SUCCESS") == 1
    assert finished(text, "FAILURE") == 1
    assert value(text, "conveyor_task_run_seconds_count", **s) == 1
    assert abs(value(text, "conveyor_task_run_seconds_sum", **s) - 3.0) < 0.01
    assert value(text, "conveyor_task_run_seconds_bucket", le="5.0", **s) == 1
    assert value(text, "conveyor_task_run_seconds_bucket", le="2.5", **s) == 0
    assert value(text, "conveyor_task_queue_wait_seconds_count", **s) == 1
    assert abs(value(text, "conveyor_task_queue_wait_seconds_sum", **s) - 2.0) < 0.01

    with gateway.http(svc.clients[0]) as http:
        url = f"{gateway.tasks_url(svc.name)}/{cancelled}/cancel"
        assert http.post(url).status_code == 200
        assert http.post(url).status_code == 200  # cancelled already: the same answer
    text = _scrape(gateway)
    assert finished(text, "FAILURE") == 2
    assert value(text, "conveyor_task_queue_wait_seconds_count", **s) == 1
