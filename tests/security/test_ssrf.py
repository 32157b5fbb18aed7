"""SSRF protection and callback signatures (SPEC §3.3).

Unit level: `check_callback` / `check_destination` refuse every address the
gateway must never call, however it is spelled; the resolver is the real one
for literals and /etc/hosts names, and is replaced only to simulate DNS
answers. The notifier re-checks at delivery and never follows redirects: one
check runs the real `Notifier`, one a real gateway against local servers.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
import uuid

import pytest

from conveyor.signatures import sign, verify
from gateway import callbacks
from gateway.callbacks import (
    CallbackPolicy,
    CallbackRefused,
    check_callback,
    check_destination,
)
from gateway.notifier import CallbackFailed, Notifier
from tests.security.helpers import Recorder, finish_through_rabbitmq, wait_until
from tests.support.gateway import GatewayProcess, Platform

STRICT = CallbackPolicy()
PUBLIC_IP = "93.184.216.34"

FORBIDDEN_HOSTS = [
    # loopback
    "127.0.0.1",
    "127.255.255.254",
    "[::1]",
    "localhost",
    "LocalHost",
    # private
    "10.0.0.1",
    "10.255.255.255",
    "172.16.0.1",
    "172.31.255.254",
    "192.168.1.1",
    "[fc00::1]",
    "[fd12:3456:789a::1]",
    "100.64.0.1",  # carrier-grade NAT
    # link-local, cloud metadata
    "169.254.169.254",
    "169.254.0.1",
    "[fe80::1]",
    "[fe80::1%251]",
    # IPv4 inside IPv6
    "[::ffff:127.0.0.1]",
    "[::ffff:7f00:1]",
    "[::ffff:169.254.169.254]",
    "[::ffff:10.0.0.1]",
    "[::127.0.0.1]",  # IPv4-compatible (deprecated)
    "[64:ff9b::7f00:1]",  # NAT64
    "[2002:7f00:1::]",  # 6to4 of 127.0.0.1
    "[2002:a00:1::]",  # 6to4 of 10.0.0.1
    "[fec0::1]",  # site-local (deprecated)
    # unspecified, broadcast, multicast, reserved
    "0.0.0.0",
    "0",
    "[::]",
    "255.255.255.255",
    "224.0.0.1",
    "240.0.0.1",
    "198.18.0.1",
    # other spellings of 127.0.0.1 and 169.254.169.254
    "2130706433",
    "0x7f.0.0.1",
    "0x7f000001",
    "0177.0.0.1",
    "017700000001",
    "127.1",
    "2852039166",
    "0xA9.0xFE.0xA9.0xFE",
]


def https(host: str, path: str = "/hook") -> dict[str, str]:
    return {"type": "https", "url": f"https://{host}{path}"}


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Replaces the resolver with a table: name -> addresses (absent names do not resolve)."""
    table: dict[str, list[str]] = {}

    async def fake(host: str, port: int | None) -> list[str]:
        if host not in table:
            raise CallbackRefused("callback host does not resolve")
        return table[host]

    monkeypatch.setattr(callbacks, "resolve", fake)
    return table


# --- addresses ---------------------------------------------------------------------------


@pytest.mark.parametrize("host", FORBIDDEN_HOSTS)
async def test_forbidden_addresses_are_refused(host: str) -> None:
    # Some spellings (octal) are not even a URL httpx would send: refused as such.
    with pytest.raises(CallbackRefused, match=r"forbidden address|not a valid URL"):
        await check_callback(https(host), STRICT)


@pytest.mark.parametrize("kind", [{}, [], ["https"], 1, None, True])
async def test_a_callback_type_that_is_not_a_string_is_refused_not_a_crash(kind: object) -> None:
    """Found by a sweep: an object or an array as `type` answered 500 (unhashable)."""
    with pytest.raises(CallbackRefused, match="callback type must be one of"):
        await check_callback({"type": kind, "url": "https://example.com/h"}, STRICT)


@pytest.mark.parametrize("host", ["xn--", "xn--ls8h.la", "xn--zz.example"])
async def test_names_idna_cannot_read_are_refused_not_a_crash(host: str) -> None:
    """Found by a sweep: these answered 500 (an IDNAError escaped the check) and dropped the
    connection; they are refused like any other URL that cannot be sent."""
    with pytest.raises(CallbackRefused, match="not a valid URL"):
        await check_callback(https(host), STRICT)
    with pytest.raises(CallbackRefused, match="not a valid URL"):
        await check_destination(f"https://{host}/hook", STRICT)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        (f"https://{PUBLIC_IP}:0/hook", "port must be 1-65535"),
        (f" https://{PUBLIC_IP}/hook", "not a valid URL"),
        (f"https://{PUBLIC_IP}/hook\t", "not a valid URL"),
    ],
)
async def test_urls_no_delivery_could_reach_are_refused(url: str, why: str) -> None:
    """Found by an audit: a port 0 and blanks around the URL were accepted, and every
    delivery of those callbacks would then have failed."""
    with pytest.raises(CallbackRefused, match=why):
        await check_callback({"type": "https", "url": url}, STRICT)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "10.0.0.1", "2130706433"])
async def test_forbidden_addresses_are_refused_over_http_too(host: str) -> None:
    policy = CallbackPolicy(allow_http=True)
    with pytest.raises(CallbackRefused, match="forbidden address"):
        await check_callback({"type": "http", "url": f"http://{host}:8080/"}, policy)


@pytest.mark.parametrize(
    "addresses",
    [["10.1.2.3"], [PUBLIC_IP, "10.0.0.1"], ["169.254.169.254"], ["::1"], ["::ffff:127.0.0.1"]],
)
async def test_names_resolving_to_forbidden_addresses_are_refused(
    dns: dict[str, list[str]], addresses: list[str]
) -> None:
    dns["hook.consumer.test"] = addresses
    with pytest.raises(CallbackRefused, match="forbidden address"):
        await check_callback(https("hook.consumer.test"), STRICT)


async def test_names_resolving_to_public_addresses_pass(dns: dict[str, list[str]]) -> None:
    dns["hook.consumer.test"] = [PUBLIC_IP, "2606:4700::1111"]
    checked = await check_callback(https("hook.consumer.test"), STRICT)
    assert checked == https("hook.consumer.test")


async def test_unresolvable_names_are_refused(dns: dict[str, list[str]]) -> None:
    with pytest.raises(CallbackRefused, match="does not resolve"):
        await check_callback(https("nowhere.consumer.test"), STRICT)


@pytest.mark.parametrize("host", ["a" * 64 + ".example", "a..example"])
async def test_names_the_resolver_cannot_encode_are_refused(host: str) -> None:
    """IDNA refuses these before any lookup; that used to escape as a ValueError (a 500)."""
    with pytest.raises(CallbackRefused, match="does not resolve"):
        await check_destination(f"https://{host}/", STRICT)


# --- allow-list and relaxations -------------------------------------------------------------


async def test_allow_listed_hosts_pass() -> None:
    policy = CallbackPolicy(allowed_hosts=("localhost", "hooks.internal"))
    assert await check_callback(https("localhost"), policy) == https("localhost")
    # kept as it will be called: the host in lower case (the notifier's target is this text)
    assert await check_callback(https("LOCALHOST:8443"), policy) == https("localhost:8443")
    await check_destination("https://hooks.internal/x", policy)  # never resolved


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("https://localhost@10.0.0.1/", None),  # userinfo that looks like the allowed host
        ("https://10.0.0.1\\@localhost/", None),  # parsers disagree on the backslash
        ("https://10.0.0.1\\.localhost/", "10.0.0.1\\.localhost"),
        ("https://localhost.10.0.0.1.nip.io/", "localhost.10.0.0.1.nip.io"),
        ("https://evil-localhost/", "evil-localhost"),
        ("https://127.0.0.1/#@localhost", "127.0.0.1"),
    ],
)
async def test_allow_list_is_exact(dns: dict[str, list[str]], url: str, host: str | None) -> None:
    if host is not None:
        dns[host] = ["10.0.0.1"]  # what an attacker's DNS would answer
    policy = CallbackPolicy(allowed_hosts=("localhost",))
    with pytest.raises(CallbackRefused, match=r"forbidden address|credentials"):
        await check_callback({"type": "https", "url": url}, policy)


async def test_allow_private_relaxes_the_address_check_only() -> None:
    policy = CallbackPolicy(allow_private=True)
    await check_callback(https("10.0.0.1"), policy)
    with pytest.raises(CallbackRefused, match="type"):
        await check_callback({"type": "http", "url": "http://10.0.0.1/"}, policy)


# --- shape: https only by default ----------------------------------------------------------


@pytest.mark.parametrize(
    "callback",
    [
        {"type": "http", "url": f"http://{PUBLIC_IP}/"},
        {"type": "https", "url": f"http://{PUBLIC_IP}/"},
        {"type": "HTTPS", "url": f"https://{PUBLIC_IP}/"},
        {"type": "ftp", "url": f"ftp://{PUBLIC_IP}/"},
        {"type": "file", "url": "file:///etc/passwd"},
        {"type": "https", "url": "gopher://127.0.0.1:6379/_INFO"},
        {"type": "https", "url": "https:///no-host"},
        {"type": "https", "url": f"https://user:pass@{PUBLIC_IP}/"},
        {"type": "https", "url": f"https://{PUBLIC_IP}:99999/"},
        {"type": "https", "url": "https://" + "a" * 2100 + ".com/"},
        {"type": "https", "url": 42},
        {"type": "https"},
        {"type": "https", "url": f"https://{PUBLIC_IP}/", "headers": {"x": "y"}},
        "https://example.com/",
    ],
)
async def test_malformed_or_non_https_callbacks_are_refused(callback: object) -> None:
    with pytest.raises(CallbackRefused):
        await check_callback(callback, STRICT)


async def test_http_needs_allow_http(dns: dict[str, list[str]]) -> None:
    dns["hook.consumer.test"] = [PUBLIC_IP]
    callback = {"type": "http", "url": "http://hook.consumer.test/"}
    with pytest.raises(CallbackRefused):
        await check_callback(callback, STRICT)
    assert await check_callback(callback, CallbackPolicy(allow_http=True)) == callback


# --- delivery: re-checked, and redirects are not followed -----------------------------------


def notifier(policy: CallbackPolicy) -> Notifier:
    # `_deliver` is the delivery of one notification; it does not touch the database.
    return Notifier(None, policy, "signing-secret", attempts=2, backoff=0.01, timeout=5)  # type: ignore[arg-type]


async def test_delivery_rechecks_the_address(dns: dict[str, list[str]]) -> None:
    """A name accepted at submission that now resolves to a forbidden address is never called."""
    with Recorder() as hook:
        url = f"http://localhost:{hook.port}/hook"
        sender = notifier(CallbackPolicy(allow_http=True))
        try:
            dns["localhost"] = [PUBLIC_IP]  # at submission: public
            await check_callback({"type": "http", "url": url}, CallbackPolicy(allow_http=True))
            dns["localhost"] = ["10.0.0.9"]  # now: private
            with pytest.raises(CallbackRefused):
                await sender._deliver(url, {"taskId": "t"}, _claim_held)
        finally:
            await sender.close()
        # Where a permitted delivery goes (the address checked, never a second look-up):
        # tests/unit/test_callback_destination.py, without leaving this machine.
        assert hook.received == []


async def test_notifier_does_not_follow_redirects() -> None:
    with Recorder() as target:
        location = f"http://127.0.0.1:{target.port}/stolen"
        with Recorder(302, {"Location": location}) as redirect:
            sender = notifier(CallbackPolicy(allow_http=True, allowed_hosts=("localhost",)))
            try:
                with pytest.raises(CallbackFailed, match="answered 302"):
                    await sender._deliver(
                        f"http://localhost:{redirect.port}/hook", {"t": 1}, _claim_held
                    )
            finally:
                await sender.close()
    assert len(redirect.received) == 2  # both attempts went to the callback URL only
    assert target.received == []


@pytest.mark.timeout(60)
def test_gateway_redirected_callback_fails_and_target_gets_nothing(
    gateway: GatewayProcess, platform: Platform, amqp_url: str
) -> None:
    svc = platform.service()
    with Recorder() as target:
        location = f"http://127.0.0.1:{target.port}/stolen"
        with (
            Recorder(302, {"Location": location}) as redirect,
            gateway.http(svc.clients[0]) as http,
        ):
            callback = {"type": "http", "url": f"http://localhost:{redirect.port}/hook"}
            created = http.post(
                gateway.tasks_url(svc.name), json={"body": {}, "callback": callback}
            )
            assert created.status_code == 201, created.text
            task_id = created.json()["data"]["taskId"]
            finish_through_rabbitmq(gateway, amqp_url, svc, task_id, {"ok": True})
            outcome = wait_until(lambda: _notification(platform, task_id), 20, "an outcome")
        assert outcome == "FAILURE"
        assert len(redirect.received) == 3  # CONVEYOR_CALLBACK_ATTEMPTS, all to the callback URL
        assert target.received == []


def _notification(platform: Platform, task_id: str) -> str | None:
    [(status,)] = platform.sql(
        "SELECT notification_status FROM tasks WHERE task_id = %(t)s", {"t": task_id}
    )
    return None if status in (None, "PENDING") else status


# --- signatures -------------------------------------------------------------------------------


def test_signature_has_the_documented_form() -> None:
    body, secret, t = b'{"taskId":"x"}', "s3cret", 1_700_000_000
    header = sign(secret, body, t)
    assert re.fullmatch(r"t=\d+,v1=[0-9a-f]{64}", header)
    expected = hmac.new(secret.encode(), b"1700000000." + body, hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"


def test_signature_round_trip() -> None:
    body, secret = f'{{"taskId":"{uuid.uuid4()}"}}'.encode(), uuid.uuid4().hex
    assert verify(secret, body, sign(secret, body))


def test_a_signature_for_two_secrets_verifies_with_either_and_only_them() -> None:
    body, new, old = b'{"taskId":"x"}', uuid.uuid4().hex, uuid.uuid4().hex
    header = sign(new, body, previous=old)
    assert re.fullmatch(r"t=\d+,v1=[0-9a-f]{64},v1=[0-9a-f]{64}", header)
    assert verify(new, body, header) and verify(old, body, header)
    assert not verify(uuid.uuid4().hex, body, header)
    # a stray non-ASCII signature neither crashes the check nor hides the good one
    assert verify(new, body, header + ",v1=\u00e9")
    assert not verify(new, body, header.split(",")[0] + ",v1=\u00e9")


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda s, b, h: (s, b + b" ", h), id="tampered-body"),
        pytest.param(lambda s, b, h: (s, b.replace(b"x", b"y"), h), id="changed-body"),
        pytest.param(lambda s, b, h: (s + "x", b, h), id="wrong-secret"),
        pytest.param(lambda s, b, h: (s, b, sign(s, b, int(time.time()) - 301)), id="stale"),
        pytest.param(lambda s, b, h: (s, b, sign(s, b, int(time.time()) + 301)), id="future"),
        pytest.param(lambda s, b, h: (s, b, h.split(",")[1]), id="no-timestamp"),
        pytest.param(lambda s, b, h: (s, b, h.split(",")[0]), id="no-signature"),
        pytest.param(lambda s, b, h: (s, b, h.replace("t=", "t=1")), id="other-timestamp"),
        pytest.param(lambda s, b, h: (s, b, "garbage"), id="garbage"),
        pytest.param(lambda s, b, h: (s, b, ""), id="empty"),
    ],
)
def test_tampered_signatures_fail(tamper) -> None:
    secret, body = "signing-secret", b'{"taskId":"x","status":"SUCCESS"}'
    assert not verify(*tamper(secret, body, sign(secret, body)))


async def _claim_held() -> bool:
    """The notification's claim, still this notifier's (`Notifier._still_ours`)."""
    return True
