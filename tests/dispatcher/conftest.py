"""Fixtures for the dispatcher's tests: a real broker, real processes, real signals.

* `rabbit`: the service topology declared as the gateway would (quorum `-in`
  with a delivery limit, `-dlq`, `-out`), a publisher of submissions, a reader
  of `-out`; the queues are deleted afterwards. `@pytest.mark.topology(...)`
  changes the delivery limit or the message format.
* `function`: the fake function (fakefunction.py) in its own process.
* `launch`: starts `python -m dispatcher` with the environment of a test.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import pytest

from conveyor.amqp import from_amqp, to_amqp
from conveyor.events import (
    EventKind,
    MessageFormat,
    Submission,
    TaskEvent,
    decode_event,
    encode_cancel,
    encode_submission,
)
from conveyor.topology import (
    cancel_log,
    control_exchange,
    dead_letter_queue,
    declare_cancel_log,
    declare_service,
    in_queue,
    out_queue,
)
from tests.support.processes import Proc, Processes, free_port


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "topology(delivery_limit=3, fmt=MessageFormat.CLOUDEVENTS): queues of a test"
    )


async def eventually(
    check: Callable[[], Any], timeout: float, what: str, step: float = 0.05
) -> Any:
    """Polls `check` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(step)


# ---------------------------------------------------------------------------
# broker


@dataclass
class Rabbit:
    url: str
    queue: str
    fmt: MessageFormat
    connection: aio_pika.abc.AbstractConnection | None = None
    channel: aio_pika.abc.AbstractChannel | None = None
    events: list[TaskEvent] = field(default_factory=list)
    undecodable: int = 0

    @property
    def in_q(self) -> str:
        return in_queue(self.queue)

    @property
    def out_q(self) -> str:
        return out_queue(self.queue)

    @property
    def dlq(self) -> str:
        return dead_letter_queue(self.queue)

    async def open(self, delivery_limit: int) -> None:
        # Robust, so that a broker restart by a neighbouring test does not fail this one.
        self.connection = await aio_pika.connect_robust(self.url)
        self.channel = await self.connection.channel(publisher_confirms=True)
        await declare_service(self.channel, self.queue, self.fmt, delivery_limit)
        out = await self.channel.declare_queue(self.out_q, passive=True)
        await out.consume(self._on_event)

    async def _on_event(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        wire = from_amqp(message)
        try:
            self.events.append(decode_event(wire))
        except ValueError:
            self.undecodable += 1
        await message.ack()

    async def close(self) -> None:
        assert self.channel is not None and self.connection is not None
        for name in (self.in_q, self.out_q, self.dlq, cancel_log(self.queue)):
            await self.channel.queue_delete(name)
        await self.channel.exchange_delete(control_exchange(self.queue))
        await self.connection.close()

    # -- publishing -----------------------------------------------------------

    async def submit(self, body: dict[str, Any], **fields: Any) -> str:
        task_id = str(uuid.uuid4())
        wire = encode_submission(
            Submission(
                task_id=task_id, service=self.queue, body=body, message_format=self.fmt, **fields
            )
        )
        await self.publish_raw(wire.body, wire.headers, wire.message_id)
        return task_id

    async def cancel(self, task_id: str) -> None:
        """What the gateway does on a cancel: the broadcast, kept by the cancel log."""
        assert self.channel is not None
        await declare_cancel_log(self.channel, self.queue)
        exchange = await self.channel.get_exchange(control_exchange(self.queue))
        await exchange.publish(to_amqp(encode_cancel(task_id, self.queue)), "")

    async def publish_raw(
        self, body: bytes, headers: dict[str, Any] | None = None, message_id: str | None = None
    ) -> None:
        assert self.channel is not None
        message = aio_pika.Message(
            body,
            headers=headers or {},
            content_type="application/json",
            message_id=message_id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await self.channel.default_exchange.publish(message, self.in_q)

    # -- reading --------------------------------------------------------------

    async def depth(self, name: str) -> int:
        """Ready messages in a queue (unacked ones are not counted)."""
        assert self.connection is not None
        channel = await self.connection.channel()
        try:
            queue = await channel.declare_queue(name, passive=True)
            return queue.declaration_result.message_count or 0
        finally:
            await channel.close()

    def of(self, task_id: str) -> list[TaskEvent]:
        return [e for e in self.events if e.task_id == task_id]

    def kinds(self, task_id: str) -> list[EventKind]:
        return [e.kind for e in self.of(task_id)]

    def terminal(self, task_id: str) -> TaskEvent | None:
        return next((e for e in self.of(task_id) if e.kind.terminal), None)

    async def wait_terminal(self, task_id: str, timeout: float = 15) -> TaskEvent:
        return await eventually(
            lambda: self.terminal(task_id), timeout, f"terminal event of {task_id}"
        )


@pytest.fixture
async def rabbit(
    amqp_url: str, queue_name: str, request: pytest.FixtureRequest
) -> AsyncIterator[Rabbit]:
    marker = request.node.get_closest_marker("topology")
    options = marker.kwargs if marker else {}
    helper = Rabbit(amqp_url, queue_name, options.get("fmt", MessageFormat.CLOUDEVENTS))
    await helper.open(options.get("delivery_limit", 3))
    yield helper
    await helper.close()


# ---------------------------------------------------------------------------
# the fake function


@dataclass
class FakeFunction:
    proc: Proc
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def entries(self, phase: str = "start") -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        entries = [json.loads(line) for line in lines if line.strip()]
        return [e for e in entries if e["phase"] == phase]

    def calls(self, task_id: str, phase: str = "start") -> list[dict[str, Any]]:
        return [e for e in self.entries(phase) if e["id"] == task_id]

    async def wait_calls(
        self, task_id: str, count: int = 1, timeout: float = 10
    ) -> list[dict[str, Any]]:
        return await eventually(
            lambda: (calls := self.calls(task_id)) and len(calls) >= count and calls,
            timeout,
            f"{count} call(s) of {task_id}",
        )


def start_function(
    procs: Processes,
    tmp_path: Path,
    start_delay: float = 0.0,
    name: str = "function",
    port: int | None = None,
) -> FakeFunction:
    port = port or free_port()
    log = tmp_path / f"{name}.jsonl"
    args = [
        sys.executable,
        "-m",
        "tests.dispatcher.fakefunction",
        "--port",
        str(port),
        "--log",
        str(log),
    ]
    if start_delay:
        args += ["--start-delay", str(start_delay)]
    return FakeFunction(procs.start(name, args), port, log)


@pytest.fixture
def function(procs: Processes, tmp_path: Path) -> FakeFunction:
    return start_function(procs, tmp_path)


# ---------------------------------------------------------------------------
# the dispatcher


@dataclass
class DispatcherProc:
    proc: Proc
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_ready(self, timeout: float = 15) -> None:
        async with httpx.AsyncClient(timeout=1) as client:

            async def ready() -> bool:
                if not self.proc.alive():
                    raise AssertionError(f"dispatcher exited:\n{self.proc.logs()[-3000:]}")
                try:
                    return (await client.get(f"{self.base}/readyz")).status_code == 200
                except httpx.HTTPError:
                    return False

            await eventually(ready, timeout, "dispatcher /readyz", step=0.05)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.signal(sig)

    async def exit_code(self, timeout: float) -> int:
        return await asyncio.to_thread(self.proc.wait, timeout)

    def log_records(self) -> list[dict[str, Any]]:
        records = []
        for line in self.proc.logs().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                records.append({"message": line})
        return records


Launch = Callable[..., DispatcherProc]


@pytest.fixture
def launch(procs: Processes, amqp_url: str, queue_name: str) -> Launch:
    counter = 0

    def start(
        function_url: str, amqp: str | None = None, cli: bool = False, **env: Any
    ) -> DispatcherProc:
        """`python -m dispatcher`, or with `cli` the real `conveyor dispatcher`."""
        nonlocal counter
        counter += 1
        port = free_port()
        full_env = {
            "CONVEYOR_AMQP_URL": amqp or amqp_url,
            "CONVEYOR_QUEUE": queue_name,
            "CONVEYOR_FUNCTION_URL": function_url,
            "CONVEYOR_DISPATCHER_PORT": str(port),
            "CONVEYOR_HOSTNAME": f"pod-{counter}",
            "CONVEYOR_CONCURRENCY": "4",
            "CONVEYOR_PROGRESS_INTERVAL": "0.05",
            "CONVEYOR_RETRY_BACKOFF": "0.05",
            "CONVEYOR_FUNCTION_WAIT_TIMEOUT": "30",
            "CONVEYOR_LOG_FORMAT": "json",
            "CONVEYOR_LOG_LEVEL": "INFO",
        }
        full_env.update({f"CONVEYOR_{k.upper()}": str(v) for k, v in env.items()})
        name = f"dispatcher-{counter}"
        if cli:
            proc = procs.conveyor(name, "dispatcher", env=full_env)
        else:
            proc = procs.start(name, [sys.executable, "-m", "dispatcher"], full_env)
        return DispatcherProc(proc, port)

    return start
