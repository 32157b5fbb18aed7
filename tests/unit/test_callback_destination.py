"""DNS rebinding: the callback goes to the address that was checked, never to a second
resolution that could answer a private one."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from gateway import callbacks
from gateway.callbacks import CallbackPolicy, CallbackRefused


def _answers(*rounds: list[str]):  # type: ignore[no-untyped-def]
    """A resolver that answers each look-up with the next round (a rebinding DNS server)."""
    queue = list(rounds)

    async def resolve(host: str, port: int | None) -> list[str]:
        return queue.pop(0) if len(queue) > 1 else queue[0]

    return resolve


async def test_the_call_is_pinned_to_the_checked_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(callbacks, "resolve", _answers(["93.184.216.34"], ["127.0.0.1"]))

    target = await callbacks.destination("https://hooks.example.com:8443/a?b=1", CallbackPolicy())

    assert [str(url) for url in target.urls] == ["https://93.184.216.34:8443/a?b=1"]
    assert target.headers == {"Host": "hooks.example.com:8443"}
    assert target.extensions == {"sni_hostname": "hooks.example.com"}  # TLS checks the name


async def test_a_forbidden_answer_at_delivery_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(callbacks, "resolve", _answers(["93.184.216.34", "10.0.0.7"]))
    with pytest.raises(CallbackRefused):
        await callbacks.destination("https://hooks.example.com/", CallbackPolicy())


async def test_an_unsendable_url_is_refused() -> None:
    with pytest.raises(CallbackRefused):
        await callbacks.destination("https://example.com/a\x01", CallbackPolicy())
    with pytest.raises(CallbackRefused):
        callbacks.check_shape(
            {"type": "https", "url": "https://example.com/a\x01"}, CallbackPolicy()
        )


async def test_every_checked_address_is_kept_in_the_resolver_s_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a black-box probe: a host with an IPv6 and an IPv4 address was pinned to the
    first in text order (the IPv6 one, unreachable from an IPv4-only cluster), with no other
    address tried. The resolver's order is kept, and every checked address is a fallback."""
    monkeypatch.setattr(callbacks, "resolve", _answers(["93.184.215.14", "2606:2800:21f::1"]))

    target = await callbacks.destination("https://dual.example/h", CallbackPolicy())

    assert [str(url) for url in target.urls] == [
        "https://93.184.215.14/h",
        "https://[2606:2800:21f::1]/h",
    ]


async def test_a_callback_goes_to_the_next_address_when_one_refuses_the_connection() -> None:
    """A real socket: the first address refuses, the second answers 204."""
    import asyncio
    import socket

    from gateway.notifier import Notifier

    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        refused = closed.getsockname()[1]
    target = callbacks.Destination(
        [httpx.URL(f"http://127.0.0.1:{refused}/h"), httpx.URL(f"http://127.0.0.1:{port}/h")],
        {"Host": "hooks.example.com"},
    )
    notifier = Notifier(pool=None, policy=CallbackPolicy(), signing_secret="s", timeout=5)  # type: ignore[arg-type]
    try:
        await notifier._post(target, b"{}")
    finally:
        await notifier.close()
        server.close()
    assert len(received) == 1 and b"host: hooks.example.com" in received[0].lower()


def test_a_callback_url_is_kept_as_it_will_be_called() -> None:
    """Found by a black-box probe: the notifier shares its slots per target (host and port) by
    the URL's text, and `:80`, `:080` and no port at all were three targets: a consumer whose
    endpoint hangs took every slot by spelling its port several ways."""
    policy = CallbackPolicy(allow_http=True)
    spelled = ["http://LocalHost:0080/h", "http://localhost:80/h", "http://localhost/h"]
    urls = {callbacks.check_shape({"type": "http", "url": url}, policy)[0] for url in spelled}
    assert urls == {"http://localhost/h"}
    assert callbacks.check_shape({"type": "http", "url": "http://h:000123/x?y=1"}, policy)[0] == (
        "http://h:123/x?y=1"
    )


async def test_a_host_that_does_not_resolve_at_delivery_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a black-box probe: a DNS failure at delivery was final at once, where SPEC
    §3.3 retries network errors; only a forbidden address is final."""
    from gateway.notifier import Notifier

    looked_up = 0

    async def flaky(host: str, port: int | None) -> list[str]:
        nonlocal looked_up
        looked_up += 1
        if looked_up < 3:
            raise callbacks.HostUnresolved("callback host does not resolve")
        return ["93.184.215.14"]

    sent: list[str] = []

    async def post(self: Notifier, target: callbacks.Destination, body: bytes) -> None:
        sent.append(str(target.urls[0]))

    monkeypatch.setattr(callbacks, "resolve", flaky)
    monkeypatch.setattr(Notifier, "_post", post)
    notifier = Notifier(pool=None, policy=CallbackPolicy(), signing_secret="s", backoff=0.01)  # type: ignore[arg-type]
    try:
        await notifier._deliver("https://hooks.example.com/h", {"taskId": "t"}, _claim_held)
    finally:
        await notifier.close()
    assert sent == ["https://93.184.215.14/h"]


async def _claim_held() -> bool:
    """The notification's claim, still this notifier's (`Notifier._still_ours`)."""
    return True


async def test_hosts_that_never_answer_hold_up_no_one_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a sweep: look-ups ran on the loop's few shared threads, and a thread stayed
    busy until the system resolver gave up, long after the check had; one client's batch of
    hosts that never answer made every other client's callback "does not resolve" for
    minutes. Look-ups hold no thread now: 300 of them under way delay no other one, and
    each ends within the deadline."""
    import aiodns

    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a name server that never answers
    silent.bind(("127.0.0.1", 0))
    server = f"127.0.0.1:{silent.getsockname()[1]}"
    resolver = aiodns.DNSResolver(
        nameservers=[server], timeout=callbacks.LOOKUP_TIMEOUT, tries=callbacks.LOOKUP_TRIES
    )
    monkeypatch.setattr(callbacks, "_resolver", lambda: resolver)
    try:
        started = time.monotonic()
        stuck = [
            asyncio.create_task(callbacks.resolve(f"slow{i}.example.com", 443)) for i in range(300)
        ]
        await asyncio.sleep(0.2)
        assert await asyncio.wait_for(callbacks.resolve("localhost", 443), 1.0)  # hosts file
        outcomes = await asyncio.gather(*stuck, return_exceptions=True)
        assert all(isinstance(o, callbacks.HostUnresolved) for o in outcomes), outcomes[:3]
        assert time.monotonic() - started < callbacks.RESOLVE_DEADLINE + 2
    finally:
        await resolver.close()
        silent.close()
