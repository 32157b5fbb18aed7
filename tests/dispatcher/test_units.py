"""The dispatcher's pure parts, without a broker: answers, retries, progress."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import aiohttp
import pytest
from aiohttp.http_exceptions import ContentLengthError

from conveyor import strict_json
from conveyor.storable import ERROR_LIMIT, truncate
from dispatcher.api import parse_progress
from dispatcher.cancels import RECALL_OVERLAP, recall_since
from dispatcher.invoker import (
    Failure,
    Outcome,
    Success,
    classify,
    error_message,
    network_failure,
    response_value,
)
from dispatcher.progress import ProgressBoard, ProgressReporter
from dispatcher.retry import Budget, RetryPolicy, call_with_retries, parse_retry_after
from dispatcher.shutdown import Aborted, AbortToken

# ---------------------------------------------------------------------------
# answer -> outcome


@pytest.mark.parametrize(
    ("status", "body", "response"),
    [
        (200, b'{"a": [1, 2]}', {"a": [1, 2]}),
        (201, b"[1]", [1]),
        (200, b"plain text", "plain text"),
        (200, b"", None),
        (204, b"", None),
        (200, b"  \n", None),
        (200, b'{"x": NaN}', '{"x": NaN}'),  # not JSON: kept as a string
        (200, b'"quoted"', "quoted"),
    ],
)
def test_2xx_is_success(status: int, body: bytes, response: object) -> None:
    assert classify(status, body) == Success(response)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"errorMessage": "Argh!", "error": "no", "detail": "no"}', "Argh!"),
        (b'{"error": "bad input"}', "bad input"),
        (
            b'{"detail": [{"loc": ["body"], "msg": "missing"}]}',
            '[{"loc": ["body"], "msg": "missing"}]',
        ),
        (b'{"other": 1}', '{"other": 1}'),
        (b"not json at all", "not json at all"),
        (b"", "HTTP 404"),
    ],
)
def test_4xx_fails_without_retry(body: bytes, message: str) -> None:
    assert classify(404, body) == Failure(message, retryable=False)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_a_nul_in_json_that_is_not_utf8_is_replaced_too(encoding: str) -> None:
    """The NUL check read the raw bytes for the UTF-8 escape; UTF-16 and UTF-32 spell it
    otherwise, and the answer went on with a NUL PostgreSQL refuses."""
    body = '{"k\\u0000": ["x\\u0000y"]}'.encode(encoding)
    assert classify(200, body) == Success({"k\ufffd": ["x\ufffdy"]})


def test_a_3xx_location_that_is_not_utf8_becomes_a_storable_message() -> None:
    """aiohttp hands header bytes that are not UTF-8 through as lone surrogates."""
    location = b"http://x/caf\xe9".decode("utf-8", "surrogateescape")
    outcome = classify(302, b"", {"location": location})
    assert isinstance(outcome, Failure) and not outcome.retryable
    assert outcome.error == "HTTP 302 (redirects are not followed; Location: http://x/caf\ufffd)"
    outcome.error.encode()  # storable: no lone surrogate left


def test_error_message_is_truncated_to_4_kib_on_a_character_boundary() -> None:
    outcome = classify(400, ("é" * 5000).encode())
    assert isinstance(outcome, Failure)
    assert len(outcome.error.encode()) <= ERROR_LIMIT
    assert outcome.error == "é" * (ERROR_LIMIT // 2)
    assert truncate("short") == "short"


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b'{"errorMessage": "", "error": "quota exceeded"}', "quota exceeded"),
        (b'{"errorMessage": "  ", "error": null, "detail": "no such image"}', "no such image"),
        (b'{"errorMessage": ""}', '{"errorMessage": ""}'),
    ],
)
def test_an_empty_error_message_falls_back_to_the_next_field_then_the_text(
    body: bytes, error: str
) -> None:
    """SPEC §5: `errorMessage`, `error` or `detail`, else the text. An empty one says nothing:
    a FAILURE with an empty message left the consumer with no reason at all."""
    assert classify(422, body) == Failure(error, retryable=False)


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_408_429_5xx_are_retryable_and_carry_retry_after(status: int) -> None:
    outcome = classify(status, b'{"errorMessage": "busy"}', {"retry-after": "7"})
    assert outcome == Failure(f"HTTP {status}: busy", retryable=True, retry_after="7")


def test_redirects_are_final_failures() -> None:
    outcome = classify(302, b"")
    assert isinstance(outcome, Failure) and not outcome.retryable


@pytest.mark.parametrize(
    ("status", "body", "headers", "error"),
    [
        (
            301,
            b"<html>moved</html>",
            {"location": "http://x/"},
            "HTTP 301 (redirects are not followed; Location: http://x/): <html>moved</html>",
        ),
        (304, b"", {}, "HTTP 304 (redirects are not followed)"),
        (
            300,
            b'{"errorMessage": "pick one"}',
            {},
            "HTTP 300 (redirects are not followed): pick one",
        ),
        (199, b"", {}, "HTTP 199"),
    ],
)
def test_other_final_answers_give_their_status(
    status: int, body: bytes, headers: dict[str, str], error: str
) -> None:
    """A 3xx ended with its body alone ("<html>moved</html>"), like a function's own
    4xx errorMessage: the status and why it was not followed were lost."""
    assert classify(status, body, headers) == Failure(error, retryable=False)


@pytest.mark.parametrize("status", [0, 50, 99])
def test_a_status_below_100_is_no_http_and_is_retried(status: int) -> None:
    """docs/functions.md: a status below 100 is an answer that is not valid HTTP, retried like
    a 5xx. aiohttp's parser reads `000` to `099` as a status (its C parser refuses `0` and
    `42`): such a task ended FAILURE `HTTP 0` at its first call (found by a black-box test)."""
    assert classify(status, b"{}") == Failure(
        f"The function's answer was not valid HTTP: status {status} is below 100", retryable=True
    )


def test_an_answer_of_more_json_items_than_allowed_fails_its_task() -> None:
    """MAX_RESPONSE_ITEMS: read, every JSON item is a Python object (8 MiB of `[{},…]`, legal
    within MAX_RESPONSE_BYTES, took the sidecar to 620 MB, killed over and over under its
    container's limit, and the tasks beside it were dead-lettered: found by a black-box test).
    Counted outside strings; text that is no JSON object or array is not counted."""
    crowded = b"[" + b"{}," * 10 + b"{}]"
    assert classify(200, crowded, max_items=20) == Failure(
        "The function's answer holds more than 20 JSON items.", retryable=False
    )
    assert classify(500, crowded, max_items=20) == Failure(
        f"HTTP 500: {crowded.decode()}", retryable=True
    )
    assert classify(200, crowded, max_items=30) == Success([{}] * 11)
    quoted = b'["' + b",{[" * 20 + b'"]'
    assert classify(200, quoted, max_items=20) == Success([",{[" * 20])
    text = b"a,b,c\n" * 10
    assert classify(200, text, max_items=20) == Success(text.decode())


def test_an_answer_of_many_objects_is_read_without_a_copy() -> None:
    """Past 128 brackets the depth was checked by a copy of the whole answer, with a stack entry
    per value: 8 MiB of `[{},…]` peaked at 540 MB where reading it takes 200 MB. Measured
    against reading the same bytes, in the same process."""
    body = b"[" + b"{}," * 200_000 + b"{}]"

    def peak(read: Callable[[], object]) -> int:
        tracemalloc.start()
        try:
            read()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    bare = peak(lambda: strict_json.loads(body))
    assert peak(lambda: response_value(body)) < 1.3 * bare


def test_a_cut_answer_says_what_is_missing_without_aiohttps_fake_400() -> None:
    """aiohttp wraps a short body as `<ContentLengthError: 400, message=…>`: it read like a
    400 from the function."""
    exc = aiohttp.ClientPayloadError("Response payload is not completed: <ContentLengthError>")
    exc.__cause__ = ContentLengthError("Not enough data (received 12 of 100 bytes).")

    assert network_failure(exc) == Failure(
        "The function's answer was not valid HTTP: Not enough data (received 12 of 100 bytes).",
        retryable=True,
    )


# ---------------------------------------------------------------------------
# backoff and Retry-After


def test_retry_after_seconds_and_http_date() -> None:
    now = datetime(2025, 4, 23, 18, 25, 43, tzinfo=UTC)
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 120 ") == 120.0
    in_ten = format_datetime(now + timedelta(seconds=10), usegmt=True)
    assert parse_retry_after(in_ten, now) == 10.0
    past = format_datetime(now - timedelta(seconds=10), usegmt=True)
    assert parse_retry_after(past, now) == 0.0
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after("-5", now) is None
    assert parse_retry_after(None) is None


@pytest.mark.parametrize("value", ["\u00b2", "\u2460", "\u0663", "1\u00b2"])
def test_retry_after_in_digits_that_are_not_ascii_is_ignored(value: str) -> None:
    """`str.isdigit()` holds for `²` and `①`, which float() refuses: the ValueError escaped
    the worker, and the task was requeued until it was dead-lettered."""
    assert parse_retry_after(value) is None


def test_backoff_is_exponential_capped_and_jittered() -> None:
    policy = RetryPolicy(base=0.5, cap=4.0)
    assert [policy.delay(n, rand=lambda: 1.0) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert [policy.delay(n, rand=lambda: 0.0) for n in range(1, 4)] == [0.25, 0.5, 1.0]
    assert policy.delay(2, rand=lambda: 0.5) == 0.75  # half fixed, half random


def test_retry_after_is_never_shortened() -> None:
    policy = RetryPolicy(base=0.5, cap=4.0)
    assert policy.delay(1, retry_after=10.0, rand=lambda: 1.0) == 10.0
    assert policy.delay(3, retry_after=0.0, rand=lambda: 1.0) == 2.0


class Script:
    """A function that answers from a list, recording when it was called."""

    def __init__(self, *outcomes: Outcome) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[tuple[int, float]] = []

    async def __call__(self, number: int, time_left: float) -> Outcome:
        self.calls.append((number, time_left))
        return self.outcomes[min(len(self.calls), len(self.outcomes)) - 1]


FAST = RetryPolicy(base=0.01, cap=0.02)
BUSY = Failure("HTTP 503: busy", retryable=True)


async def test_retries_until_success() -> None:
    script = Script(BUSY, BUSY, Success({"ok": 1}))
    outcome = await call_with_retries(script, FAST, Budget(5, time.monotonic() + 10), AbortToken())
    assert outcome == Success({"ok": 1})
    assert [n for n, _ in script.calls] == [1, 2, 3]


async def test_gives_up_after_max_attempts_with_the_last_cause() -> None:
    script = Script(Failure("HTTP 500: one", True), Failure("HTTP 502: two", True))
    outcome = await call_with_retries(script, FAST, Budget(2, time.monotonic() + 10), AbortToken())
    assert outcome == Failure("HTTP 502: two", retryable=False)


UNREACHED = Failure("cannot connect to the function: refused", retryable=True, unreachable=True)


async def test_a_function_that_cannot_be_reached_spends_no_attempt() -> None:
    script = Script(UNREACHED, UNREACHED, UNREACHED, BUSY, UNREACHED, Success({"ok": 1}))
    outcome = await call_with_retries(script, FAST, Budget(2, time.monotonic() + 10), AbortToken())
    assert outcome == Success({"ok": 1})
    assert [n for n, _ in script.calls] == [1, 1, 1, 1, 2, 2]  # the function saw two calls


async def test_a_function_never_reached_fails_its_task_at_the_deadline() -> None:
    script = Script(UNREACHED)
    began = time.monotonic()
    outcome = await call_with_retries(script, FAST, Budget(2, time.monotonic() + 1), AbortToken())
    assert isinstance(outcome, Failure) and not outcome.retryable
    assert outcome.error == "task timeout: cannot connect to the function: refused"
    assert 0.8 < time.monotonic() - began < 3 and len(script.calls) > 2


async def test_final_failure_is_not_retried() -> None:
    script = Script(Failure("bad input", retryable=False), Success(None))
    outcome = await call_with_retries(script, FAST, Budget(5, time.monotonic() + 10), AbortToken())
    assert outcome == Failure("bad input", retryable=False)
    assert len(script.calls) == 1


async def test_no_retry_when_retry_after_crosses_the_deadline() -> None:
    script = Script(Failure("HTTP 429", retryable=True, retry_after="60"), Success(None))
    began = time.monotonic()
    outcome = await call_with_retries(script, FAST, Budget(5, time.monotonic() + 2), AbortToken())
    assert isinstance(outcome, Failure) and "HTTP 429" in outcome.error and not outcome.retryable
    assert time.monotonic() - began < 1


async def test_each_call_gets_the_time_left() -> None:
    script = Script(BUSY, Success(None))
    await call_with_retries(script, FAST, Budget(3, time.monotonic() + 5), AbortToken())
    (_, first), (_, second) = script.calls
    assert 4 < second < first <= 5


async def test_abort_interrupts_the_backoff_pause() -> None:
    script = Script(Failure("HTTP 503", retryable=True, retry_after="30"))
    token = AbortToken()
    asyncio.get_running_loop().call_later(0.05, token.abort)
    began = time.monotonic()
    with pytest.raises(Aborted):
        await call_with_retries(script, FAST, Budget(3, time.monotonic() + 60), token)
    assert time.monotonic() - began < 1


async def test_a_guarded_call_is_cancelled_by_an_abort_and_by_nothing_else() -> None:
    """The guard runs the call in the caller's task and an abort cancels that task: an
    abort ends in `Aborted`, someone else's cancellation stays a cancellation (also when an
    abort comes with it), and a call that ends returns its result."""
    token = AbortToken()
    assert await token.guard(asyncio.sleep(0, result=7)) == 7

    async def guarded(token: AbortToken) -> str:
        try:
            await token.guard(asyncio.sleep(30))
        except Aborted:
            return "aborted"
        return "ended"

    aborted = AbortToken()
    call = asyncio.create_task(guarded(aborted))
    await asyncio.sleep(0.01)
    aborted.abort()
    assert await asyncio.wait_for(call, 5) == "aborted"
    assert call.cancelling() == 0  # nothing of the abort is left on the task

    for also_aborted in (False, True):
        token = AbortToken()
        call = asyncio.create_task(guarded(token))
        await asyncio.sleep(0.01)
        call.cancel()
        if also_aborted:
            token.abort()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(call, 5)

    late = AbortToken()
    late.abort()
    work = asyncio.sleep(30)
    with pytest.raises(Aborted):
        await late.guard(work)
    assert work.cr_frame is None  # closed, never run: no "never awaited" warning


async def test_abort_cancels_the_call_in_progress() -> None:
    cancelled = asyncio.Event()

    async def hangs(number: int, time_left: float) -> Outcome:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Success(None)

    token = AbortToken()
    asyncio.get_running_loop().call_later(0.05, token.abort)
    with pytest.raises(Aborted):
        await call_with_retries(hangs, FAST, Budget(3, time.monotonic() + 60), token)
    assert cancelled.is_set()


# ---------------------------------------------------------------------------
# progress


class Sink:
    def __init__(self) -> None:
        self.values: list[float] = []

    async def __call__(self, value: float) -> None:
        self.values.append(value)


async def test_progress_is_coalesced_last_value_wins() -> None:
    sink = Sink()
    reporter = ProgressReporter(sink, interval=0.2)
    for value in (10, 20, 30, 40):
        assert reporter.offer(value)
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    assert sink.values == [10]  # the first goes out at once
    await asyncio.sleep(0.3)
    assert sink.values == [10, 40]  # one more after the interval: the last value
    await reporter.close(flush=True)
    assert sink.values == [10, 40]


async def test_progress_is_rate_limited() -> None:
    sink = Sink()
    reporter = ProgressReporter(sink, interval=0.1)
    began = time.monotonic()
    value = 0.0
    while time.monotonic() - began < 0.55:
        value += 1
        reporter.offer(value)
        await asyncio.sleep(0.005)
    await reporter.close(flush=False)
    assert 4 <= len(sink.values) <= 7  # ~one per 100 ms, not ~100
    assert sink.values == sorted(sink.values)


async def test_progress_is_monotonic() -> None:
    sink = Sink()
    reporter = ProgressReporter(sink, interval=0)
    for value in (50, 40, 50, 60):
        reporter.offer(value)
        await asyncio.sleep(0.01)
    await reporter.close(flush=True)
    assert sink.values == [50, 60]


async def test_close_flushes_the_pending_value_or_drops_it() -> None:
    flushed, dropped = Sink(), Sink()
    for sink, flush in ((flushed, True), (dropped, False)):
        reporter = ProgressReporter(sink, interval=10)
        reporter.offer(1)
        await asyncio.sleep(0.01)
        reporter.offer(99)
        await reporter.close(flush=flush)
        assert not reporter.offer(100)  # never after the terminal event
    assert flushed.values == [1, 99]
    assert dropped.values == [1]


async def test_board_routes_reports_to_the_task_in_flight() -> None:
    board = ProgressBoard()
    sink = Sink()
    reporter = ProgressReporter(sink, interval=0)
    assert not board.report("t1", 5)
    board.open("t1", reporter, "first")
    assert board.report("t1", 5)
    assert board.allows("t1", "first") and not board.allows("t1", "other")
    board.open("t1", reporter, "second")  # a redelivery taking over: its token alone
    assert board.allows("t1", "second") and not board.allows("t1", "first")
    board.remove("t1", reporter)
    assert not board.report("t1", 6)
    assert not board.allows("t1", "second")
    await reporter.close(flush=True)
    assert sink.values == [5]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"progress": 42.5}', 42.5),
        (b'{"progress": 0}', 0.0),
        (b'{"progress": 100}', 100.0),
        (b'{"progress": 250}', 100.0),  # clamped, as the lifecycle clamps it
        (b'{"progress": -0.1}', 0.0),
        (b'{"progress": "abc"}', str),
        (b'{"progress": true}', str),
        (b'{"progress": NaN}', str),
        (b'{"progress": 1e999}', str),
        (b'{"progress": ' + b"9" * 400 + b"}", 100.0),  # too big for a float, yet finite
        (b'{"progress": -' + b"9" * 400 + b"}", 0.0),
        (b"[42]", str),
        (b"{", str),
        (b"", str),
    ],
)
def test_progress_body_validation(raw: bytes, expected: object) -> None:
    value = parse_progress(raw)
    if expected is str:
        assert isinstance(value, str)
    else:
        assert value == expected


def test_a_start_reads_every_cancel_the_memory_holds_and_a_reconnection_a_minute_before() -> None:
    """Found by a black-box test: a dispatcher started more than a minute after a cancel read
    the cancel log from a minute back only (the overlap meant for a reconnection), not from
    CANCEL_MEMORY_SECONDS ago, and called the cancelled task. The start itself is end to end
    in tests/e2e/test_cancel.py."""
    now = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    day = 24 * 3600.0
    assert recall_since(None, day, now) == now - timedelta(days=1)  # a start: all of it
    lost = now - timedelta(minutes=10)
    assert recall_since(lost, day, now) == lost - RECALL_OVERLAP  # an outage: from before it
    assert recall_since(lost, 60.0, now) == now - timedelta(minutes=1)  # never past the memory
    ahead = now + timedelta(minutes=5)  # a clock ahead of ours: from now, never the future
    assert recall_since(ahead, day, now) == now


@pytest.mark.parametrize("charset", ["ISO-8859-1", "latin-1", "cp1252"])
def test_json_in_its_declared_charset_is_read_as_json(charset: str) -> None:
    """Found by a black-box sweep: `{"name": "caf\\xe9"}` declared ISO-8859-1 was stored as a
    string (the same in ASCII was an object), and a 400's errorMessage in it not read."""
    assert response_value(b'{"name": "caf\xe9"}', charset) == {"name": "café"}
    assert error_message(b'{"errorMessage": "caf\xe9 refus\xe9"}', charset) == "café refusé"


@pytest.mark.parametrize("charset", [None, "utf-8", "zlib", "no-such-codec"])
def test_bytes_that_are_no_utf_8_json_without_a_charset_for_them_are_text(
    charset: str | None,
) -> None:
    assert response_value(b'{"name": "caf\xe9"}', charset) == '{"name": "caf\ufffd"}'
