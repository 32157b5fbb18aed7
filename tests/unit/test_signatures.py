"""`conveyor.signatures.verify`, which consumers run on every callback: whatever the header
says, it answers True or False, never raises."""

from __future__ import annotations

import time

import pytest

from conveyor.signatures import sign, verify

SECRET = "s" * 20


def test_a_signed_body_verifies_and_another_does_not() -> None:
    header = sign(SECRET, b"{}")
    assert verify(SECRET, b"{}", header)
    assert not verify(SECRET, b"{ }", header)
    assert not verify("another secret", b"{}", header)


@pytest.mark.parametrize(
    "header",
    [
        "t=" + "1" * 5000 + ",v1=ab",  # a sweep: int() refused it with a ValueError
        "t=" + "9" * 21 + ",v1=ab",
        "t=١٢٣,v1=ab",
        "t=,v1=",
        "",
        ",,,",
        "v1=" + "a" * 100_000,
    ],
)
def test_a_hostile_header_is_false(header: str) -> None:
    assert verify(SECRET, b"{}", header) is False


def test_a_time_past_the_tolerance_is_false() -> None:
    header = sign(SECRET, b"{}", timestamp=int(time.time()) - 301)
    assert not verify(SECRET, b"{}", header)
