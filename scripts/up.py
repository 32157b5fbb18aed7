"""`make up`: the whole platform on one machine, in one terminal.

It migrates the database, applies the demo platform file, then runs and
supervises the gateway, the sleeper function and its dispatcher as child
processes, prefixing each output line with the child's name. A child that dies
is restarted with backoff; one that cannot start (it dies soon after each of
GIVE_UP_AFTER starts in a row) stops everything, exit 1, rather than being tried
forever, and a port already taken is named before anything starts. Ctrl-C or SIGTERM stops the dispatcher first (so it
requeues what it holds), then the rest, SIGKILLs whatever is still alive after
10 s, and exits 0.

Run it from the repository root: `python -m scripts.up`. The environment passes
through to every child (CONVEYOR_DATABASE_URL, CONVEYOR_AMQP_URL, ...). Ports:
CONVEYOR_UP_GATEWAY_PORT (8000), CONVEYOR_UP_FUNCTION_PORT (8080),
CONVEYOR_UP_DISPATCHER_PORT (8081).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.text import Text

from conveyor.lifeline import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
PLATFORM_FILE = "functions/sleeper/platform.yaml"
SHUTDOWN_GRACE_S = 10.0
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
HEALTHY_RUN_S = 30.0
GIVE_UP_AFTER = 5  # starts in a row, each ended within HEALTHY_RUN_S
READY_POLL_S = 0.5
LINE_LIMIT = 1 << 20


@dataclass(frozen=True)
class Program:
    """One supervised child: how to start it and how it looks in the log."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    color: str = "white"
    stop_first: bool = False


class PortError(ValueError):
    """A CONVEYOR_UP_*_PORT setting that is no port number."""


@dataclass(frozen=True)
class Ports:
    gateway: int = 8000
    function: int = 8080
    dispatcher: int = 8081

    @classmethod
    def from_env(cls) -> Ports:
        """PortError naming the setting for anything but a port number (`abc` was int()'s
        traceback, 70000 bind()'s)."""

        def port(name: str, default: int) -> int:
            setting = f"CONVEYOR_UP_{name}_PORT"
            value = os.environ.get(setting) or str(default)
            if not (value.isascii() and value.isdigit() and 1 <= int(value) <= 65535):
                raise PortError(f"{setting} must be a port number from 1 to 65535, not {value!r}")
            return int(value)

        return cls(port("GATEWAY", 8000), port("FUNCTION", 8080), port("DISPATCHER", 8081))

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway}"


def conveyor_command() -> list[str]:
    """The `conveyor` script of this interpreter's environment, else `python -m conveyor`."""
    script = Path(sys.executable).parent / "conveyor"
    return [str(script)] if script.exists() else [sys.executable, "-m", "conveyor"]


def setup_steps() -> list[list[str]]:
    conveyor = conveyor_command()
    return [[*conveyor, "db", "upgrade"], [*conveyor, "admin", "apply", "-f", PLATFORM_FILE]]


def platform_programs(ports: Ports) -> list[Program]:
    conveyor = conveyor_command()
    gateway_env = {
        "CONVEYOR_CALLBACK_ALLOW_HTTP": "1",
        "CONVEYOR_CALLBACK_ALLOW_PRIVATE": "1",
        # A local platform's own secret, unless one is given (production sets a real one).
        "CONVEYOR_CALLBACK_SIGNING_SECRET": os.environ.get("CONVEYOR_CALLBACK_SIGNING_SECRET")
        or "local-development-signing-secret",
    }
    dispatcher_env = {
        "CONVEYOR_QUEUE": "sleeper",
        "FUNCTION_URL": f"http://127.0.0.1:{ports.function}/",
        "HOSTNAME": "local-dispatcher-1",
        "DISPATCHER_PORT": str(ports.dispatcher),
    }
    return [
        Program(
            "gateway",
            [*conveyor, "gateway", "--host", "127.0.0.1", "--port", str(ports.gateway)],
            gateway_env,
            "cyan",
        ),
        Program(
            "sleeper",
            [sys.executable, "functions/sleeper/main.py"],
            {"HOST": "127.0.0.1", "PORT": str(ports.function)},
            "magenta",
        ),
        Program("dispatcher", [*conveyor, "dispatcher"], dispatcher_env, "green", stop_first=True),
    ]


class Output:
    """Prefixed, coloured lines from every child on one console."""

    def __init__(self, console: Console, width: int = 10) -> None:
        self.console = console
        self.width = width

    def line(self, name: str, color: str, text: str) -> None:
        prefix = Text(f"{name:<{self.width}} | ", style=f"bold {color}")
        self.console.print(prefix + Text.from_ansi(text), soft_wrap=True, highlight=False)

    def note(self, text: str) -> None:
        self.line("up", "white", text)


async def sleep_unless(event: asyncio.Event, seconds: float) -> bool:
    """Sleeps; returns True at once if `event` is set meanwhile."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        return False
    return True


async def spawn(argv: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    """Its own session, so that the terminal's Ctrl-C reaches only the supervisor."""
    return await asyncio.create_subprocess_exec(
        *argv,
        cwd=ROOT,
        # Children write to a pipe, where logs default to JSON: a person reads these.
        env={"CONVEYOR_LOG_FORMAT": "text", **os.environ, "PYTHONUNBUFFERED": "1", **env},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent,
        limit=LINE_LIMIT,
    )


async def pump(stream: asyncio.StreamReader, emit: Callable[[str], None]) -> None:
    while line := await stream.readline():
        emit(line.decode("utf-8", "replace").rstrip("\r\n"))


class Supervised:
    """Runs one program, restarting it with backoff until the supervisor stops."""

    def __init__(
        self,
        program: Program,
        output: Output,
        stopping: asyncio.Event,
        first_backoff: float = FIRST_BACKOFF_S,
        give_up_after: int = GIVE_UP_AFTER,
    ) -> None:
        self.program = program
        self.output = output
        self.stopping = stopping
        self.first_backoff = first_backoff
        self.give_up_after = give_up_after
        self.process: asyncio.subprocess.Process | None = None
        self.starts = 0
        self.gave_up = False

    def emit(self, text: str) -> None:
        self.output.line(self.program.name, self.program.color, text)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def run(self) -> None:
        backoff = self.first_backoff
        short_runs = 0
        while not self.stopping.is_set():
            started = time.monotonic()
            code = await self.run_once()
            if self.stopping.is_set():
                return
            if time.monotonic() - started >= HEALTHY_RUN_S:
                backoff, short_runs = self.first_backoff, 0
            short_runs += 1
            if short_runs >= self.give_up_after:
                self.emit(
                    f"exited {short_runs} times in a row soon after its start (last code {code}):"
                    " giving up, stopping everything; its lines above say why"
                )
                self.gave_up = True
                self.stopping.set()
                return
            self.emit(f"exited unexpectedly (code {code}); restarting in {backoff:g}s")
            if await sleep_unless(self.stopping, backoff):
                return
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def run_once(self) -> int:
        try:
            self.process = await spawn(self.program.argv, self.program.env)
        except OSError as exc:
            self.emit(f"cannot start {self.program.argv[0]}: {exc}")
            return 127
        self.starts += 1
        if self.stopping.is_set():
            self.send(signal.SIGTERM)
        assert self.process.stdout is not None
        await pump(self.process.stdout, self.emit)
        return await self.process.wait()

    def send(self, signum: int) -> None:
        """Signals the child's whole process group (it leads its own session)."""
        process = self.process
        if process is not None and process.returncode is None:
            try:
                os.killpg(process.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    async def wait_exit(self, until: float) -> None:
        process = self.process
        if process is not None and process.returncode is None:
            try:
                await asyncio.wait_for(process.wait(), max(0.0, until - time.monotonic()))
            except TimeoutError:
                pass


class Supervisor:
    """Starts the programs, and stops them in order on request."""

    def __init__(self, programs: list[Program], output: Output, **restarts: Any) -> None:
        """`restarts`: `first_backoff`, `give_up_after` (see Supervised)."""
        self.output = output
        self.stopping = asyncio.Event()
        self.children = [Supervised(p, output, self.stopping, **restarts) for p in programs]
        self.tasks: list[asyncio.Task[None]] = []

    @property
    def failed(self) -> bool:
        """A child could not be kept running."""
        return any(child.gave_up for child in self.children)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(child.run()) for child in self.children]

    async def stop(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """SIGTERM the `stop_first` children, then the rest; SIGKILL any left at the deadline."""
        self.stopping.set()
        deadline = time.monotonic() + grace
        first = [c for c in self.children if c.program.stop_first]
        rest = [c for c in self.children if not c.program.stop_first]
        for group, until in ((first, time.monotonic() + grace / 2), (rest, deadline)):
            for child in group:
                child.send(signal.SIGTERM)
            await asyncio.gather(*(child.wait_exit(until) for child in group))
        await asyncio.gather(*(child.wait_exit(deadline) for child in self.children))
        for child in self.children:
            if child.alive:
                child.emit(f"still running after {grace:g}s: SIGKILL")
                child.send(signal.SIGKILL)
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def run_step(argv: list[str], output: Output, stopping: asyncio.Event) -> int | None:
    """One setup command in the foreground; None if the supervisor was asked to stop."""
    output.note("$ " + " ".join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv)))
    process = await spawn(argv, {})
    assert process.stdout is not None
    pumping = asyncio.create_task(pump(process.stdout, lambda t: output.line("setup", "blue", t)))
    waiting = asyncio.create_task(process.wait())
    stop = asyncio.create_task(stopping.wait())
    await asyncio.wait({waiting, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if not waiting.done():
        process.terminate()
        await process.wait()
        await pumping
        return None
    await pumping
    return waiting.result()


async def wait_ready(urls: list[str], output: Output, stopping: asyncio.Event) -> bool:
    """Polls each /readyz until it answers 200; False if stopped first. The dispatcher's
    too: its 200 says the function answers, so the banner no longer shows a platform whose
    function is still starting, or failing (the supervisor then stops everything)."""
    started = time.monotonic()
    warned = 0
    waiting = list(urls)
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as http:
        while not stopping.is_set():
            for url in list(waiting):
                try:
                    if (await http.get(url)).status_code == 200:
                        waiting.remove(url)
                except httpx.HTTPError:
                    pass
            if not waiting:
                return True
            waited = int(time.monotonic() - started)
            if waited // 30 > warned:
                warned = waited // 30
                output.note(f"still waiting for {', '.join(waiting)} ({waited}s)")
            if await sleep_unless(stopping, READY_POLL_S):
                return False
    return False


def print_banner(console: Console, ports: Ports) -> None:
    url = ports.gateway_url
    body = """'{"body":{"sleep":5}}'"""
    lines = [
        "",
        f"Conveyor is up: gateway {url}, sleeper function on port {ports.function}.",
        "",
        "Submit a task with curl:",
        f"  curl -u demo:demo-secret -H 'Content-Type: application/json' -d {body} "
        f"{url}/v1/services/sleeper/tasks",
        "",
        "Or with the CLI, and watch it run:",
        f"  export CONVEYOR_GATEWAY_URL={url}"
        " CONVEYOR_CLIENT_ID=demo CONVEYOR_CLIENT_SECRET=demo-secret",
        """  .venv/bin/conveyor task submit sleeper --body '{"sleep": 5}' --wait""",
        "  .venv/bin/conveyor task watch <taskId> --service sleeper",
        "",
        f"The dashboard: {url}/ui/ (operator ops, secret ops-secret).",
        "",
        "Ctrl-C stops everything.",
        "",
    ]
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def install_signals(stopping: asyncio.Event, output: Output) -> None:
    loop = asyncio.get_running_loop()

    def request_stop(signum: int) -> None:
        if not stopping.is_set():
            output.note(f"{signal.Signals(signum).name}: stopping")
        stopping.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, request_stop, signum)


def taken_ports(ports: Ports) -> list[str]:
    """The ports something already listens on, each with the setting that moves it."""
    taken = []
    for name, port in (
        ("GATEWAY", ports.gateway),
        ("FUNCTION", ports.function),
        ("DISPATCHER", ports.dispatcher),
    ):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                taken.append(
                    f"port {port} is in use: stop what listens there or set CONVEYOR_UP_{name}_PORT"
                )
    return taken


async def up(ports: Ports, console: Console) -> int:
    output = Output(console)
    if taken := taken_ports(ports):
        for line in taken:
            output.note(line)
        return 1
    supervisor = Supervisor(platform_programs(ports), output)
    install_signals(supervisor.stopping, output)
    for step in setup_steps():
        code = await run_step(step, output, supervisor.stopping)
        if code is None:
            return 0
        if code != 0:
            output.note(f"setup step failed with code {code}: is `make services` done?")
            return 1
    supervisor.start()
    ready = [f"{ports.gateway_url}/readyz", f"http://127.0.0.1:{ports.dispatcher}/readyz"]
    if await wait_ready(ready, output, supervisor.stopping):
        print_banner(console, ports)
    await supervisor.stopping.wait()
    await supervisor.stop()
    output.note("stopped")
    return 1 if supervisor.failed else 0


def main() -> int:
    try:
        ports = Ports.from_env()
    except PortError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return asyncio.run(up(ports, Console()))


if __name__ == "__main__":
    sys.exit(main())
