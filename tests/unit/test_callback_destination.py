"""DNS rebinding: the callback goes to the address that was checked, never to a second
resolution that could answer a private one."""

from __future__ import annotations

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

    assert str(target.url) == "https://93.184.216.34:8443/a?b=1"
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
