"""Real processes for tests and benchmarks: started, signalled, and their logs kept.

Each process writes to its own log file so a failing test can print it, and so a
test can grep the logs (e.g. for leaked secrets). The benchmarks use the same.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


# Where the processes of one test run claim the ports they are handed: set by the run's
# controller before its xdist workers start, inherited by them and by what they start (the
# benchmarks the smoke tests run), removed when the run ends (`claim_ports_for_this_run`).
PORT_CLAIMS = "CONVEYOR_TEST_PORT_CLAIMS"


def free_port() -> int:
    """A port nothing listens on, picked by the kernel, and never handed to two processes of
    one test run: a kernel-picked port is free for every xdist worker alike until its server
    binds it, and two workers were once handed the same one (one server failed to bind; its
    readiness check was answered by the other worker's server). Each port handed out is
    claimed in the run's directory (PORT_CLAIMS), when there is one."""
    claims = os.environ.get(PORT_CLAIMS)
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if not claims:
            return port
        try:
            os.close(os.open(Path(claims) / str(port), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue  # another process's already
        except FileNotFoundError:
            pass  # the run's directory is gone (its end, or someone's clean-up): unclaimed
        return port
    raise RuntimeError("no port left unclaimed in 100 tries")


@contextmanager
def claim_ports_for_this_run() -> Iterator[None]:
    """The run's claims directory, in the environment of everything the run starts."""
    claims = tempfile.mkdtemp(prefix="conveyor-test-ports-")
    os.environ[PORT_CLAIMS] = claims
    try:
        yield
    finally:
        os.environ.pop(PORT_CLAIMS, None)
        shutil.rmtree(claims, ignore_errors=True)


class Proc:
    def __init__(self, name: str, args: list[str], env: Mapping[str, str], log_dir: Path) -> None:
        self.name = name
        self.args = args
        self.log_path = log_dir / f"{name}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        self._log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(
            args, cwd=REPO, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def logs(self) -> str:
        if not self._log.closed:  # dump() runs after stop_all() closed it
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.logs()[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; the exit code."""
        self.signal(signal.SIGTERM)
        self.reap(timeout)
        return self.popen.returncode

    def reap(self, timeout: float) -> int | None:
        """Waits for the exit, SIGKILLing it after `timeout`: its own exit code, or None if
        it had to be killed."""
        try:
            code: int | None = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            self.kill()
        self._log.close()
        return code

    def kill(self) -> None:
        """SIGKILL, reaped."""
        self.signal(signal.SIGKILL)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def wait_http(url: str, timeout: float = 30.0, proc: Proc | None = None, ok: int = 500) -> float:
    """Polls `url` until it answers below `ok`; returns the seconds it took."""
    started = time.monotonic()
    deadline = started + timeout
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc is not None and not proc.alive():
                raise RuntimeError(f"{proc.name} exited early:\n{proc.tail(4000)}")
            try:
                if client.get(url).status_code < ok:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    detail = proc.tail(4000) if proc else ""
    raise TimeoutError(f"{url} not ready after {timeout}s\n{detail}")


class Processes:
    """Starts processes for one test and stops every one of them afterwards."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(self, name: str, args: list[str], env: Mapping[str, str] | None = None) -> Proc:
        proc = Proc(name, args, env or {}, self.log_dir)
        self.procs.append(proc)
        return proc

    def conveyor(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> Proc:
        return self.start(name, [PYTHON, "-m", "conveyor", *args], env)

    def stop(self, proc: Proc, timeout: float = 10.0) -> int | None:
        code = proc.stop(timeout)
        if proc in self.procs:
            self.procs.remove(proc)
        return code

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            proc.stop()

    def dump(self) -> str:
        return "\n".join(f"==== {p.name} ====\n{p.logs()[-3000:]}" for p in self.procs)


@contextmanager
def processes(log_dir: Path) -> Iterator[Processes]:
    procs = Processes(log_dir)
    try:
        yield procs
    finally:
        procs.stop_all()
