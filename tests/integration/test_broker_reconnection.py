"""Reconnections to the broker (SPEC §11.7), on the real RabbitMQ behind a TCP proxy:

* a broker that stops answering without closing anything (a frozen node, a paused VM) is left
  after about one heartbeat, as `CONVEYOR_AMQP_HEARTBEAT` documents, and the connection comes
  back by itself once the broker answers again (the proxy pauses: no byte passes either way);
* a dispatcher that reconnects while the broker still holds its old connection open (a
  cluster that has not yet given up on a frozen node) hears cancels again: its exclusive
  cancel queue is declared under a new name, where the old name stayed locked and refused
  the whole reconnection (RESOURCE_LOCKED) until the node came back;
* a connection the broker refused for a while publishes again within about a second of the
  broker's return (aio-pika's own interval between attempts is 5 s).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage
from aiormq.exceptions import ChannelInvalidStateError
from yarl import URL

from conveyor import topology
from conveyor.connection import CONNECTION_ERRORS, connect, connect_robust
from dispatcher.consumer import Broker
from tests.support.gateway import GatewayProcess, gateway_env
from tests.support.processes import processes
from tests.support.tcpproxy import TcpProxy

HEARTBEAT = 2  # seconds
# RabbitMQ's own rule: a peer silent for two heartbeat frames (one every HEARTBEAT / 2) is
# gone. Checked every HEARTBEAT / 2, so noticed at most HEARTBEAT + 1 + HEARTBEAT / 2 after
# the last frame; one more second of slack for a loaded machine. aiormq's own default waited
# three whole heartbeats plus three seconds, 9-10 s here.
NOTICED_WITHIN = 2 * HEARTBEAT + 1.5
# What a publish raises while the connection is down or its channel not yet restored.
GONE: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, ChannelInvalidStateError)


async def _published_once_back(
    channel: aio_pika.abc.AbstractChannel,
    queue: aio_pika.abc.AbstractQueue,
    body: bytes,
    patience: float,
) -> float:
    """Publishes `body` until the broker confirms it and the queue holds it, and reads it back;
    the seconds taken. A publish confirmed before the restored channel has declared the queue
    again goes nowhere (seen in CI on a loaded machine): it is published again."""
    since = time.monotonic()
    while True:
        try:
            await asyncio.wait_for(
                channel.default_exchange.publish(aio_pika.Message(body), queue.name), 5
            )
            got = await queue.get(timeout=5, fail=False)
            if got is not None:
                assert got.body == body
                return time.monotonic() - since
        except GONE:
            pass
        assert time.monotonic() - since < patience, "the connection never came back"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(90)
def test_a_silent_broker_is_left_after_a_heartbeat_and_rejoined_when_it_answers(
    amqp_proxy: TcpProxy, amqp_url: str
) -> None:
    async def scenario() -> tuple[float, float]:
        connection = await connect_robust(
            amqp_proxy.url(amqp_url), name="heartbeat-test", heartbeat=HEARTBEAT
        )
        dropped = asyncio.Event()
        connection.close_callbacks.add(lambda *_: dropped.set())
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(exclusive=True, auto_delete=True)
            await channel.default_exchange.publish(aio_pika.Message(b"before"), queue.name)

            amqp_proxy.pause()
            paused = time.monotonic()
            await asyncio.wait_for(dropped.wait(), 30)
            noticed = time.monotonic() - paused

            amqp_proxy.resume()  # attempts made meanwhile hang in the proxy until their timeout
            # The robust connection, its channel and its queue come back by themselves: a
            # confirmed publish goes through again.
            rejoined = await _published_once_back(channel, queue, b"after", patience=45)
            return noticed, rejoined
        finally:
            amqp_proxy.resume()
            await connection.close()

    noticed, rejoined = asyncio.run(scenario())
    print(f"silent broker noticed after {noticed:.1f} s, rejoined {rejoined:.1f} s after")
    assert noticed <= NOTICED_WITHIN, f"a silent broker went unnoticed for {noticed:.1f} s"


@pytest.mark.timeout(90)
def test_a_dispatcher_hears_cancels_again_after_a_reconnection_the_broker_missed(
    amqp_proxy: TcpProxy, amqp_url: str
) -> None:
    queue_name = f"reconnect-{uuid.uuid4().hex[:10]}"
    exchange = topology.control_exchange(queue_name)

    async def scenario() -> list[bytes]:
        heard: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_cancel(message: AbstractIncomingMessage) -> None:
            await heard.put(message.body)

        # No heartbeat: the broker keeps the orphaned connection, however long the test takes.
        broker = Broker(
            amqp_proxy.url(amqp_url), "unused-in", "unused-out", 1, "reconnect-test", heartbeat=0
        )
        sender = await connect(amqp_url, name="reconnect-test sender")
        try:
            assert await broker.connect(asyncio.Event())
            await broker.listen_for_cancels(queue_name, "pod", on_cancel)
            channel = await sender.channel()
            control = await channel.get_exchange(exchange)

            async def cancel_heard(body: bytes, within: float) -> bytes:
                deadline = time.monotonic() + within
                while True:  # the cancel queue may not be bound yet: broadcast again
                    await control.publish(aio_pika.Message(body), routing_key="")
                    try:
                        return await asyncio.wait_for(heard.get(), 1.0)
                    except TimeoutError:
                        assert time.monotonic() < deadline, f"{body!r} never heard"

            first = await cancel_heard(b"before", 10)
            amqp_proxy.orphan()  # the dispatcher's side drops; the broker's side stays open
            second = await cancel_heard(b"after", 30)
            return [first, second]
        finally:
            await broker.close()
            channel = await sender.channel()
            await channel.exchange_delete(exchange)
            await sender.close()

    assert asyncio.run(scenario()) == [b"before", b"after"]


@pytest.mark.timeout(90)
def test_a_connection_is_back_within_about_a_second_of_the_broker(
    amqp_proxy: TcpProxy, amqp_url: str
) -> None:
    """The one connection factory, as the gateway and the dispatcher call it: once the broker
    accepts connections again, publishes go through within a reconnect interval (1 s), not
    aio-pika's 5 s. The broker refuses for 6 s, so that attempts failed meanwhile."""

    async def scenario() -> float:
        connection = await connect_robust(amqp_proxy.url(amqp_url), name="reconnect-interval")
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(exclusive=True, auto_delete=True)
            amqp_proxy.sever()
            await asyncio.sleep(6)
            amqp_proxy.restore()
            return await _published_once_back(channel, queue, b"back", patience=30)
        finally:
            amqp_proxy.restore()
            await connection.close()

    back = asyncio.run(scenario())
    print(f"publishing again {back:.2f} s after the broker came back")
    assert back <= 2.5, f"publishes resumed {back:.1f} s after the broker"


@pytest.mark.timeout(120)
def test_a_gateway_stopped_while_its_first_connection_waits_exits(
    database_url: str, tmp_path: Path
) -> None:
    """Found by a sweep: a gateway stopped (Ctrl-C) while its first broker connection was
    still being made (a node that takes the connection and never speaks, or a start-up cut
    short by a port in use) said "Application shutdown complete" and then lived on, trying
    to reconnect every second, until a second signal: the connection being made was never
    closed. Now it exits."""
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(silent.accept()[0]), daemon=True).start()
    port = silent.getsockname()[1]
    env = gateway_env(database_url, f"amqp://guest:guest@127.0.0.1:{port}/")
    with processes(tmp_path) as procs:
        gateway = GatewayProcess(procs, env, "gateway-silent-broker")
        time.sleep(1.0)  # its first connection is under way, and will not complete
        gateway.proc.signal(signal.SIGINT)
        try:
            code = gateway.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("the gateway lived on after SIGINT:\n" + gateway.proc.tail())
        assert code == 0, gateway.proc.tail()
    silent.close()
    for conn in held:
        conn.close()


@pytest.mark.parametrize("connector", [connect, connect_robust], ids=["plain", "robust"])
def test_a_virtual_host_the_broker_refuses_is_named_with_its_reason(
    amqp_url: str, connector: Any
) -> None:
    """A black-box sweep's finding: a login accepted, then the virtual host refused, read
    "Expected Connection.OpenOk, got <Connection.Close object at 0x…>" in every log and in
    /readyz: that it failed, never why. The broker's code and reason are shown."""
    missing = f"conveyor-missing-{uuid.uuid4().hex[:8]}"

    async def attempt() -> str:
        try:
            await connector(str(URL(amqp_url).with_path(f"/{missing}")), name="vhost-probe")
        except CONNECTION_ERRORS as exc:
            return str(exc)
        raise AssertionError("a missing virtual host was accepted")

    said = asyncio.run(attempt())
    assert "530 NOT_ALLOWED" in said and missing in said, said
