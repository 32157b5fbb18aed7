"""Progress in knative mode (SPEC §11.5): the function runs in another pod and reports to the
dispatcher's pod IP on PROGRESS_PORT, with an unguessable token per attempt in the URL."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from conveyor.events import EventKind
from tests.dispatcher.conftest import FakeFunction, Launch, Rabbit, eventually
from tests.support.processes import free_port

pytestmark = pytest.mark.timeout(60)


def _post(url: str, value: float = 42.0) -> int:
    return httpx.post(url, json={"progress": value}, timeout=5).status_code


def _get(url: str) -> int:
    return httpx.get(url, timeout=5).status_code


async def test_the_function_reports_progress_on_the_pod_ip_with_its_token(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    port = free_port()
    dispatcher = launch(function.url, progress_port=port, pod_ip="127.0.0.1")
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"progress": [10, 50], "progressPause": 0.1})
    done = await rabbit.wait_terminal(task_id)
    assert done.kind is EventKind.SUCCEEDED
    [call] = function.calls(task_id)
    url = call["headers"]["x-conveyor-progress-url"]
    prefix = f"http://127.0.0.1:{port}/tasks/{task_id}/progress/"
    assert url.startswith(prefix) and len(url) - len(prefix) >= 40  # the token
    [end] = function.calls(task_id, "end")
    assert end["progress"] == [204, 204]
    progress = [e.progress for e in rabbit.of(task_id) if e.kind is EventKind.PROGRESS]
    assert progress and progress[-1] == 50
    # The attempt is over: its token is refused now.
    assert _post(url) == 403
    # The pod-IP port serves the progress route alone.
    assert _get(f"http://127.0.0.1:{port}/metrics") == 404


async def test_the_progress_port_listens_on_the_pod_ip_alone(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """Found by a sweep: PROGRESS_PORT listened on every address (`*:PORT`), where SPEC §11.5
    serves it on the pod IP. Now only POD_IP:PROGRESS_PORT answers."""
    port = free_port()
    dispatcher = launch(function.url, progress_port=port, pod_ip="127.0.0.2")
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"progress": [10, 50], "progressPause": 0.1})
    assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED
    [end] = function.calls(task_id, "end")
    assert end["progress"] == [204, 204]  # reported to 127.0.0.2
    with pytest.raises(httpx.ConnectError):
        _get(f"http://127.0.0.1:{port}/tasks/{task_id}/progress/x")


async def test_wrong_other_and_expired_tokens_are_refused(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    port = free_port()
    dispatcher = launch(function.url, progress_port=port, pod_ip="127.0.0.1")
    await dispatcher.wait_ready()
    first = await rabbit.submit({"sleep": 3})
    second = await rabbit.submit({"sleep": 3})
    await eventually(
        lambda: function.calls(first) and function.calls(second), 10, "both calls started"
    )
    url_of = {
        t: function.calls(t)[0]["headers"]["x-conveyor-progress-url"] for t in (first, second)
    }
    token_of = {t: url.rsplit("/", 1)[1] for t, url in url_of.items()}
    base = f"http://127.0.0.1:{port}/tasks"
    assert _post(url_of[first], 30) == 204  # the right one
    assert _post(f"{base}/{first}/progress/{token_of[second]}") == 403  # another task's
    assert _post(f"{base}/{first}/progress/{'x' * 43}") == 403  # made up
    assert _post(f"{base}/not-a-task/progress/{token_of[first]}") == 403
    for task_id in (first, second):
        assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED
    assert _post(url_of[second], 90) == 403  # expired with its attempt
    progress = [e.progress for e in rabbit.of(first) if e.kind is EventKind.PROGRESS]
    assert progress == [30]
    assert not [e for e in rabbit.of(second) if e.kind is EventKind.PROGRESS]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) here")


@needs_ipv6
async def test_an_ipv6_pod_ip_is_bracketed_in_the_progress_url(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """Found by a sweep: with POD_IP=::1 the function was given `http://::1:<port>/…`, which no
    client can parse. Now the address is bracketed, as URLs write IPv6 literals."""
    port = free_port()
    dispatcher = launch(function.url, progress_port=port, pod_ip="::1")
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({})
    assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED
    [call] = function.calls(task_id)
    url = call["headers"]["x-conveyor-progress-url"]
    assert url.startswith(f"http://[::1]:{port}/tasks/{task_id}/progress/"), url


@needs_ipv6
async def test_progress_reaches_a_dispatcher_whose_pod_ip_is_ipv6(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """Found by a sweep: with an IPv6 POD_IP the progress port listened on 0.0.0.0 only, and
    every report was refused. Now it listens on the family POD_IP needs."""
    port = free_port()
    dispatcher = launch(function.url, progress_port=port, pod_ip="::1")
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"progress": [10, 50], "progressPause": 0.1})
    assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED
    [end] = function.calls(task_id, "end")
    assert end["progress"] == [204, 204]
    progress = [e.progress for e in rabbit.of(task_id) if e.kind is EventKind.PROGRESS]
    assert progress and progress[-1] == 50


async def test_a_body_that_does_not_decode_is_no_traceback(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """Found by a black-box test: a body that does not match its Content-Encoding, sent with a
    wrong token (anyone who reaches the pod IP) or for an unknown task, was answered right,
    403 or 404, but aiohttp then read the rest of the body to keep the connection, failed to
    decode it and logged an ERROR with a traceback: one per request, a log flooded at will.
    The refusal now closes the connection instead."""
    port = free_port()
    dispatcher = launch(function.url, progress_port=port, pod_ip="127.0.0.1")
    await dispatcher.wait_ready()
    garbage = b"\x00not deflate\xff" * 64
    zeros = f"{'0' * 8}-0000-0000-0000-{'0' * 12}"
    answered = 0
    async with httpx.AsyncClient(timeout=5) as http:
        for url, status in (
            (f"http://127.0.0.1:{port}/tasks/{zeros}/progress/x", 403),
            (f"{dispatcher.base}/tasks/{zeros}/progress", 404),
        ):
            for encoding in ("deflate", "gzip"):
                try:
                    answer = await http.post(
                        url,
                        content=garbage,
                        headers={"Content-Encoding": encoding, "Content-Type": "application/json"},
                    )
                except (httpx.RemoteProtocolError, httpx.ReadError):
                    # The refusal closes the connection with the body unread: the kernel may
                    # reset it before the client reads the answer (seen once in 15 runs).
                    continue
                assert answer.status_code == status, answer.text
                answered += 1
    assert answered  # not every refusal lost to a reset
    task_id = await rabbit.submit({})
    assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED  # still serves
    log = dispatcher.proc.logs()
    assert "Traceback" not in log and "Unhandled exception" not in log, log[-2000:]


def _closed_within(connection: socket.socket, seconds: float) -> bool:
    """Whether the server closed `connection` within `seconds` (an answer may come first)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        connection.settimeout(left)
        try:
            if connection.recv(4096) == b"":
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    return False


def _trickle(connection: socket.socket, data: bytes, stop: threading.Event) -> None:
    for byte in data:
        if stop.wait(0.2):
            return
        try:
            connection.sendall(bytes([byte]))
        except OSError:
            return


async def test_a_request_that_does_not_arrive_in_time_loses_its_connection(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """A caller that connects and sends nothing, trickles its head, or stops mid-body held its
    connection (and a descriptor) for an hour on every port, the pod-IP ones included: a known
    gap, closed. Each now loses it after REQUEST_READ_TIMEOUT; honest reports still land."""
    port, probes = free_port(), free_port()
    dispatcher = launch(
        function.url,
        progress_port=port,
        pod_ip="127.0.0.1",
        metrics_port=probes,
        request_read_timeout=1,
    )
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"sleep": 8})
    await eventually(lambda: function.calls(task_id), 10, "the call started")
    remote = urlsplit(function.calls(task_id)[0]["headers"]["x-conveyor-progress-url"]).path
    local = f"/tasks/{task_id}/progress"
    stop = threading.Event()
    hostile: dict[str, socket.socket] = {}
    try:
        for target in (port, dispatcher.port, probes):
            hostile[f"silent:{target}"] = socket.create_connection(("127.0.0.1", target))
            trickler = socket.create_connection(("127.0.0.1", target))
            head = f"POST {remote} HTTP/1.1\r\nHost: x\r\nX-Padding: {'a' * 200}\r\n"
            threading.Thread(
                target=_trickle, args=(trickler, head.encode(), stop), daemon=True
            ).start()
            hostile[f"head:{target}"] = trickler
        for target, path in ((port, remote), (dispatcher.port, local)):
            body_left = socket.create_connection(("127.0.0.1", target))
            body_left.sendall(
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f'Content-Length: 20\r\n\r\n{{"progr'.encode()
            )
            hostile[f"body:{target}"] = body_left
        kept = [name for name, c in hostile.items() if not _closed_within(c, 6)]
        assert kept == [], f"still open after 6 s: {kept}"
        assert _post(f"http://127.0.0.1:{port}{remote}", 40) == 204
        assert _post(f"{dispatcher.base}{local}", 60) == 204
    finally:
        stop.set()
        for connection in hostile.values():
            connection.close()
    assert (await rabbit.wait_terminal(task_id)).kind is EventKind.SUCCEEDED
    progress = [e.progress for e in rabbit.of(task_id) if e.kind is EventKind.PROGRESS]
    assert progress and progress[-1] == 60
    log = dispatcher.proc.logs()
    assert "Traceback" not in log, log[-2000:]
