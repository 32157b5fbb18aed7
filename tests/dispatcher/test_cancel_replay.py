"""A dispatcher started on a service with a long cancel log (SPEC §11.1).

Found by a black-box test: after some 6,700 cancels on a service, every new dispatcher gave
up reading its `<q>-cancels` stream after 5 s, closed the channel while deliveries were still
being acked, and an ack on that closed channel made the broker close the whole connection
(CHANNEL_ERROR, expected 'channel.open'): the process exited, Kubernetes restarted it into
the same end, and the service's queued tasks never ran.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from datetime import UTC, datetime, timedelta

from aio_pika.abc import AbstractIncomingMessage

from conveyor.events import EventKind
from dispatcher.consumer import Broker as DispatcherBroker
from gateway.broker import Broker
from gateway.cancel import tell_dispatchers
from tests.dispatcher.conftest import FakeFunction, Launch, Rabbit, eventually

# More than a start gave itself 5 s for: a few seconds of reading at the very least.
LOGGED_CANCELS = 30_000
# Sent as the gateway sends a batch (a service deleted), several batches at once.
PUBLISHERS = 6


async def _cancel(broker: Broker, queue: str, task_ids: list[uuid.UUID]) -> None:
    assert await tell_dispatchers(broker, "s", [queue], task_ids)


async def test_a_dispatcher_starts_on_tens_of_thousands_of_cancels_and_honours_the_last(
    rabbit: Rabbit, function: FakeFunction, launch: Launch, amqp_url: str
) -> None:
    wanted = [await rabbit.submit({}) for _ in range(5)]
    doomed = [await rabbit.submit({}) for _ in range(5)]
    broker = Broker(amqp_url)
    await broker.connect()  # else the gateway does not declare the log, and the cancels go nowhere
    try:
        others = [uuid.uuid4() for _ in range(LOGGED_CANCELS)]
        share = -(-LOGGED_CANCELS // PUBLISHERS)
        await asyncio.gather(
            *(
                _cancel(broker, rabbit.queue, others[start : start + share])
                for start in range(0, LOGGED_CANCELS, share)
            )
        )
        # Last in the log: a dispatcher that stops reading early calls these.
        await _cancel(broker, rabbit.queue, [uuid.UUID(task_id) for task_id in doomed])
    finally:
        await broker.close()

    started = time.monotonic()
    dispatcher = launch(function.url)
    await dispatcher.wait_ready(timeout=60)
    ready_after = time.monotonic() - started

    for task_id in wanted:
        assert (await rabbit.wait_terminal(task_id, timeout=20)).kind is EventKind.SUCCEEDED
    await eventually(lambda: _depth_is(rabbit, rabbit.in_q, 0), 15, "-in emptied")
    await asyncio.sleep(1)  # time for a late crash or a late call
    assert dispatcher.proc.alive(), dispatcher.proc.logs()[-3000:]
    assert all(function.calls(task_id) == [] for task_id in doomed)
    assert all(rabbit.of(task_id) == [] for task_id in doomed)

    dispatcher.signal(signal.SIGTERM)
    assert await dispatcher.exit_code(15) == 0
    assert await rabbit.depth(rabbit.in_q) == 0  # the cancelled ones were acked, not handed back
    records = dispatcher.log_records()
    recalled = [r for r in records if r.get("message") == "cancels recalled"]
    assert recalled and recalled[0]["cancels"] == LOGGED_CANCELS + len(doomed), records[-20:]
    logs = dispatcher.proc.logs()
    for trouble in ("not read in time", "CHANNEL_ERROR", "Traceback", "callback failed"):
        assert trouble not in logs, logs[-3000:]
    print(f"{LOGGED_CANCELS + len(doomed)} cancels read back; ready after {ready_after:.1f} s")


async def _depth_is(rabbit: Rabbit, queue: str, depth: int) -> bool:
    return await rabbit.depth(queue) == depth


async def test_a_read_that_runs_out_of_patience_leaves_the_connection_alone(
    rabbit: Rabbit, amqp_url: str
) -> None:
    """The log goes silent mid-read (here: the reader itself stalls once): the read gives up,
    as its warning says, and the connection it shares with the consumer of `-in` stays up;
    the next read gets everything."""
    cancels = 5_000
    broker = Broker(amqp_url)
    await broker.connect()
    try:
        await _cancel(broker, rabbit.queue, [uuid.uuid4() for _ in range(cancels)])
    finally:
        await broker.close()

    dispatcher = DispatcherBroker(amqp_url, rabbit.in_q, rabbit.out_q, 4, "test")
    assert await dispatcher.connect(asyncio.Event())
    assert dispatcher.connection is not None
    losses: list[object] = []
    dispatcher.connection.close_callbacks.add(lambda *args: losses.append(args))
    heard = 0

    def stalls_once(message: AbstractIncomingMessage) -> None:
        nonlocal heard
        heard += 1
        if heard == 1_000:
            time.sleep(1)  # longer than the patience: the deadline passes meanwhile

    since = datetime.now(UTC) - timedelta(hours=1)
    try:
        assert await dispatcher.recall_cancels(rabbit.queue, since, stalls_once, 0.5) is None
        await asyncio.sleep(2)  # a broker that closes the connection does it in this time
        assert not losses and dispatcher.connection.connected.is_set()
        assert await dispatcher.recall_cancels(rabbit.queue, since, lambda m: None, 5) == cancels
        assert not losses and dispatcher.connection.connected.is_set()
    finally:
        await dispatcher.close()
