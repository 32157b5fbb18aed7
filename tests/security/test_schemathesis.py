"""Property-based fuzzing of the real gateway against its own OpenAPI document.

Schemathesis generates requests from the gateway's OpenAPI document and checks
every answer of a real gateway process: no 5xx, only documented status codes
and content types, and bodies that match the documented schemas. Path
parameters are steered so that requests also hit a real service, and polls
also hit real tasks in every state.

The schema is built from the app in-process at import time, because pytest
needs the operations to collect the tests: schemathesis' lazy loader
(`schemathesis.pytest.from_fixture`, which would load `<gateway.url>/openapi.json`)
breaks on pytest 9.2 (it reads `Node._nodeid`, which no longer exists).
`test_served_document_is_the_one_fuzzed` proves the running gateway serves
exactly that document at /openapi.json.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway.app import create_app
from tests.support.gateway import Client, GatewayProcess, Platform, gateway_env
from tests.support.processes import Processes

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
BODY_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 1000}}}
SERVICE = f"fuzz-{uuid.uuid4().hex[:8]}"
TASK_IDS: list[str] = []  # filled by the `client` fixture before any case is generated
SEEN: Counter[str] = Counter()  # "METHOD path -> status": what the fuzzing exercised
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))

DOCUMENT = create_app().openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)


@schema.hook
def flatmap_path_parameters(context: Any, path_parameters: dict[str, Any]):
    """Each generated path also comes aimed at the real service, and at its real tasks."""
    if path_parameters is None:  # a route without path parameters
        return st.just(path_parameters)
    real = {**path_parameters, "service": SERVICE}
    options = [real, path_parameters]
    if "task_id" in path_parameters:
        options += [{**real, "task_id": task_id} for task_id in TASK_IDS]
    return st.sampled_from(options)


def _move(platform: Platform, task_id: str, status: str) -> None:
    """Puts a real task in a later state, as the result consumer would."""
    platform.sql(
        """
        UPDATE tasks SET status = %(status)s, start_date = now(), progress = 42.5,
               end_date = CASE WHEN %(status)s = 'IN_PROGRESS' THEN NULL ELSE now() END,
               response = CASE WHEN %(status)s = 'SUCCESS' THEN '{"ok": [1, "two"]}'::jsonb END,
               error_message = CASE WHEN %(status)s = 'FAILURE' THEN 'boom' END
         WHERE task_id = %(task_id)s
        """,
        {"status": status, "task_id": task_id},
    )


@pytest.fixture(scope="module")
def fuzzed(
    database_url: str, amqp_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """A gateway of its own. Callback addresses are not resolved (ALLOW_PRIVATE): fuzzed host
    names would otherwise become DNS queries leaving this machine. test_ssrf covers that path."""
    procs = Processes(tmp_path_factory.mktemp("fuzzed-gateway"))
    env = gateway_env(database_url, amqp_url, CONVEYOR_CALLBACK_ALLOW_PRIVATE="1")
    try:
        yield GatewayProcess(procs, env)
    finally:
        procs.stop_all()
        print("\nschemathesis answers:", dict(sorted(SEEN.items())), "total", sum(SEEN.values()))


@pytest.fixture(scope="module")
def client(platform: Platform, fuzzed: GatewayProcess) -> Client:
    """A client granted on SERVICE, which holds one task in each state."""
    svc = platform.service(name=SERVICE, capacity=1_000_000, jsonSchema=BODY_SCHEMA)
    with fuzzed.http(svc.clients[0]) as http:
        for n in range(4):
            answer = http.post(fuzzed.tasks_url(SERVICE), json={"body": {"n": n}})
            TASK_IDS.append(answer.json()["data"]["taskId"])
    for task_id, status in zip(TASK_IDS[1:], ("IN_PROGRESS", "SUCCESS", "FAILURE"), strict=True):
        _move(platform, task_id, status)
    return svc.clients[0]


@pytest.fixture(scope="module")
def operator(platform: Platform) -> Client:
    return platform.operator()


def test_served_document_is_the_one_fuzzed(fuzzed: GatewayProcess) -> None:
    assert httpx.get(f"{fuzzed.url}/openapi.json").json() == DOCUMENT


@pytest.mark.timeout(120)
@schema.parametrize()
@FUZZ
def test_with_credentials(case, fuzzed: GatewayProcess, client: Client, operator: Client) -> None:
    # The admin routes with an operator's credentials, the others with a client's.
    auth = operator.auth if case.operation.path.startswith("/v1/admin/") else client.auth
    answer = case.call_and_validate(base_url=fuzzed.url, auth=auth, checks=CHECKS, timeout=30)
    SEEN[f"{case.method} {case.operation.path} -> {answer.status_code}"] += 1


@pytest.mark.timeout(120)
@schema.parametrize()
@FUZZ
def test_without_credentials(case, fuzzed: GatewayProcess) -> None:
    answer = case.call_and_validate(base_url=fuzzed.url, checks=CHECKS, timeout=30)
    SEEN[f"anonymous {case.method} {case.operation.path} -> {answer.status_code}"] += 1
    # Nothing about services or tasks leaks before authentication: only unrouted paths 404.
    expected = {403: 403001, 404: 404000, 405: 405000}
    assert expected.get(answer.status_code) == answer.json()["error"]["number"], answer.text
