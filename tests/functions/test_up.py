"""scripts/up.py's supervisor (`make up`), driven with small stand-in programs."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rich.console import Console

from scripts.up import Output, Ports, Program, Supervisor, platform_programs, up, wait_ready

PYTHON = sys.executable


def console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=200, color_system=None), buffer


def py(code: str) -> list[str]:
    return [PYTHON, "-c", code]


async def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def test_prefixes_output_and_restarts_a_dead_child() -> None:
    con, buffer = console()
    supervisor = Supervisor(
        [Program("crashy", py("print('hello', flush=True); exit(3)"))], Output(con)
    )
    supervisor.start()
    child = supervisor.children[0]

    await wait_until(lambda: child.starts >= 2)
    await supervisor.stop(grace=2)

    assert child.starts >= 2, "a child that exits unexpectedly is restarted"
    lines = buffer.getvalue().splitlines()
    assert "crashy     | hello" in lines
    assert any("exited unexpectedly (code 3); restarting in 1s" in line for line in lines)


async def test_stop_sigterms_the_stop_first_child_before_the_others(tmp_path: Path) -> None:
    record = tmp_path / "order.txt"
    on_term = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    time.sleep({delay})\n"
        "    open({path!r}, 'a').write('{name}\\n')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "while True: time.sleep(0.1)\n"
    )
    programs = [
        Program("function", py(on_term.format(delay=0, path=str(record), name="function"))),
        Program(
            "dispatcher",
            py(on_term.format(delay=0.5, path=str(record), name="dispatcher")),
            stop_first=True,
        ),
    ]
    con, buffer = console()
    supervisor = Supervisor(programs, Output(con))
    supervisor.start()
    await wait_until(lambda: buffer.getvalue().count("| ready") == 2)

    started = time.monotonic()
    await supervisor.stop(grace=5)

    assert record.read_text().splitlines() == ["dispatcher", "function"]
    assert time.monotonic() - started < 4
    assert all(child.process.returncode == 0 for child in supervisor.children)  # type: ignore[union-attr]
    assert "restarting" not in buffer.getvalue(), "no restart while shutting down"


async def test_stop_sigkills_children_that_ignore_sigterm() -> None:
    stubborn = py(
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "while True: time.sleep(0.1)\n"
    )
    con, buffer = console()
    supervisor = Supervisor([Program("stubborn", stubborn)], Output(con))
    supervisor.start()
    await wait_until(lambda: "| ready" in buffer.getvalue())

    started = time.monotonic()
    await supervisor.stop(grace=1)

    assert 0.9 <= time.monotonic() - started < 4
    assert supervisor.children[0].process.returncode == -9  # type: ignore[union-attr]
    assert "still running after 1s: SIGKILL" in buffer.getvalue()


def test_platform_programs_wire_ports_and_environment() -> None:
    programs = {
        p.name: p for p in platform_programs(Ports(gateway=9000, function=9001, dispatcher=9002))
    }

    assert set(programs) == {"gateway", "sleeper", "dispatcher"}
    assert programs["gateway"].argv[-4:] == ["--host", "127.0.0.1", "--port", "9000"]
    assert programs["gateway"].env["CONVEYOR_CALLBACK_ALLOW_PRIVATE"] == "1"
    assert programs["sleeper"].env["PORT"] == "9001"
    assert programs["dispatcher"].env == {
        "CONVEYOR_QUEUE": "sleeper",
        "FUNCTION_URL": "http://127.0.0.1:9001/",
        "HOSTNAME": "local-dispatcher-1",
        "DISPATCHER_PORT": "9002",
    }
    assert programs["dispatcher"].stop_first


def test_ports_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_UP_GATEWAY_PORT", "18000")
    monkeypatch.delenv("CONVEYOR_UP_FUNCTION_PORT", raising=False)

    ports = Ports.from_env()

    assert (ports.gateway, ports.function, ports.gateway_url) == (
        18000,
        8080,
        "http://127.0.0.1:18000",
    )


@pytest.mark.parametrize("value", ["abc", "70000", "-5", "0", "\uff18\uff10\uff10\uff10"])
def test_a_port_setting_that_is_no_port_is_named_in_one_line(value: str) -> None:
    """Found by a black-box sweep: `abc` ended `make up` in a traceback about int(), 70000 or
    -5 in bind()'s OverflowError, neither naming the setting."""
    env = {**os.environ, "CONVEYOR_UP_FUNCTION_PORT": value}
    done = subprocess.run(
        [PYTHON, "-m", "scripts.up"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr + done.stdout
    said = (done.stderr + done.stdout).strip()
    assert said.startswith("error: CONVEYOR_UP_FUNCTION_PORT"), said
    assert "1 to 65535" in said


async def test_a_child_that_cannot_start_stops_everything_instead_of_looping() -> None:
    con, buffer = console()
    supervisor = Supervisor(
        [
            Program("broken", py("print('port in use', flush=True); exit(1)")),
            Program("fine", py("import time; time.sleep(60)")),
        ],
        Output(con),
        first_backoff=0.05,
        give_up_after=3,
    )
    supervisor.start()
    await asyncio.wait_for(supervisor.stopping.wait(), 20)
    await supervisor.stop(grace=2)

    broken, fine = supervisor.children
    assert broken.starts == 3 and supervisor.failed
    assert not fine.alive
    assert "giving up" in buffer.getvalue()


async def test_a_port_in_use_is_named_before_anything_starts() -> None:
    con, buffer = console()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        code = await up(Ports(gateway=port, function=port + 1, dispatcher=port + 2), con)
    assert code == 1
    assert time.monotonic() - started < 5  # no migration, no child started
    assert f"port {port} is in use" in buffer.getvalue()
    assert "CONVEYOR_UP_GATEWAY_PORT" in buffer.getvalue()


async def test_the_banner_waits_for_the_dispatcher_too() -> None:
    """Found by a black-box sweep: the banner came as soon as the gateway was ready, while
    the function was still starting or failing. It waits for the dispatcher's /readyz too
    (200 once the function answers)."""
    answers = {"/gateway": 200, "/dispatcher": 503}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(answers[self.path])
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        stopping = asyncio.Event()
        waiting = asyncio.create_task(
            wait_ready([f"{url}/gateway", f"{url}/dispatcher"], Output(console()[0]), stopping)
        )
        await asyncio.sleep(1.5)
        assert not waiting.done(), "ready with the dispatcher still answering 503"
        answers["/dispatcher"] = 200
        assert await asyncio.wait_for(waiting, 10) is True
    finally:
        server.shutdown()
        server.server_close()
