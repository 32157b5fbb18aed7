"""A function's text answer is read in the charset its Content-Type declares (it was read as
UTF-8 whatever it said: `na\\xefve` in ISO-8859-1 was stored `na\\ufffdve`), and a charset
Python cannot decode text with is UTF-8 with replacement, never a crash."""

from __future__ import annotations

import pytest

from dispatcher.invoker import Failure, Success, classify


@pytest.mark.parametrize(
    ("content_type", "body", "stored"),
    [
        ("text/plain; charset=iso-8859-1", b"na\xefve!", "na\u00efve!"),
        ('text/plain; charset="ISO-8859-1"', b"na\xefve!", "na\u00efve!"),
        ("text/plain; charset=utf-16", "naïve ☃".encode("utf-16"), "naïve ☃"),
        ("text/plain; charset=windows-1252", b"\x93quoted\x94", "\u201cquoted\u201d"),
        ("text/plain", "naïve".encode(), "naïve"),
        ("text/plain; charset=utf-8", b"na\xefve", "na\ufffdve"),
        # not a text codec, or no codec at all: UTF-8 with replacement
        ("text/plain; charset=zlib", b"na\xefve", "na\ufffdve"),
        ("text/plain; charset=base64", b"bmFpdmU=", "bmFpdmU="),
        ("text/plain; charset=rot13", b"naive", "naive"),
        ("text/plain; charset=no-such-charset", b"na\xefve", "na\ufffdve"),
        ("text/plain; charset=idna", b"na\xefve", "na\ufffdve"),
        ("text/plain; charset=undefined", b"naive", "naive"),
        ("text/plain; charset=", b"naive", "naive"),
        # a codec that reads escapes is no way to read text (from a review)
        ("text/plain; charset=unicode_escape", b"\\u0041", "\\u0041"),
        ("text/plain; charset=raw-unicode-escape", b"\\u0041", "\\u0041"),
        # the storable rules still apply to the decoded text
        ("text/plain; charset=utf-16-le", "a\x00b".encode("utf-16-le"), "a\ufffdb"),
    ],
)
def test_a_text_answer_is_read_in_its_declared_charset(
    content_type: str, body: bytes, stored: str
) -> None:
    assert classify(200, body, {"content-type": content_type}) == Success(stored)


def test_a_refusal_in_its_declared_charset_is_the_tasks_error_message() -> None:
    outcome = classify(
        422, "refusé".encode("latin-1"), {"content-type": "text/plain; charset=latin-1"}
    )
    assert outcome == Failure("refusé", retryable=False)
