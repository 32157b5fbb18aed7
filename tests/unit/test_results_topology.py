"""A service is reported with "other arguments" (`broken()`, /readyz, the broken-topology
counter) only when the broker refused its declaration, never when the connection went away
under it: in CI a connection closed with INTERNAL_ERROR while a refresh declared a service, and
/readyz listed that service as broken until a later refresh."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import aiormq.exceptions
import pytest

from conveyor.events import MessageFormat
from gateway import results
from gateway.catalog import Service


class Channel:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    async def declare_queue(self, name: str, passive: bool = False, **_: Any) -> object:
        if self.error is not None and not passive:
            raise self.error
        return object()

    async def declare_exchange(self, *_: Any, **__: Any) -> object:
        return object()

    async def close(self) -> None:
        return None


class Broker:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    async def channel(self, prefetch: int | None = None) -> Channel:
        return Channel(self.error)

    async def queue_exists(self, name: str) -> bool:
        return True  # only declarations that are not passive fail here


def _service() -> Service:
    return Service(
        name="svc",
        queue_name="svc",
        capacity=None,
        json_schema=None,
        message_format=MessageFormat.CLOUDEVENTS,
        task_timeout=300,
        max_attempts=3,
        retention_seconds=86400,
        updated_at=datetime.now(UTC),
    )


def _consumer(error: Exception | None) -> results.ResultConsumer:
    return results.ResultConsumer(pool=None, broker=Broker(error), delivery_limit=5)  # type: ignore[arg-type]


def test_a_refused_declaration_marks_the_service_broken() -> None:
    refused = aiormq.exceptions.ChannelPreconditionFailed(
        "PRECONDITION_FAILED - inequivalent arg 'x-queue-type'"
    )
    consumer = _consumer(refused)
    missing = asyncio.run(consumer._declare(_service()))
    assert missing == set()  # its result queues exist: consumed as they are
    assert "PRECONDITION_FAILED" in consumer.broken()["svc"]


@pytest.mark.parametrize(
    "lost",
    [
        aiormq.exceptions.ConnectionInternalError(541, "INTERNAL_ERROR"),
        aiormq.exceptions.ConnectionClosed(320, "CONNECTION_FORCED"),
    ],
    ids=["internal error", "forced"],
)
def test_a_lost_connection_is_not_a_broken_service(lost: Exception) -> None:
    consumer = _consumer(lost)
    with pytest.raises(type(lost)):  # the refresh fails and runs again after the reconnection
        asyncio.run(consumer._declare(_service()))
    assert consumer.broken() == {}


class Reopened:
    """A replaced channel as aio-pika leaves it when our close lands while its restore reopens
    it (`RobustChannel.reopen` resets the close): open, with its consumers back."""

    def __init__(self) -> None:
        self.is_closed = False

    async def close(self) -> None:
        self.is_closed = True


def test_a_replaced_channel_a_reconnection_reopened_is_closed_again() -> None:
    consumer = results.ResultConsumer(None, broker=None, delivery_limit=5)  # type: ignore[arg-type]
    reopened, closed = Reopened(), Reopened()
    closed.is_closed = True
    consumer._replaced.extend([closed, reopened])  # type: ignore[list-item]
    asyncio.run(consumer._close_reopened())
    assert reopened.is_closed, "it would consume every result queue a second time"


class FrozenBroker(Broker):
    """Every look at a queue waits out the probe's timeout, as a frozen node makes it."""

    def __init__(self, timeout: float) -> None:
        super().__init__(None)
        self.timeout = timeout

    async def queue_exists(self, name: str) -> bool:
        async with asyncio.timeout(self.timeout):
            await asyncio.Event().wait()
        return True


def test_a_broker_that_does_not_answer_holds_the_subscriptions_one_timeout_not_one_per_service() -> (
    None
):
    services = [replace(_service(), name=f"svc{n}", queue_name=f"svc{n}") for n in range(10)]
    restored: list[dict[str, MessageFormat]] = []

    async def on_missing_in(missing: dict[str, MessageFormat]) -> None:
        restored.append(missing)

    consumer = results.ResultConsumer(
        pool=None,  # type: ignore[arg-type]
        broker=FrozenBroker(0.2),  # type: ignore[arg-type]
        delivery_limit=5,
        on_missing_in=on_missing_in,
    )
    began = time.monotonic()
    asyncio.run(consumer._restore_lost(services))
    assert time.monotonic() - began < 1.0  # 10 services at 0.2 s each before
    assert restored == []  # nothing found missing: nothing restored


class _OldChannel:
    is_closed = False

    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def test_a_refresh_that_never_ends_is_cut_named_failing_and_its_channel_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A black-box sweep saw both gateways stop consuming every result queue for good after a
    RabbitMQ cut (once: the broker's connection back, and from then on not one line of log,
    not even the refresh's warning each second: a refresh waiting on the client library for
    ever). A refresh is cut after REFRESH_LIMIT, counted as a failed pass (named in /readyz),
    and the results channel is let go, so the next refresh starts from a fresh one."""
    consumer = _consumer(None)
    consumer.refresh_interval = 0.01
    monkeypatch.setattr(results, "REFRESH_LIMIT", 0.2, raising=False)
    calls: list[float] = []

    async def refresh() -> None:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            await asyncio.Event().wait()  # a broker operation that never answers

    old = _OldChannel()
    consumer._channel = old  # type: ignore[assignment]
    monkeypatch.setattr(consumer, "refresh", refresh)
    supervisor = results.supervisor.Supervisor()

    async def run() -> dict[str, str]:
        supervisor.spawn("results-subscriptions", consumer.subscriptions_loop)
        await asyncio.sleep(0.3)  # the first cut, the second waiting
        failing = supervisor.failing()
        await asyncio.sleep(0.4)
        await supervisor.stop()
        return failing

    failing = asyncio.run(run())
    assert len(calls) >= 3 and calls[1] - calls[0] >= 0.2, calls
    assert "results-subscriptions" in failing, failing
    assert old.closed and consumer._channel is None


class _Unrestored:
    """A robust channel closed while it waited to be restored: every call waits for a restore
    that never comes (aio-pika's `RobustChannel.ready`)."""

    is_closed = False

    async def set_qos(self, **_: Any) -> None:
        await asyncio.Event().wait()


class _QueueOnIt:
    name = "svc.out"

    def __init__(self) -> None:
        self.channel = _Unrestored()

    async def cancel(self, tag: str) -> None:
        await asyncio.Event().wait()


def test_a_pace_on_a_channel_that_is_never_restored_gives_up_and_frees_the_next_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each call a pace makes on its channel is bounded: one that waited for good held
    `_pacing`, and with it the loop applying results and every refresh (found in CI)."""
    monkeypatch.setattr(results, "CONSUMER_LIMIT", 0.2)
    consumer = _consumer(None)
    queue = _QueueOnIt()
    consumer._channel = queue.channel  # type: ignore[assignment]
    pace = results._Pace(queue, "tag", dead=False, prefetch=1, seen=1, largest=10)  # type: ignore[arg-type]
    consumer._pace[queue.name] = pace

    async def run() -> bool:
        await asyncio.wait_for(consumer._pace_queues(), 2.0)
        return consumer._pacing.locked()

    assert asyncio.run(run()) is False
    assert pace.cancelled, "the next batch or refresh makes its consumer"
