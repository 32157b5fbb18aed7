"""One route table: metrics name the routes, 405 says what is allowed, OpenAPI chains
create to poll."""

from __future__ import annotations

import re

import httpx

from tests.support.gateway import GatewayProcess, Platform


def _count(metrics: str, route: str, status: str) -> float:
    pattern = (
        r'^conveyor_gateway_requests_total\{route="'
        + re.escape(route)
        + r'",status="'
        + status
        + r'"\} ([0-9.e+]+)$'
    )
    found = re.search(pattern, metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_metrics_label_create_and_poll_by_their_route(
    gateway: GatewayProcess, platform: Platform
) -> None:
    svc = platform.service()
    tasks = "/v1/services/{service}/tasks"
    with gateway.http(svc.clients[0]) as http:
        before = http.get("/metrics").text
        created = http.post(gateway.tasks_url(svc.name), json={"body": {}})
        assert created.status_code == 201, created.text
        task_id = created.json()["data"]["taskId"]
        assert http.get(f"{gateway.tasks_url(svc.name)}/{task_id}").status_code == 200
        after = http.get("/metrics").text
    assert _count(after, tasks, "201") == _count(before, tasks, "201") + 1
    assert (
        _count(after, tasks + "/{task_id}", "200")
        == _count(before, tasks + "/{task_id}", "200") + 1
    )


def test_405_names_the_allowed_methods(gateway: GatewayProcess, platform: Platform) -> None:
    svc = platform.service()
    with gateway.http(svc.clients[0]) as http:
        answer = http.delete(gateway.tasks_url(svc.name))
    assert answer.status_code == 405
    assert answer.json()["error"]["number"] == 405000
    assert "POST" in answer.headers["allow"]


def test_openapi_links_create_to_poll(gateway: GatewayProcess) -> None:
    document = httpx.get(f"{gateway.url}/openapi.json").json()
    create = document["paths"]["/v1/services/{service}/tasks"]["post"]
    link = create["responses"]["201"]["links"]["poll"]
    assert link["operationId"] == "poll"
    assert link["parameters"]["task_id"] == "$response.body#/data/taskId"
    poll = document["paths"]["/v1/services/{service}/tasks/{task_id}"]["get"]
    assert poll["operationId"] == "poll"
    assert {"403", "404", "503"} <= set(poll["responses"])
    assert {"400", "403", "404", "413", "429", "503"} <= set(create["responses"])
    assert "422" not in create["responses"]


def test_openapi_says_how_to_authenticate(gateway: GatewayProcess) -> None:
    """Found by a sweep: the document named no security scheme, so neither Swagger UI nor a
    generated client knew that every API call takes HTTP Basic credentials."""
    document = httpx.get(f"{gateway.url}/openapi.json").json()
    assert document["components"]["securitySchemes"]["basic"] == {
        "type": "http",
        "scheme": "basic",
        "description": "a client id and secret; an operator's on /v1/admin",
    }
    operations = [
        (path, operation)
        for path, item in document["paths"].items()
        for operation in item.values()
        if path.startswith("/v1/")
    ]
    assert operations
    assert all(operation["security"] == [{"basic": []}] for _, operation in operations)
