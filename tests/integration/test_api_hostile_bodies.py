"""Bodies the JSON reader takes but PostgreSQL could not store, against a real gateway: each
is 400002 on a create, a batch and a create with an Idempotency-Key, never a 500.

JSON between systems is UTF-8 (RFC 8259 §8.1). The stdlib also reads UTF-16 and UTF-32,
where an escaped NUL or lone surrogate is not the ASCII bytes the gateway looks for, so any
other encoding is refused (a UTF-8 byte order mark is read, as RFC 8259 lets a reader do).
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.support.gateway import GatewayProcess, Platform, Service

ENCODINGS = ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]
BODIES = {
    "plain": '{"sleep":0}',
    "nul-in-value": '{"sleep":0,"x":"\\u0000"}',
    "nul-in-key": '{"sleep":0,"\\u0000":1}',
    "lone-surrogate": '{"sleep":0,"x":"\\ud800"}',
}
DIGITS = sys.get_int_max_str_digits()  # int()'s limit, 4,300 unless configured otherwise


@pytest.fixture(scope="module")
def svc(platform: Platform) -> Service:
    return platform.service(capacity=1_000_000)


@pytest.fixture
def http(gateway: GatewayProcess, svc: Service) -> Iterator[httpx.Client]:
    with gateway.http(svc.clients[0]) as client:
        yield client


def _answers(
    http: httpx.Client, gateway: GatewayProcess, svc: Service, body: str, encoding: str
) -> dict[str, httpx.Response]:
    """`body` as a create, a batch of one and a create with an Idempotency-Key."""
    url = gateway.tasks_url(svc.name)
    single = f'{{"body":{body}}}'.encode(encoding)
    batch = f'{{"tasks":[{{"body":{body}}}]}}'.encode(encoding)
    json_type = {"Content-Type": "application/json", "Connection": "close"}  # past a 500 too
    return {
        "create": http.post(url, content=single, headers=json_type),
        "batch": http.post(url + "/batch", content=batch, headers=json_type),
        "idempotent": http.post(
            url, content=single, headers={**json_type, "Idempotency-Key": str(uuid.uuid4())}
        ),
    }


def _refusals(answers: dict[str, httpx.Response]) -> dict[str, tuple[int, int | None]]:
    return {
        name: (a.status_code, a.json().get("error", {}).get("number"))
        for name, a in answers.items()
    }


@pytest.mark.parametrize("body", BODIES.values(), ids=BODIES.keys())
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_json_not_in_utf8_is_400002(
    gateway: GatewayProcess, svc: Service, http: httpx.Client, body: str, encoding: str
) -> None:
    answers = _answers(http, gateway, svc, body, encoding)
    assert _refusals(answers) == dict.fromkeys(answers, (400, 400002)), {
        name: a.text for name, a in answers.items()
    }
    assert all(a.json()["error"]["errors"][0]["path"] == "" for a in answers.values())


def test_a_utf8_byte_order_mark_is_read_and_its_body_checked(
    gateway: GatewayProcess, svc: Service, http: httpx.Client
) -> None:
    plain = _answers(http, gateway, svc, BODIES["plain"], "utf-8-sig")
    assert {name: a.status_code for name, a in plain.items()} == {
        "create": 201,
        "batch": 201,
        "idempotent": 201,
    }
    nul = _answers(http, gateway, svc, BODIES["nul-in-value"], "utf-8-sig")
    assert _refusals(nul) == dict.fromkeys(nul, (400, 400002))
    assert nul["batch"].json()["error"]["errors"][0]["path"] == "tasks/0/body/x"


@pytest.mark.parametrize("sign", ["", "-"])
def test_an_integer_past_the_digit_limit_is_400002(
    gateway: GatewayProcess, svc: Service, http: httpx.Client, sign: str
) -> None:
    answers = _answers(http, gateway, svc, f'{{"sleep":0,"x":{sign}{"1" * (DIGITS + 1)}}}', "utf-8")
    assert _refusals(answers) == dict.fromkeys(answers, (400, 400002))
    widest = _answers(http, gateway, svc, f'{{"sleep":0,"x":{sign}{"1" * DIGITS}}}', "utf-8")
    assert {name: a.status_code for name, a in widest.items()} == {
        "create": 201,
        "batch": 201,
        "idempotent": 201,
    }


@pytest.mark.parametrize("coding", ["gzip", "br", "identity, gzip", "x-unknown"])
def test_a_body_in_a_content_encoding_is_refused_naming_it(
    gateway: GatewayProcess, svc: Service, http: httpx.Client, platform: Platform, coding: str
) -> None:
    """Found by a black-box test: `Content-Encoding: gzip` on a plain JSON body was ignored
    and the body taken as it was (and a really compressed one refused as malformed JSON):
    the gateway decodes no body, so it says so, for the create and the batch alike: 400002
    naming the header, and no task made."""
    url = gateway.tasks_url(svc.name)
    count = "SELECT count(*) FROM tasks WHERE service = %(s)s"
    before = platform.sql(count, {"s": svc.name})
    headers = {"Content-Type": "application/json", "Content-Encoding": coding}
    for path, body in (("", {"body": {"n": 1}}), ("/batch", {"tasks": [{"body": {"n": 1}}]})):
        answer = http.post(url + path, content=json.dumps(body).encode(), headers=headers)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["number"] == 400002 and error["errors"][0]["path"] == "Content-Encoding"
    assert platform.sql(count, {"s": svc.name}) == before


def test_identity_is_no_encoding(gateway: GatewayProcess, svc: Service, http: httpx.Client) -> None:
    answer = http.post(
        gateway.tasks_url(svc.name),
        content=b'{"body":{"n":1}}',
        headers={"Content-Type": "application/json", "Content-Encoding": "identity"},
    )
    assert answer.status_code == 201, answer.text
