"""Two `Authorization` headers, or two `Content-Type` headers on a create or a batch, against a
real gateway. Which of two a proxy or a server honours differs (the gateway took the first: a
request with two different credentials was served as the first's client), so neither is
chosen: two credentials are malformed ones, 403001 exactly as any other authentication
failure; two Content-Types are a wrong one, 400002 as `text/plain` gets."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.security.helpers import basic, error_number, still_serving
from tests.support.gateway import GatewayProcess, Platform, Service


@pytest.fixture(scope="module")
def svc(platform: Platform) -> Service:
    return platform.service()


@pytest.fixture
def http(gateway: GatewayProcess, svc: Service) -> Iterator[httpx.Client]:
    with gateway.http() as client:
        yield client
    still_serving(gateway, svc)


def _auth(svc: Service) -> str:
    client = svc.clients[0]
    return basic(client.client_id, client.secret)


def _json(content_types: list[str]) -> list[tuple[str, str]]:
    return [("Content-Type", value) for value in content_types]


@pytest.mark.parametrize("second", ["right", "wrong", "same"])
def test_two_authorization_headers_are_refused_as_any_failure(
    gateway: GatewayProcess, svc: Service, http: httpx.Client, second: str
) -> None:
    right = _auth(svc)
    other = {"right": right, "wrong": basic(svc.clients[0].client_id, "not-it"), "same": right}
    url = gateway.tasks_url(svc.name)
    body = b'{"body": {}}'
    unknown = http.post(url, content=body, headers=[("Authorization", basic("nobody", "nothing"))])
    for pair in ([right, other[second]], [other[second], right]):
        headers = [("Authorization", value) for value in pair] + _json(["application/json"])
        twice = http.post(url, content=body, headers=headers)
        assert error_number(twice) == (403, 403001), twice.text
        assert twice.json() == unknown.json()
        assert twice.headers["www-authenticate"] == unknown.headers["www-authenticate"]
    polled = http.get(
        url + "/00000000-0000-0000-0000-000000000000",
        headers=[("Authorization", right), ("Authorization", right)],
    )
    assert error_number(polled) == (403, 403001)


@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize(
    "content_types",
    [["application/json", "application/json"], ["application/json", "text/plain"]],
)
def test_two_content_types_are_refused_as_a_wrong_one(
    gateway: GatewayProcess,
    svc: Service,
    http: httpx.Client,
    batch: bool,
    content_types: list[str],
) -> None:
    url = gateway.tasks_url(svc.name) + ("/batch" if batch else "")
    body = b'{"tasks": [{"body": {}}]}' if batch else b'{"body": {}}'
    auth = [("Authorization", _auth(svc))]
    wrong = http.post(url, content=body, headers=auth + _json(["text/plain"]))
    twice = http.post(url, content=body, headers=auth + _json(content_types))
    assert error_number(wrong) == error_number(twice) == (400, 400002), twice.text
    assert [e["path"] for e in twice.json()["error"]["errors"]] == ["Content-Type"]
