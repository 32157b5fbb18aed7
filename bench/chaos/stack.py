"""The platform under test, as real processes: gateway, sleeper function, dispatchers.

Every process writes its own log file (one per dispatcher generation), is
started from the repository root with this interpreter, and is killed in the
end whatever happened. A restarted gateway or function keeps its port; a
restarted dispatcher gets a new `HOSTNAME` (`disp-<i>-<generation>`), as a new
pod would, and a new local port.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench.chaos.config import ChaosConfig
from bench.chaos.infra import PlatformData
from tests.support.processes import PYTHON, Proc, free_port, wait_http

SIGNING_SECRET = "chaos-signing-secret"


@dataclass
class DispatcherSlot:
    index: int
    mode: str  # requeue | drain
    generation: int = 0
    proc: Proc | None = None
    exits: list[int | None] = field(default_factory=list)  # exit codes after SIGTERM

    @property
    def hostname(self) -> str:
        return f"disp-{self.index}-{self.generation}"


class StartError(RuntimeError):
    """A process did not come up; the message carries the end of its log."""


class Stack:
    def __init__(
        self, config: ChaosConfig, database_url: str, platform: PlatformData, log_dir: Path
    ) -> None:
        self.config = config
        self.database_url = database_url
        self.platform = platform
        self.log_dir = log_dir
        self.call_log = log_dir / "calls.log"
        self.gateway_port = free_port()
        self.function_port = free_port()
        self.gateway: Proc | None = None
        self.gateway_generation = 0
        self.function: Proc | None = None
        self.function_generation = 0
        modes = ("requeue", "drain")
        self.slots = [DispatcherSlot(i, modes[i % 2]) for i in range(config.dispatchers)]
        self._all: list[Proc] = []

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def function_url(self) -> str:
        return f"http://127.0.0.1:{self.function_port}/"

    def _start(self, name: str, args: list[str], env: Mapping[str, str]) -> Proc:
        proc = Proc(name, args, env, self.log_dir)
        self._all.append(proc)
        return proc

    def _ready(self, proc: Proc, url: str, timeout: float) -> None:
        try:
            wait_http(url, timeout, proc)
        except (RuntimeError, TimeoutError):
            raise StartError(f"{proc.name} did not start:\n{proc.tail()}") from None

    # -- the processes ---------------------------------------------------------

    def start(self) -> None:
        """Every process at once, then waits for each: start-up time counts on 2 cores."""
        waits = [self.start_function(wait=False), self.start_gateway(wait=False)]
        waits += [self.start_dispatcher(slot, wait=False) for slot in self.slots]
        for proc, url in waits:
            self._ready(proc, url, 90.0)

    def start_gateway(self, wait: bool = True) -> tuple[Proc, str]:
        self.gateway_generation += 1
        env = {
            "CONVEYOR_DATABASE_URL": self.database_url,
            "CONVEYOR_AMQP_URL": self.config.amqp_url,
            "CONVEYOR_CALLBACK_ALLOW_HTTP": "1",
            "CONVEYOR_CALLBACK_ALLOWED_HOSTS": "localhost",
            "CONVEYOR_CALLBACK_SIGNING_SECRET": SIGNING_SECRET,
            "CONVEYOR_PUBLISH_TIMEOUT": "1.5",  # outbox grace: 2 x 1.5 s + keep-confirmed 5 s
            "CONVEYOR_RELAY_INTERVAL": "0.5",
            "CONVEYOR_SERVICE_REFRESH_INTERVAL": "1",
            # A task whose message a crashed broker dropped is ended by the watchdog after
            # taskTimeout x maxAttempts (90 s) + 30 s, checked every 5 s: within the run.
            "CONVEYOR_SILENCE_MARGIN": "30",
            "CONVEYOR_REAPER_INTERVAL": "5",
            "CONVEYOR_LOG_FORMAT": "json",
            **self.config.gateway_env,
        }
        args = [PYTHON, "-m", "conveyor", "gateway", "--port", str(self.gateway_port)]
        self.gateway = self._start(f"gateway-{self.gateway_generation}", args, env)
        return self._maybe_wait(self.gateway, f"{self.gateway_url}/healthz", wait)

    def start_function(self, wait: bool = True) -> tuple[Proc, str]:
        self.function_generation += 1
        env = {"PORT": str(self.function_port), "CALL_LOG": str(self.call_log)}
        args = [PYTHON, "functions/sleeper/main.py"]
        self.function = self._start(f"sleeper-{self.function_generation}", args, env)
        return self._maybe_wait(self.function, f"{self.function_url}healthz", wait)

    def start_dispatcher(self, slot: DispatcherSlot, wait: bool = True) -> tuple[Proc, str]:
        slot.generation += 1
        port = free_port()
        env = {
            "CONVEYOR_QUEUE": self.platform.queue,
            "CONVEYOR_AMQP_URL": self.config.amqp_url,
            "FUNCTION_URL": self.function_url,
            "HOSTNAME": slot.hostname,
            "DISPATCHER_PORT": str(port),
            "CONCURRENCY": str(self.config.dispatcher_concurrency),
            "SHUTDOWN_MODE": slot.mode,
            "DRAIN_TIMEOUT": f"{self.config.drain_timeout_setting:g}",
            "CONVEYOR_LOG_FORMAT": "json",
            **self.config.dispatcher_env,
        }
        args = [PYTHON, "-m", "conveyor", "dispatcher"]
        slot.proc = self._start(slot.hostname, args, env)
        return self._maybe_wait(slot.proc, f"http://127.0.0.1:{port}/healthz", wait)

    def _maybe_wait(self, proc: Proc, url: str, wait: bool) -> tuple[Proc, str]:
        if wait:
            self._ready(proc, url, 60.0)
        return proc, url

    # -- faults ----------------------------------------------------------------

    def kill_gateway(self) -> None:
        assert self.gateway is not None
        self.gateway.kill()
        self.start_gateway()

    def kill_function(self) -> None:
        assert self.function is not None
        self.function.kill()
        self.start_function()

    def kill_dispatcher(self, slot: DispatcherSlot) -> None:
        assert slot.proc is not None
        slot.proc.kill()
        self.start_dispatcher(slot)

    def terminate_dispatcher(self, slot: DispatcherSlot) -> int | None:
        """SIGTERM (a KEDA scale-in), wait for the exit, start a new pod. Returns the exit code."""
        assert slot.proc is not None
        slot.proc.signal(signal.SIGTERM)
        code = slot.proc.reap(self.config.drain_timeout_setting + 15)
        slot.exits.append(code)
        self.start_dispatcher(slot)
        return code

    # -- the end -----------------------------------------------------------------

    def stop_dispatchers(self) -> list[int | None]:
        """SIGTERM every dispatcher at once, then wait for each."""
        live = [s.proc for s in self.slots if s.proc is not None and s.proc.alive()]
        for proc in live:
            proc.signal(signal.SIGTERM)
        return [proc.reap(self.config.drain_timeout_setting + 15) for proc in live]

    def kill_all(self) -> None:
        for proc in reversed(self._all):
            if proc.alive():
                proc.stop(5)
            else:
                proc.kill()

    def tails(self) -> str:
        names = [p for p in (self.gateway, self.function) if p is not None]
        names += [s.proc for s in self.slots if s.proc is not None]
        return "\n".join(f"==== {p.name} ====\n{p.tail(2000)}" for p in names)
