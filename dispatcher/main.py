"""The dispatcher process, from start to exit code.

    bind the local API           (a busy port is exit code 1, at once)
    connect + wait for the function, concurrently
                                 (consume nothing before the function answers)
    hear cancels                 live on `<q>-control`, and those kept by `<q>-cancels`
                                 from before this start (consume nothing before either)
    consume `<q>-in`             each delivery -> its own task (worker.py)
    wait for                     SIGTERM/SIGINT, or in ONE_SHOT mode the one
                                 task done, or IDLE_EXIT_SECONDS since the start
                                 without one (whatever held it up: a broker down,
                                 a queue not declared yet)
    stop consuming, settle in-flight work (shutdown.py), close, exit 0

Exit codes: 0 for every orderly stop (Kubernetes and KEDA read anything else
as a failure), 1 when a setting is invalid, the function never became reachable
within FUNCTION_WAIT_TIMEOUT or the local port is taken.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from conveyor import heap, logs, tracing
from conveyor.amqp import from_amqp
from conveyor.dispatcher_settings import DispatcherSettings, SettingsError
from conveyor.events import WireError, decode_cancel
from conveyor.topology import dead_letter_queue, in_queue, out_queue
from dispatcher.api import EVERY_ADDRESS, ApiServer, Endpoints
from dispatcher.cancels import Cancels, recall_since
from dispatcher.consumer import Broker, Delivery
from dispatcher.inflight import InFlight
from dispatcher.invoker import Invoker
from dispatcher.metrics import Metrics
from dispatcher.progress import ProgressBoard
from dispatcher.publisher import Publisher
from dispatcher.readiness import FunctionProbe
from dispatcher.shutdown import Shutdown, settle
from dispatcher.worker import Worker

log = logging.getLogger("dispatcher")

# How long the cancel log may stay silent while a start or a reconnection reads it back; past
# it, the dispatcher carries on without the rest, as it used to. A silence, not the whole read:
# a day of cancels may be tens of thousands of messages, read a few thousand a second.
RECALL_PATIENCE = 5.0

# An idle dispatcher asks `-in` this often whether messages wait that none came to take
# (`_keep_hearing`): one passive declaration, on a channel kept for it.
READY_CHECK_INTERVAL = 10.0

# Idle replacements of the consumer that nothing followed double the idle time before the next,
# up to this (or RECONSUME_IDLE_SECONDS, if longer): each leaves ~4 KB on the connection.
RECONSUME_IDLE_LIMIT = 3600.0


def main() -> int:
    """The settings from the environment, then `run`. Each setting it cannot run with is a line
    on stderr (no traceback: the operator needs the variable's name, nothing else), exit 1."""
    try:
        settings = DispatcherSettings.from_env()
    except SettingsError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    return run(settings)


def run(settings: DispatcherSettings) -> int:
    """Runs the dispatcher until it stops; returns the process exit code."""
    logs.configure(settings.log_level, settings.log_format)
    tracing.configure("conveyor-dispatcher")  # nothing unless an OTLP endpoint is set
    try:
        import uvloop  # the `dispatcher` extra installs it, where it builds (not Windows)
    except ImportError:
        return asyncio.run(Dispatcher(settings).run())
    return uvloop.run(Dispatcher(settings).run())


class Dispatcher:
    def __init__(self, settings: DispatcherSettings) -> None:
        self.settings = settings
        self.shutdown = Shutdown()
        self.metrics = Metrics()
        self.board = ProgressBoard()
        self.in_flight = InFlight(self.metrics)
        self.cancels = Cancels(settings.cancel_memory_seconds)
        self.broker = Broker(
            settings.amqp_url,
            in_queue(settings.queue),
            out_queue(settings.queue),
            prefetch=1 if settings.one_shot else settings.concurrency + settings.prefetch_buffer,
            name=f"conveyor-dispatcher {settings.hostname}",
            heartbeat=settings.amqp_heartbeat,
        )
        self.probe = FunctionProbe(settings.function_url, settings.function_ready_url)
        self.invoker = Invoker(
            settings.function_url,
            settings.concurrency,
            settings.max_response_bytes,
            settings.max_response_items,
        )
        self.endpoints = Endpoints(
            self.board, self.metrics, self.readiness, self.settings.request_read_timeout
        )
        self.servers: list[ApiServer] = []
        self.worker: Worker | None = None
        self.accepting = False
        self.taken = asyncio.Event()  # ONE_SHOT: the one message has arrived
        self._background: set[asyncio.Task[None]] = set()
        self._lost_at: datetime | None = None  # the broker connection was lost then
        self._heard_at = time.monotonic()  # the last delivery from -in (see `_keep_hearing`)
        self._fruitless = 0  # idle replacements since it, none followed by a delivery

    async def run(self) -> int:
        self.shutdown.install()
        idle = self._exit_when_idle() if self.settings.one_shot else None
        try:
            try:
                await self._start_api()
            except OSError as exc:
                log.error("cannot listen", extra={"error": repr(exc)})
                return 1
            return await self._lifecycle()
        finally:
            if idle is not None:
                idle.cancel()
            await self._close()

    def _exit_when_idle(self) -> asyncio.TimerHandle:
        """ONE_SHOT: a Job without a message IDLE_EXIT_SECONDS after its start stops (KEDA may
        start more Jobs than there are messages), whatever kept it from one; counted from when
        consuming began, a broker down or a queue not declared kept it waiting forever. It
        stops as on SIGTERM: a message that arrives meanwhile is settled by SHUTDOWN_MODE."""

        def idle() -> None:
            if not self.taken.is_set():
                log.info(
                    "no message; exiting", extra={"idle_seconds": self.settings.idle_exit_seconds}
                )
                self.shutdown.request("idle")

        return asyncio.get_running_loop().call_later(self.settings.idle_exit_seconds, idle)

    async def _lifecycle(self) -> int:
        stop = self.shutdown.requested
        connecting = asyncio.create_task(self._connect(stop))
        function_ready = await self.probe.wait(self.settings.function_wait_timeout, stop)
        if not function_ready and not stop.is_set():
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            log.error(
                "function not reachable; giving up",
                extra={"timeout": self.settings.function_wait_timeout},
            )
            return 1
        connected = await connecting
        if stop.is_set() or not connected:
            return 0
        assert self.broker.publishing is not None
        publisher = Publisher(
            self.broker.publishing,
            self.broker.in_queue,
            self.broker.out_queue,
            dead_letter_queue(self.settings.queue),
            self.settings.queue,
        )
        self.worker = Worker(
            self.settings,
            publisher,
            self.invoker,
            self.board,
            self.metrics,
            self.in_flight,
            self.cancels,
            self.shutdown.requested,
        )
        self.accepting = True
        await self.broker.listen_for_cancels(
            self.settings.queue, self.settings.hostname, self._on_cancel
        )
        await self._recall_cancels(self._since(None))  # before this start: all of it
        self._watch_reconnections()
        frozen = heap.serve(self.metrics.gc_pauses)  # before the first message: none in flight
        await self.broker.consume(self._on_message)
        log.info(
            "ready",
            extra={
                "queue": self.broker.in_queue,
                "one_shot": self.settings.one_shot,
                "frozen": frozen,
            },
        )
        hearing = None if self.settings.one_shot else asyncio.create_task(self._keep_hearing())
        await self._wait_for_the_end()
        self.accepting = False
        if hearing is not None:
            hearing.cancel()
            await asyncio.gather(hearing, return_exceptions=True)
        await self.broker.stop_consuming()
        await settle(self.in_flight, self.settings.shutdown_mode, self.settings.drain_timeout)
        return 0

    async def _connect(self, stop: asyncio.Event) -> bool:
        return await self.broker.wait_for_queues(stop) and await self.broker.connect(stop)

    async def _wait_for_the_end(self) -> None:
        waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(self.shutdown.requested.wait())]
        if self.settings.one_shot:
            waiters.append(asyncio.ensure_future(self._one_shot()))
        _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in pending:
            waiter.cancel()

    async def _one_shot(self) -> None:
        """The one task done (without one, `_exit_when_idle` stops the process)."""
        await self.taken.wait()
        await self.in_flight.wait_idle(None)

    def _on_message(self, message: AbstractIncomingMessage) -> None:
        """Consumer callback: hands the delivery to a task of ours and returns."""
        assert self.worker is not None
        delivery = Delivery.of(message)
        if not self.accepting:
            self.in_flight.spawn(self.worker.hand_back(delivery))
            return
        self.metrics.received.inc()
        self._heard_at = time.monotonic()
        self._fruitless = 0
        if self.settings.one_shot:
            self.accepting = False
            self.taken.set()
            self.in_flight.spawn(self._handle_the_one(delivery))
            return
        self.in_flight.spawn(self.worker.handle(delivery))

    async def _keep_hearing(self) -> None:
        """A consumer the broker stopped feeding without a word (RabbitMQ 3.10, a quorum `-in`
        deleted and declared again at once: the new queue hands its messages to the old
        consumer, whose channel never passes them on) is replaced (`Broker.consume_again`):
        at once when, idle, it sees messages ready in `-in` that none came to take (a backlog
        beyond the prefetch the broker gave it), else after RECONSUME_IDLE_SECONDS idle (the
        messages it was handed, within its prefetch, are not ready: the broker counts them
        delivered). Each replacement leaves ~4 KB on the connection for good (aio-pika
        10.2.1), so an idle replacement that no delivery follows doubles the idle time before
        the next, up to RECONSUME_IDLE_LIMIT (an hour): ~24 a day idle, not 288; a delivery
        starts again from RECONSUME_IDLE_SECONDS. Idle means nothing delivered and nothing in
        flight. An error is logged and the next check tries again."""
        period = self.settings.reconsume_idle_seconds
        if not period:
            return
        check = min(period, READY_CHECK_INTERVAL)
        limit = max(period, RECONSUME_IDLE_LIMIT)
        while True:
            await asyncio.sleep(check)
            if len(self.in_flight):
                self._heard_at = time.monotonic()  # busy: idle counts from the end of its work
                continue
            asked = self._heard_at
            if time.monotonic() - asked < check or not self.accepting:
                continue  # a delivery lately, or stopping
            fruitless = self._fruitless
            waited = False  # messages ready in -in: a delivery will follow, not a doubling
            try:
                if not await self.broker.consuming():
                    continue  # cancelled by the broker, or being restored: aio-pika's
                if time.monotonic() - asked < min(period * 2 ** min(fruitless, 20), limit):
                    ready = await self.broker.ready_in_queue()
                    if not ready or self._heard_at != asked or len(self.in_flight):
                        continue  # nothing waits, or a delivery came meanwhile
                    waited = True
                replaced = await self.broker.consume_again(self._on_message)
            except Exception as exc:
                log.warning("consumer not replaced", extra={"error": logs.describe(exc)})
                continue
            if replaced:
                if self._heard_at == asked:  # else a delivery came meanwhile: it counts
                    self._heard_at = time.monotonic()  # idle again from now
                    self._fruitless = 0 if waited else fruitless + 1
                self.metrics.consumers_replaced.inc()
                log.info("nothing delivered for a while: consuming on a fresh channel")

    async def _handle_the_one(self, delivery: Delivery) -> None:
        """A Job's one message. Its consumer is cancelled first: a message settled at once (a
        cancelled task's, acked without a call) would otherwise make room for the next one,
        which would be handed back, counted as an attempt never made."""
        assert self.worker is not None
        await self.broker.stop_consuming()
        await self.worker.handle(delivery)

    def _on_cancel(self, message: AbstractIncomingMessage) -> None:
        """A cancel broadcast by the gateway (SPEC §11.1): remembered, its call aborted."""
        task_id = _cancelled_task(message)
        if task_id is not None:
            aborted = self.cancels.heard(task_id)
            log.info("cancel heard", extra={"task_id": task_id, "calls_aborted": aborted})

    def _on_recalled(self, message: AbstractIncomingMessage) -> None:
        if (task_id := _cancelled_task(message)) is not None:
            self.cancels.heard(task_id)

    def _since(self, missed_from: datetime | None) -> datetime:
        return recall_since(missed_from, self.settings.cancel_memory_seconds, datetime.now(UTC))

    async def _recall_cancels(self, since: datetime) -> None:
        """The cancels broadcast when no queue of ours was there to hear them: before this
        start (scaled from zero, a Job, a restart) or during an outage. Their messages are
        acked without a call; deliveries meanwhile wait for this to end."""
        self.cancels.recalling()
        try:
            read = await self.broker.recall_cancels(
                self.settings.queue, since, self._on_recalled, RECALL_PATIENCE
            )
        finally:
            self.cancels.recalled()
        if read:
            log.info("cancels recalled", extra={"cancels": read, "remembered": len(self.cancels)})

    def _watch_reconnections(self) -> None:
        """The exclusive cancel queue is gone with a lost connection, and what was broadcast
        until the new one is bound was heard by no queue of ours: read it from the log."""
        connection = self.broker.connection
        assert connection is not None

        def lost(*_: Any) -> None:
            if self._lost_at is None:
                self._lost_at = datetime.now(UTC)
                self.cancels.recalling()  # no delivery is called before the log is read

        def back(*_: Any) -> None:
            since = self._since(self._lost_at or datetime.now(UTC))
            self._lost_at = None
            self._run_in_background(self._recall_cancels(since))

        connection.close_callbacks.add(lost)
        connection.reconnect_callbacks.add(back)

    async def readiness(self) -> dict[str, bool]:
        return {
            "broker": self.broker.connected and await self.broker.consuming(),
            "function": await self.probe.reachable(),
            "accepting": self.accepting and not self.shutdown.requested.is_set(),
        }

    async def _start_api(self) -> None:
        read_timeout = self.settings.request_read_timeout
        self.servers.append(
            ApiServer(
                self.endpoints.local_app(), "127.0.0.1", self.settings.dispatcher_port, read_timeout
            )
        )
        if self.settings.metrics_port:
            self.servers.append(
                ApiServer(
                    self.endpoints.probe_app(),
                    EVERY_ADDRESS,
                    self.settings.metrics_port,
                    read_timeout,
                )
            )
        if self.settings.progress_port:
            self.servers.append(
                ApiServer(
                    self.endpoints.remote_progress_app(),
                    # the pod IP alone (SPEC §11.5), or this host when the function is here
                    self.settings.pod_ip or "127.0.0.1",
                    self.settings.progress_port,
                    read_timeout,
                )
            )
        for server in self.servers:
            await server.start()

    def _run_in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _close(self) -> None:
        await self.broker.close()
        await asyncio.gather(
            self.invoker.close(),
            self.probe.close(),
            *(server.stop() for server in self.servers),
            return_exceptions=True,
        )
        self.shutdown.uninstall()
        if tracing.enabled:
            await asyncio.to_thread(tracing.shutdown)  # the last spans are exported
        log.info("stopped")


def _cancelled_task(message: AbstractIncomingMessage) -> str | None:
    try:
        return decode_cancel(from_amqp(message))
    except WireError as exc:
        log.warning("unreadable control message ignored", extra={"reason": str(exc)})
        return None
