"""Broker outages, bad input and the local API: the dispatcher keeps going."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from conveyor.events import EventKind, MessageFormat
from conveyor.topology import declare_service
from tests.dispatcher.conftest import FakeFunction, Launch, Rabbit, eventually, start_function
from tests.support.processes import free_port
from tests.support.tcpproxy import TcpProxy

pytestmark = pytest.mark.timeout(90)


async def test_broker_outage_loses_nothing_and_acks_nothing_twice(
    rabbit: Rabbit, function: FakeFunction, launch: Launch, amqp_url: str
) -> None:
    url = urlsplit(amqp_url)
    proxy = TcpProxy(url.hostname or "127.0.0.1", url.port or 5672)
    try:
        proxied = url._replace(netloc=f"{url.username}:{url.password}@127.0.0.1:{proxy.port}")
        dispatcher = launch(function.url, amqp=proxied.geturl(), concurrency=10)
        await dispatcher.wait_ready()
        tasks = [await rabbit.submit({"sleep": 0.3}) for _ in range(50)]
        await eventually(lambda: len(function.entries()) >= 10, 10, "calls under way")

        proxy.sever()
        await asyncio.sleep(3)
        assert dispatcher.proc.alive()
        proxy.restore()

        for task_id in tasks:
            await rabbit.wait_terminal(task_id, timeout=40)
        assert {rabbit.terminal(t).kind for t in tasks} == {EventKind.SUCCEEDED}  # type: ignore[union-attr]
        assert dispatcher.proc.alive()
        async with httpx.AsyncClient() as client:
            await eventually(
                lambda: _status(client, f"{dispatcher.base}/readyz", 200), 15, "ready again"
            )
        dispatcher.signal(signal.SIGTERM)
        assert await dispatcher.exit_code(10) == 0
    finally:
        proxy.close()
    assert await rabbit.depth(rabbit.in_q) == 0
    logs = dispatcher.proc.logs()
    assert "PRECONDITION_FAILED" not in logs and "unknown delivery tag" not in logs
    ours = [r for r in dispatcher.log_records() if r.get("logger", "").startswith("dispatcher")]
    assert not [r for r in ours if r.get("level") == "error" or "exception" in r]
    # Results confirmed before the cut are not computed again after it.
    assert sum(len(function.calls(t)) for t in tasks) == 50


async def test_a_cancel_broadcast_during_an_outage_is_read_from_the_log(
    rabbit: Rabbit, function: FakeFunction, launch: Launch, amqp_url: str
) -> None:
    """The exclusive cancel queue goes with the connection: what was broadcast until the
    next one was bound, the dispatcher reads from the service's cancel log."""
    url = urlsplit(amqp_url)
    proxy = TcpProxy(url.hostname or "127.0.0.1", url.port or 5672)
    try:
        proxied = url._replace(netloc=f"{url.username}:{url.password}@127.0.0.1:{proxy.port}")
        dispatcher = launch(function.url, amqp=proxied.geturl())
        await dispatcher.wait_ready()
        proxy.sever()
        await asyncio.sleep(1)
        cancelled = await rabbit.submit({"sleep": 0.1})
        await rabbit.cancel(cancelled)  # no queue of the dispatcher's is there to hear it
        wanted = await rabbit.submit({"sleep": 0.1})
        proxy.restore()

        assert (await rabbit.wait_terminal(wanted, timeout=30)).kind is EventKind.SUCCEEDED
        await eventually(lambda: _depth_is(rabbit, rabbit.in_q, 0), 15, "-in acked")
        assert function.calls(cancelled) == [] and rabbit.of(cancelled) == []
    finally:
        proxy.close()


async def _depth_is(rabbit: Rabbit, queue: str, depth: int) -> bool:
    return await rabbit.depth(queue) == depth


async def _status(client: httpx.AsyncClient, url: str, expected: int) -> bool:
    try:
        return (await client.get(url, timeout=2)).status_code == expected
    except httpx.HTTPError:
        return False


async def test_bad_input_never_stops_the_dispatcher(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    secret = b"SECRET-BODY-" + uuid.uuid4().hex.encode()
    await rabbit.publish_raw(secret + b" not json")
    await rabbit.publish_raw(b'{"taskId": 42, "data": {"messageType": "submission", "body": {}}}')
    await rabbit.publish_raw(
        b'{"a": 1}', {"ce-specversion": "1.0", "ce-id": "x"}
    )  # missing attributes
    await rabbit.publish_raw(b"[" * 16 * 1024 * 1024)  # 16 MiB, not JSON
    await eventually(lambda: _depth_is(rabbit, rabbit.dlq, 4), 20, "4 dead letters", step=0.2)

    task_id = await rabbit.submit({"sleep": 1})
    await function.wait_calls(task_id)
    progress_url = f"{dispatcher.base}/tasks/{task_id}/progress"
    async with httpx.AsyncClient() as client:
        unknown = await client.post(
            f"{dispatcher.base}/tasks/{uuid.uuid4()}/progress", json={"progress": 5}
        )
        assert unknown.status_code == 404 and unknown.json()["status"] == "error"
        garbage_id = await client.post(
            f"{dispatcher.base}/tasks/nope/progress", json={"progress": 5}
        )
        assert garbage_id.status_code == 404
        for bad in (
            {"progress": "abc"},
            {"progress": True},
            {},
            [1],
        ):
            answer = await client.post(progress_url, json=bad)
            assert answer.status_code in (400, 422), bad
            assert answer.json()["status"] == "error"
        not_json = await client.post(
            progress_url, content=b"{nope", headers={"content-type": "application/json"}
        )
        assert not_json.status_code in (400, 422)
        nan = await client.post(progress_url, content=b'{"progress": NaN}')
        assert nan.status_code in (400, 422)
        assert (await client.post(progress_url, json={"progress": 42})).status_code == 204

        assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED
        assert dispatcher.proc.alive()
        after = await client.post(progress_url, json={"progress": 50})
        assert after.status_code == 404  # never after the terminal event
        metrics = (await client.get(f"{dispatcher.base}/metrics")).text
    progress = [e.progress for e in rabbit.of(task_id) if e.kind is EventKind.PROGRESS]
    assert progress == [42.0]
    assert rabbit.kinds(task_id)[-1] is EventKind.SUCCEEDED
    assert "conveyor_dispatcher_poison_messages_total 4.0" in metrics
    assert "conveyor_dispatcher_tasks_succeeded_total 1.0" in metrics
    assert "conveyor_dispatcher_function_call_seconds_bucket" in metrics

    dispatcher.signal()
    assert await dispatcher.exit_code(10) == 0
    assert secret.decode() not in dispatcher.proc.logs()  # bodies are never logged


async def _depth_is(rabbit: Rabbit, queue: str, count: int) -> bool:
    return await rabbit.depth(queue) == count


async def test_local_api_listens_on_loopback_only(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    listening = _listening_addresses(dispatcher.port)
    assert listening == {"127.0.0.1"}, listening
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{dispatcher.base}/healthz")).status_code == 200
        ready = await client.get(f"{dispatcher.base}/readyz")
        assert ready.status_code == 200 and all(ready.json()["data"]["checks"].values())
        dispatcher.signal()
        assert await dispatcher.exit_code(10) == 0


async def test_metrics_port_serves_probes_but_not_progress(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    metrics_port = free_port()
    dispatcher = launch(function.url, metrics_port=metrics_port)
    await dispatcher.wait_ready()
    # every address of the pod: IPv6 and IPv4 on one socket, where the kernel has both
    every = "::" if socket.has_dualstack_ipv6() else "0.0.0.0"
    assert _listening_addresses(metrics_port) == {every}
    async with httpx.AsyncClient() as client:
        base = f"http://127.0.0.1:{metrics_port}"
        assert (await client.get(f"{base}/readyz")).status_code == 200
        assert (
            "conveyor_dispatcher_tasks_received_total" in (await client.get(f"{base}/metrics")).text
        )
        progress = await client.post(f"{base}/tasks/{uuid.uuid4()}/progress", json={"progress": 1})
        assert progress.status_code in (404, 405)


async def test_not_ready_until_the_function_answers(
    rabbit: Rabbit,
    procs,
    tmp_path: Path,
    launch: Launch,  # type: ignore[no-untyped-def]
) -> None:
    port = free_port()
    dispatcher = launch(f"http://127.0.0.1:{port}/")
    async with httpx.AsyncClient() as client:
        await eventually(
            lambda: _status(client, f"{dispatcher.base}/readyz", 503), 10, "a 503 from /readyz"
        )
        checks = (await client.get(f"{dispatcher.base}/readyz")).json()["data"]["checks"]
        assert checks["function"] is False
        assert (await client.get(f"{dispatcher.base}/healthz")).status_code == 200
        start_function(procs, tmp_path, port=port)
        await dispatcher.wait_ready()


async def test_exits_1_when_the_function_never_comes(rabbit: Rabbit, launch: Launch) -> None:
    dispatcher = launch(f"http://127.0.0.1:{free_port()}/", function_wait_timeout=1)
    assert await dispatcher.exit_code(10) == 1
    assert "function not reachable" in dispatcher.proc.logs()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the LISTEN sockets on `port`, from /proc/net/tcp{,6}."""
    found: set[str] = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            address, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:
                continue
            found.add(_decode_address(address, v6))
    if not found:
        pytest.skip("/proc/net/tcp unavailable")
    return found


def _decode_address(hex_address: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_address)
    if not v6:
        return ".".join(str(b) for b in reversed(raw))
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
    import ipaddress

    return str(ipaddress.IPv6Address(b"".join(words)))


def test_decode_proc_net_addresses() -> None:
    assert _decode_address("0100007F", False) == "127.0.0.1"
    assert _decode_address("00000000", False) == "0.0.0.0"
    assert json.dumps(_decode_address("00000000000000000000000000000000", True)) == '"::"'


async def test_sigterm_while_waiting_for_the_function_exits_0(
    rabbit: Rabbit, launch: Launch
) -> None:
    dispatcher = launch(f"http://127.0.0.1:{free_port()}/")
    async with httpx.AsyncClient() as client:
        await eventually(lambda: _status(client, f"{dispatcher.base}/readyz", 503), 10, "a 503")
    dispatcher.signal(signal.SIGTERM)
    assert await dispatcher.exit_code(5) == 0


async def test_waits_for_the_gateway_to_declare_the_queues(
    amqp_url: str, queue_name: str, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    async with httpx.AsyncClient() as client:
        await eventually(lambda: _status(client, f"{dispatcher.base}/readyz", 503), 10, "a 503")
        await asyncio.sleep(1.5)  # a few passive declarations fail meanwhile
        assert dispatcher.proc.alive()
    rabbit = Rabbit(amqp_url, queue_name, MessageFormat.CLOUDEVENTS)
    await rabbit.open(delivery_limit=3)  # what the gateway does when a service is applied
    try:
        await dispatcher.wait_ready()
        task_id = await rabbit.submit({})
        assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED
    finally:
        dispatcher.signal()
        await dispatcher.exit_code(10)
        await rabbit.close()


async def test_an_absurd_timeout_is_dead_lettered_and_frees_its_slot(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """Found by a sweep: a submission whose `conveyortimeout` was 1e300 overflowed after taking
    its slot, which leaked, and with CONCURRENCY=1 nothing ran again. Now it is dead-lettered
    as poison and the next task runs."""
    dispatcher = launch(function.url, concurrency=1)
    await dispatcher.wait_ready()
    await rabbit.submit({}, timeout=1e300)
    task_id = await rabbit.submit({})
    assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED
    await eventually(lambda: _depth_is(rabbit, rabbit.dlq, 1), 10, "the bad one dead-lettered")
    # The longest taskTimeout a service can have (a PostgreSQL integer) still runs.
    longest = await rabbit.submit({}, timeout=2**31 - 1)
    assert (await rabbit.wait_terminal(longest)).kind is EventKind.SUCCEEDED


@pytest.mark.parametrize(
    ("variable", "env"),
    [
        ("FUNCTION_URL", {"function_url": "ftp://127.0.0.1:8080/"}),
        ("IDLE_EXIT_SECONDS", {"one_shot": 1, "idle_exit_seconds": "nan"}),
        ("CANCEL_MEMORY_SECONDS", {"cancel_memory_seconds": "1e300"}),
        ("DISPATCHER_PORT", {"dispatcher_port": 70000}),
    ],
)
async def test_a_setting_it_cannot_run_with_exits_1_with_one_line(
    variable: str, env: dict[str, object], function: FakeFunction, launch: Launch
) -> None:
    """Found by a sweep: such settings passed start-up (or died in a traceback) and failed
    later. Now the process exits 1 at once, with one line naming the variable."""
    settings = dict(env)
    dispatcher = launch(str(settings.pop("function_url", function.url)), **settings)
    assert await dispatcher.exit_code(15) == 1
    output = [line for line in dispatcher.proc.logs().splitlines() if line.strip()]
    assert len(output) == 1 and variable in output[0] and "Traceback" not in output[0], output


async def test_the_wait_for_the_function_names_its_host_and_port(launch: Launch) -> None:
    """Found by a sweep: "waiting for the function" did not say where it looked. Now the log
    names the host and port it connects to."""
    port = free_port()
    dispatcher = launch(f"http://127.0.0.1:{port}/", function_wait_timeout=1)
    assert await dispatcher.exit_code(15) == 1
    [waiting] = [r for r in dispatcher.log_records() if r["message"] == "waiting for the function"]
    assert (waiting["host"], waiting["port"]) == ("127.0.0.1", port), waiting


async def test_not_ready_while_the_broker_has_cancelled_its_consumer(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """An operator deletes `-in` (or a node loses it): the broker cancels the consumer, and the
    dispatcher, connected but taking nothing, said "ready" (a known gap). It is not ready until
    it consumes again, which it does as soon as the queue is back."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    assert rabbit.channel is not None
    await rabbit.channel.queue_delete(rabbit.in_q)
    async with httpx.AsyncClient(timeout=5) as client:
        await eventually(
            lambda: _status(client, f"{dispatcher.base}/readyz", 503), 10, "a 503 from /readyz"
        )
        checks = (await client.get(f"{dispatcher.base}/readyz")).json()["data"]["checks"]
        assert checks == {"broker": False, "function": True, "accepting": True}
        await declare_service(rabbit.channel, rabbit.queue, rabbit.fmt, 5)
        await eventually(
            lambda: _status(client, f"{dispatcher.base}/readyz", 200), 20, "ready again"
        )
    task_id = await rabbit.submit({})
    assert (await rabbit.wait_terminal(task_id, timeout=20)).kind is EventKind.SUCCEEDED


async def test_a_call_a_dead_dispatcher_left_running_reports_to_no_later_attempt(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """Found by a black-box test: a dispatcher SIGKILLed (an OOM) while its function kept
    running the call; the next dispatcher on the same port took the redelivery, and the old
    call's reports (9, 10, 11) became the new attempt's progress, whose own lower reports
    were then dropped as going backwards. Each attempt's progress URL is now its own."""
    first = launch(function.url, concurrency=1)
    await first.wait_ready()
    task_id = await rabbit.submit({"sleep": 20})
    (call,) = await function.wait_calls(task_id)
    stale_url = call["headers"]["x-conveyor-progress-url"]

    first.signal(signal.SIGKILL)
    assert await first.exit_code(10) == -signal.SIGKILL
    second = launch(function.url, concurrency=1, dispatcher_port=first.port)
    await eventually(lambda: len(function.calls(task_id)) >= 2, 30, "the redelivery's call")
    fresh_url = function.calls(task_id)[1]["headers"]["x-conveyor-progress-url"]
    assert fresh_url != stale_url

    async with httpx.AsyncClient() as client:
        stale = await client.post(stale_url, json={"progress": 90})
        assert stale.status_code == 404, stale.text
        assert stale.json()["error"]["number"] == 404002, stale.text
        assert (await client.post(fresh_url, json={"progress": 20})).status_code == 204
    await eventually(
        lambda: any(e.progress == 20 for e in rabbit.of(task_id)), 10, "the attempt's progress"
    )
    assert all(e.progress != 90 for e in rabbit.of(task_id))
    second.signal(signal.SIGKILL)
