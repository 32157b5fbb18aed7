"""Retries of the function call: capped exponential backoff with jitter.

A delivery gets `maxAttempts` calls at most, all within the task timeout (one
deadline per delivery, also sent to the function as `X-Conveyor-Deadline`).
A call that could not connect is not one of them: the function never saw it, and
one that is restarting (a crash, an OOM kill of its container) must not turn the
tasks of that moment into failures (SPEC §7). It is tried again, every second at
most, until the function answers or the deadline passes.
A `Retry-After` answer header is honoured: the pause is never shorter than what
the function asked for, and when that pause would cross the deadline the task
fails now with the last cause instead of sleeping for nothing.

The policy is pure (delays and the Retry-After parser take the clock and the
random source as arguments) so that it is unit-tested without a broker.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

from dispatcher.invoker import Failure, Outcome
from dispatcher.shutdown import AbortToken


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header: delta-seconds or an HTTP-date."""
    if value is None:
        return None
    value = value.strip()
    # ASCII only (RFC 9110 delta-seconds): isdigit() alone also holds for "²" and "①",
    # which float() refuses; other digits are ignored like any other garbage.
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    base: float = 0.5  # pause before the first retry (before jitter)
    cap: float = 30.0  # longest computed pause; a Retry-After may ask for more

    def delay(
        self,
        retry_number: int,
        retry_after: float | None = None,
        rand: Callable[[], float] = random.random,
    ) -> float:
        """Pause before retry `retry_number` (1 = the first retry).

        "Equal jitter": half the exponential step is fixed, half is random, so
        that retries of many tasks spread out but never collapse to zero.
        """
        step = min(self.cap, self.base * 2 ** (retry_number - 1))
        jittered = step / 2 + step / 2 * rand()
        if retry_after is not None:
            return max(retry_after, jittered)
        return jittered


@dataclass(frozen=True, slots=True)
class Budget:
    """What one delivery may spend on its function: calls and time."""

    max_attempts: int
    deadline: float  # time.monotonic() value

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


# The longest pause between calls that could not connect: a restarted function is called
# within a second of listening again.
UNREACHED_PAUSE = 1.0

Call = Callable[[int, float], Awaitable[Outcome]]
"""One function call: (call number from 1, seconds left) -> outcome."""

OnRetry = Callable[[Failure, float], None]


async def call_with_retries(
    call: Call,
    policy: RetryPolicy,
    budget: Budget,
    abort: AbortToken,
    on_retry: OnRetry | None = None,
) -> Outcome:
    """Calls until an outcome is final, attempts run out, or time does.

    Raises `Aborted` (from the token) when the dispatcher shuts down meanwhile.
    """
    outcome: Outcome = Failure("task timeout before the function was called", retryable=False)
    number = 1
    unreached = 0  # calls in a row that could not connect
    while True:
        left = budget.remaining()
        if left <= 0:
            return _timed_out(outcome)
        outcome = await abort.guard(call(number, left))
        if not isinstance(outcome, Failure) or not outcome.retryable:
            return outcome
        if budget.remaining() <= 0:
            return _timed_out(outcome)
        if outcome.unreachable:
            unreached += 1
            pause = min(UNREACHED_PAUSE, policy.delay(unreached))
            if pause >= budget.remaining():
                return _timed_out(outcome)
        elif number == budget.max_attempts:
            return Failure(outcome.error, retryable=False)
        else:
            unreached = 0
            pause = policy.delay(number, parse_retry_after(outcome.retry_after))
            if pause >= budget.remaining():
                return Failure(f"{outcome.error} (no time left to retry)", retryable=False)
            number += 1
        if on_retry is not None:
            on_retry(outcome, pause)
        await abort.sleep(pause)


def _timed_out(last: Outcome) -> Failure:
    """The task's time is up: the last call's own timeout says so already; another cause
    (a 503, say) is given with it."""
    if isinstance(last, Failure) and last.timed_out:
        return Failure(last.error, retryable=False, timed_out=True)
    cause = last.error if isinstance(last, Failure) else "no answer"
    return Failure(f"task timeout: {cause}", retryable=False)
