"""The SDK's clients across what a program does around them: a fork (a preload-style parent),
a second event loop, more follows than a connection pool holds, a gateway URL with a password
or without a scheme, a SOCKS proxy in the environment; and the CLI writing JSON to a stdout
that is not UTF-8. Against a real local HTTP server (tests/unit/test_client_following)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import sys
import threading
import uuid
from typing import Any

import httpx
import pytest
from rich.console import Console

from conveyor.cli import task as task_cli
from conveyor.client import AsyncConveyorClient, ConveyorClient
from tests.unit import test_client_following as following
from tests.unit import test_client_hostile_gateway as hostile
from tests.unit.test_client_following import PENDING, SUCCESS, TASK_ID, Handler, event

serve = following.serve  # the fixture: serve(script) starts a Gateway


def task_of(marker: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, marker))


def submitted_as_marked(h: Handler) -> None:
    """A submission answered with the task id its body's `marker` names: an answer read by
    another submission's caller shows as a task id that is not its own."""
    body = json.loads(h.rfile.read(int(h.headers["Content-Length"])))
    data = {"taskId": task_of(body["body"]["marker"]), "taskPosition": 1}
    h.envelope(201, {"status": "success", "data": data})


@pytest.mark.skipif(sys.platform == "win32", reason="os.fork")
def test_a_client_crossing_a_fork_answers_each_process_its_own_submissions(serve: Any) -> None:
    """The parent's pooled keep-alive connection is inherited by every child: sent on by all,
    the answers crossed (a submission was told another's task id, or a request was garbled).
    A child now opens connections of its own."""
    gateway = serve(submitted_as_marked)
    client = ConveyorClient(gateway.url, "u", "p")
    assert client.submit("svc", {"marker": "parent"}).task_id == task_of("parent")
    children = []
    for child in range(4):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports by its exit status
            wrong = 0
            try:
                for n in range(40):
                    marker = f"{child}-{n}"
                    wrong += client.submit("svc", {"marker": marker}).task_id != task_of(marker)
            except BaseException:
                os._exit(2)
            os._exit(1 if wrong else 0)
        children.append(pid)
    statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    assert statuses == [0, 0, 0, 0], "1: an answer for another submission, 2: an error"
    assert client.submit("svc", {"marker": "after"}).task_id == task_of("after")
    client.close()


def test_an_async_client_serves_a_second_event_loop(serve: Any) -> None:
    """A client made at import time, used by one `asyncio.run` after another: its pooled
    connection belonged to the first loop, closed by then, and the second loop's first call
    sent its request then raised `RuntimeError: Event loop is closed` (the task stored all
    the same); `aclose()` raised it too."""
    gateway = serve(submitted_as_marked)
    client = AsyncConveyorClient(gateway.url, "u", "p")

    async def submit(marker: str) -> str:
        return (await client.submit("svc", {"marker": marker})).task_id

    assert asyncio.run(submit("first")) == task_of("first")
    assert asyncio.run(submit("second")) == task_of("second")
    assert asyncio.run(submit("third")) == task_of("third")
    asyncio.run(client.aclose())


def test_the_gateway_urls_password_is_in_no_log_record_and_no_repr(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """httpx logs each request's URL (INFO); a `user:password@` in the gateway's URL was in
    every one of them, though the client's own credentials are what authenticates. The
    client's secret was in the repr of its configuration."""
    gateway = serve(submitted_as_marked)
    url = gateway.url.replace("http://", "http://someone:URLPASSWORD@")
    caplog.set_level(logging.DEBUG)
    with ConveyorClient(url, "u", "CLIENTSECRET") as client:
        assert client.submit("svc", {"marker": "m"}).task_id == task_of("m")
        shown = repr(client.config) + repr(vars(client))
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "/v1/services/svc/tasks" in logged  # httpx did log the request
    assert "URLPASSWORD" not in logged + shown
    assert "CLIENTSECRET" not in shown


@pytest.mark.parametrize("url", ["localhost:8000", "127.0.0.1:8000", "ftp://host/", "http://"])
@pytest.mark.parametrize("flavour", ["sync", "async"])
def test_a_gateway_url_that_is_not_http_is_value_error_at_construction(
    url: str, flavour: str
) -> None:
    """`localhost:8000` was taken as a URL of scheme `localhost`: every call then failed as an
    unreachable gateway (an httpx.TransportError), and `wait` rode it out for 30 s as an
    outage."""
    kind = ConveyorClient if flavour == "sync" else AsyncConveyorClient
    with pytest.raises(ValueError, match="http:// or https://"):
        kind(url, "u", "p")


def test_more_follows_than_a_connection_pool_holds_all_end(serve: Any) -> None:
    """Each open event stream holds a connection for the task's life: past httpx's default
    pool of 100, the 101st `wait` waited for a connection, took the pool's timeout for an
    outage, and raised httpx.PoolTimeout against a gateway answering all along."""
    count = 110
    opened = threading.Semaphore(0)
    all_open = threading.Event()

    def stream_until_all_open(h: Handler) -> None:
        if not h.path.endswith("/events"):  # a poll, once a stream broke (a loaded machine)
            state = SUCCESS if all_open.is_set() else PENDING
            h.envelope(200, {"status": "success", "data": state})
            return
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True
        h.wfile.write(event(PENDING).encode())
        h.wfile.flush()
        opened.release()
        if all_open.wait(30):
            h.wfile.write(event(SUCCESS).encode())

    serve_ = serve(stream_until_all_open)
    serve_.socket.listen(4 * count)  # the server's backlog of 5 drops a burst of connects

    def count_streams() -> None:
        for _ in range(count):
            if not opened.acquire(timeout=30):
                return
        all_open.set()

    threading.Thread(target=count_streams, daemon=True).start()

    async def run() -> list[str]:
        async with AsyncConveyorClient(serve_.url, "u", "p") as client:
            waits = [client.wait("svc", TASK_ID, timeout=40) for _ in range(count)]
            return [t.status for t in await asyncio.gather(*waits)]

    assert asyncio.run(run()) == ["SUCCESS"] * count


def test_a_socks_proxy_in_the_environment_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ALL_PROXY=socks5://…`, common on a corporate desktop: building a client raised
    ImportError (httpx's SOCKS support is an extra), and every `conveyor task` command died
    with a traceback. The proxy is now used: here nothing listens there."""
    monkeypatch.setenv("ALL_PROXY", "socks5://127.0.0.1:9")
    with ConveyorClient("http://gateway.invalid:8000", "u", "p", timeout=2) as client:
        with pytest.raises(httpx.TransportError):
            client.get("svc", TASK_ID)


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_the_cli_prints_a_non_ascii_result_to_a_stdout_that_is_not_utf8(encoding: str) -> None:
    """`conveyor task get` (and `watch`, `submit --wait`) of a result holding `é ☃ 日本`, its
    stdout a pipe in ASCII or Latin-1 (PYTHONIOENCODING, a legacy locale): a traceback, exit
    1, for a task that succeeded. The JSON is now written with those characters escaped."""
    value = {"name": "héllo ☃ 日本", "n": 1}
    raw = io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding=encoding)
    task_cli.print_json(value, Console(file=stdout, force_terminal=False))
    stdout.flush()
    assert json.loads(raw.getvalue().decode(encoding)) == value


def test_the_cli_reads_a_utf8_body_from_a_command_line_its_locale_cannot_decode(
    serve: Any,
) -> None:
    """`LC_ALL=C PYTHONUTF8=0 conveyor task submit svc --body '{"n": "é"}'`: Python decoded the
    command line as ASCII, keeping each byte past it as a lone surrogate, and the CLI refused
    valid UTF-8 as "not UTF-8". Such bytes are read back as UTF-8 now (only bytes that are
    not UTF-8 are refused)."""
    gateway = serve(submitted_as_marked)
    body = '{"marker": "\udcc3\udca9"}'  # b'\xc3\xa9', "é" in UTF-8, as ASCII decoded it
    result = hostile.cli(gateway.url, "submit", "svc", "--body", body, "-q")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == task_of("é")
    refused = hostile.cli(gateway.url, "submit", "svc", "--body", '{"marker": "\udce9"}')
    assert refused.exit_code == 2 and "not UTF-8" in refused.stderr, refused.output
