"""Functions that answer what no dispatcher should trust: the task still ends, with the
function's failure, on its first delivery, and nothing else in flight is disturbed."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from pathlib import Path

import pytest

from conveyor.events import EventKind
from tests.dispatcher.conftest import FakeFunction, Launch, Rabbit, eventually, start_function
from tests.support.processes import Processes

pytestmark = pytest.mark.timeout(60)


async def test_a_trickled_answer_is_cut_at_the_task_timeout(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    began = time.monotonic()
    task_id = await rabbit.submit({"hostile": "trickle"}, timeout=3, max_attempts=1)

    done = await rabbit.wait_terminal(task_id, timeout=30)

    assert done.kind is EventKind.FAILED
    # said once, as the docs say it (it read "task timeout: The function did not answer
    # within the task timeout (3 s left).")
    assert done.error_message == "The function did not answer within the task timeout."
    assert time.monotonic() - began < 20  # the trickle alone would take 130 s
    await eventually(lambda: function.calls(task_id, phase="disconnected"), 10, "disconnect")


async def test_deeply_nested_json_is_the_functions_failure_not_a_crash(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"hostile": "deep"})

    done = await rabbit.wait_terminal(task_id)

    assert done.kind is EventKind.FAILED
    assert "could not be parsed" in (done.error_message or "")
    assert len(function.calls(task_id)) == 1  # not requeued, not called again


async def test_an_answer_over_the_cap_fails_its_task_only(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url, max_response_bytes=100_000)
    await dispatcher.wait_ready()
    huge = await rabbit.submit({"hostile": "huge", "size": 5_000_000})
    others = [await rabbit.submit({"sleep": 0.5, "response": {"n": i}}) for i in range(3)]

    done = await rabbit.wait_terminal(huge)

    assert done.kind is EventKind.FAILED
    assert "exceeded 100000 bytes" in (done.error_message or "")
    for i, other in enumerate(others):
        finished = await rabbit.wait_terminal(other)
        assert (finished.kind, finished.response) == (EventKind.SUCCEEDED, {"n": i})


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/<pid>/status")
async def test_an_answer_of_millions_of_objects_fails_its_task_within_the_sidecars_memory(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """8 MiB of `[{},…]`, within MAX_RESPONSE_BYTES: read, 2.8 million dicts, and copied once
    more to check its depth, the sidecar peaked at 620 MB, OOM-killed again and again under
    its container's limit, each time with the tasks beside it, until all were dead-lettered
    (found by a black-box test). Past MAX_RESPONSE_ITEMS the task fails; the rest go on."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    crowded = await rabbit.submit({"hostile": "crowded", "count": 2_796_202})
    others = [await rabbit.submit({"sleep": 0.5, "response": {"n": i}}) for i in range(3)]

    done = await rabbit.wait_terminal(crowded)

    assert done.kind is EventKind.FAILED
    assert done.error_message == "The function's answer holds more than 1000000 JSON items."
    for i, other in enumerate(others):
        finished = await rabbit.wait_terminal(other)
        assert (finished.kind, finished.response) == (EventKind.SUCCEEDED, {"n": i})
    peak = _peak_rss_kib(dispatcher.proc.pid)
    assert peak < 160 * 1024, peak  # idle ~50 MB; the answer's bytes, a few times over
    assert len(function.calls(crowded)) == 1


async def test_nul_bytes_are_replaced_so_the_result_can_be_stored(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    text = await rabbit.submit({"rawResponse": "a\x00b"})
    inside = await rabbit.submit({"response": {"k\x00": ["x\x00y"]}})
    error = await rabbit.submit({"statuses": [400], "error": {"errorMessage": "bad\x00input"}})

    assert (await rabbit.wait_terminal(text)).response == "a\ufffdb"
    assert (await rabbit.wait_terminal(inside)).response == {"k\ufffd": ["x\ufffdy"]}
    assert (await rabbit.wait_terminal(error)).error_message == "bad\ufffdinput"


async def test_lone_surrogates_are_replaced_so_the_result_can_be_stored(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """Half a UTF-16 pair, escaped in JSON, is refused by jsonb as NUL is: found by a sweep,
    the task ended FAILURE with PostgreSQL's error quoting the answer."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    value = await rabbit.submit({"rawResponse": '{"r": "a \\ud800 b", "\\udc00": 1}'})
    pair = await rabbit.submit({"rawResponse": '["\\ud83d\\ude00"]'})
    error = await rabbit.submit({"statuses": [400], "error": '{"error": "bad\\udbff"}'})

    assert (await rabbit.wait_terminal(value)).response == {"r": "a \ufffd b", "\ufffd": 1}
    assert (await rabbit.wait_terminal(pair)).response == ["\U0001f600"]
    assert (await rabbit.wait_terminal(error)).error_message == "bad\ufffd"


async def test_a_number_beyond_a_double_is_kept_as_text_not_sent_as_infinity(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """`1e400` is no JSON this platform can carry (it would be read as infinity, and the event
    holding it could not be read back): the answer is kept as the function's text, like any
    answer that is not JSON, and the task ends with it."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"rawResponse": '{"x": 1e400}'})

    done = await rabbit.wait_terminal(task_id)

    assert (done.kind, done.response) == (EventKind.SUCCEEDED, '{"x": 1e400}')


async def test_a_header_with_a_line_break_is_refused_not_sent_nor_retried(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """A message put on `-in` by hand with a CR LF in its ce-source (forwarded to the
    function as is): the call cannot be sent as is, so the task fails at once, and no header
    is smuggled to the function. (Its ce-type was the vector; a type other than a
    submission's is poison now.)"""
    import uuid

    from conveyor.events import Submission, encode_submission

    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = str(uuid.uuid4())
    wire = encode_submission(Submission(task_id=task_id, service=rabbit.queue, body={}))
    headers = {**wire.headers, "ce-source": "/v1/services/x\r\nX-Smuggled: 1"}
    await rabbit.publish_raw(wire.body, headers, wire.message_id)

    done = await rabbit.wait_terminal(task_id)

    assert done.kind is EventKind.FAILED
    assert "could not be sent to the function" in (done.error_message or "")
    assert function.calls(task_id) == []
    assert await rabbit.depth(rabbit.in_q) == 0  # acked, not handed back for another try


async def test_a_function_restarting_under_a_running_dispatcher_fails_no_task(
    rabbit: Rabbit, function: FakeFunction, launch: Launch, procs: Processes, tmp_path: Path
) -> None:
    """SPEC §7: a function that is still starting must not turn tasks into failures; a
    sidecar restarted after a crash is one (its calls were refused, 3 tasks failed in 3 s)."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    procs.stop(function.proc)  # the container crashed: its port refuses connections
    tasks = [await rabbit.submit({"sleep": 0.1}, timeout=30, max_attempts=2) for _ in range(3)]
    await asyncio.sleep(3)
    assert all(rabbit.terminal(task_id) is None for task_id in tasks)
    again = start_function(procs, tmp_path, name="function-restarted", port=function.port)

    for task_id in tasks:
        assert (await rabbit.wait_terminal(task_id, timeout=20)).kind is EventKind.SUCCEEDED
        assert len(again.calls(task_id)) == 1


async def test_a_stray_second_answer_is_never_taken_for_the_next_tasks(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """A function that writes a second answer on its idle keep-alive connection: the next
    task sent on that connection ended SUCCESS with the stray answer (aiohttp reused the
    pooled connection with the answer already buffered, aio-libs/aiohttp#13656)."""
    dispatcher = launch(function.url, concurrency=1)
    await dispatcher.wait_ready()
    first = await rabbit.submit({"hostile": "twice"})
    assert (await rabbit.wait_terminal(first)).response == {"answered": first}
    # The stray answer is on the wire before the next task is even submitted.
    await eventually(lambda: function.calls(first, phase="stray"), 10, "the stray answer")

    second = await rabbit.submit({"response": {"real": "answer"}})
    done = await rabbit.wait_terminal(second)

    assert (done.kind, done.response) == (EventKind.SUCCEEDED, {"real": "answer"})
    assert len(function.calls(second)) == 1


async def test_a_retry_after_in_non_ascii_digits_is_ignored_and_the_503_kept(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """`Retry-After: ①` passed `isdigit()` and broke float(): the worker's unexpected error
    requeued the task until the broker dead-lettered it, its real cause lost."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"statuses": [503], "retryAfter": "\u2460"}, max_attempts=2)

    done = await rabbit.wait_terminal(task_id)

    assert done.kind is EventKind.FAILED
    assert (done.error_message or "").startswith("HTTP 503")
    assert len(function.calls(task_id)) == 2


async def test_an_answer_that_is_not_http_says_so_without_a_status_or_the_url(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """aiohttp's text for a parse error reads `400, message="Bad status line: …",
    url='http://127.0.0.1:…/'`: like a 400 from the function, and with its inner URL."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"hostile": "garbage"}, max_attempts=1)

    done = await rabbit.wait_terminal(task_id)

    assert done.kind is EventKind.FAILED
    message = done.error_message or ""
    assert message.startswith("The function's answer was not valid HTTP: Bad status line"), message
    assert "url=" not in message and str(function.port) not in message
    assert "400" not in message


async def test_an_answer_cut_in_its_headers_is_said_in_words(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """Found by a black-box test: the connection closed inside the answer's headers, and the
    task's error was the repr of aiohttp's half-parsed message (`<RawResponseMessage(...)>`,
    with the function's headers in it)."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"hostile": "cut-headers"}, max_attempts=2)

    done = await rabbit.wait_terminal(task_id)

    assert done.kind is EventKind.FAILED
    message = done.error_message or ""
    assert message == (
        "The function's answer was not valid HTTP: the connection closed before its headers ended"
    ), message
    assert len(function.calls(task_id)) == 2  # retried, as a connection cut is


@pytest.mark.parametrize(("status", "calls"), [(400, 1), (422, 1), (503, 2)])
async def test_a_refusal_whose_body_cannot_be_decoded_is_still_final(
    rabbit: Rabbit, function: FakeFunction, launch: Launch, status: int, calls: int
) -> None:
    """Found by a black-box test: a 400 whose body said `Content-Encoding: gzip` and was not
    gzip read as an answer that is not HTTP, and was retried: the function ran again for a
    refusal it had already given, and the task's error lost the status."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"hostile": "bad-gzip", "status": status}, max_attempts=2)

    done = await rabbit.wait_terminal(task_id)

    assert done.kind is EventKind.FAILED
    message = done.error_message or ""
    assert message.startswith(f"HTTP {status}"), message
    assert "gzip" in message, message
    assert len(function.calls(task_id)) == calls  # a 5xx is retried, a refusal is not


async def test_a_redirect_whose_location_is_not_utf8_fails_its_task_once(
    rabbit: Rabbit, function: FakeFunction, launch: Launch
) -> None:
    """Found by a black-box test: a 302 whose Location held Latin-1 bytes reached the error
    message as lone surrogates, which its truncation could not encode: every delivery ended
    in an unexpected error and went straight back, the function called ~24 times in 0.1 s
    until the broker dead-lettered it, its cause lost. Header text is made storable now."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    task_id = await rabbit.submit({"hostile": "latin1-location"})

    done = await rabbit.wait_terminal(task_id)

    assert done.kind is EventKind.FAILED
    message = done.error_message or ""
    assert message.startswith("HTTP 302 (redirects are not followed; Location: http://x/caf"), (
        message
    )
    assert "\ufffd" in message
    assert len(function.calls(task_id)) == 1
    assert "Traceback" not in dispatcher.proc.logs()


async def test_a_requeue_while_the_function_could_not_be_reached_spends_no_delivery(
    rabbit: Rabbit, function: FakeFunction, launch: Launch, procs: Processes, tmp_path: Path
) -> None:
    """A SIGTERM while every call was refused counted a delivery: the function's first real
    call said X-Conveyor-Attempt 2 (docs: a connection refused is not an attempt). Found by a
    black-box test."""
    dispatcher = launch(function.url)
    await dispatcher.wait_ready()
    procs.stop(function.proc)
    task_id = await rabbit.submit({}, timeout=60)
    await asyncio.sleep(2)  # refused, and refused again
    dispatcher.signal(signal.SIGTERM)
    assert await dispatcher.exit_code(10) == 0

    again = start_function(procs, tmp_path, name="function-restarted", port=function.port)
    launch(again.url)
    assert (await rabbit.wait_terminal(task_id, timeout=20)).kind is EventKind.SUCCEEDED
    assert [c["headers"]["x-conveyor-attempt"] for c in again.calls(task_id)] == ["1"]


class _ClosesIdleConnections:
    """A function that answers each call, then closes its connection after 0 to 6 ms unless
    another call came meanwhile (a server's keep-alive timeout, a graceful restart): a call
    sent on a connection as it closes is never read. Records the task ids it read."""

    def __init__(self) -> None:
        self.read: set[str] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length: *(\d+)", head)
                await reader.readexactly(int(length[1]) if length else 0)
                task = re.search(rb"(?im)^ce-id: *([^\r]+)", head)
                self.read.add(task[1].decode() if task else "")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
                await asyncio.sleep(random.uniform(0, 0.006))
                if not reader._buffer:  # nothing came meanwhile: close the idle connection
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_call_the_function_closed_an_idle_connection_under_is_made_again(
    rabbit: Rabbit, launch: Launch
) -> None:
    """Found by a black-box sweep: a function that closes idle keep-alive connections
    (gunicorn after 2 s, any server on a graceful restart) failed tasks it never read, the
    call sent on a connection as it closed ("Server disconnected", "Can not write request
    body"): 32 of 200 with `maxAttempts` 1. A call that fails so on a reused connection is
    made again on another, not counted as an attempt."""
    function = _ClosesIdleConnections()
    url = await function.start()
    dispatcher = launch(url, concurrency=1, prefetch_buffer=4)
    await dispatcher.wait_ready()
    tasks = [await rabbit.submit({"n": n}, max_attempts=1) for n in range(200)]
    ends = [await rabbit.wait_terminal(task, timeout=60) for task in tasks]
    failed = [
        (end.task_id, end.error_message) for end in ends if end.kind is not EventKind.SUCCEEDED
    ]
    assert failed == [], (len(failed), failed[:3], len(function.read & {t for t, _ in failed}))
    assert function.server is not None
    function.server.close()
