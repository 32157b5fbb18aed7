"""End-to-end fixtures: gateway + dispatcher(s) + the sleeper function, as real processes.

One gateway and one sleeper function serve a whole module; each test gets its
own service (and so its own queues) and starts its own dispatchers, which it
may signal or kill.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.gateway import Client, GatewayProcess, Platform, Service, gateway_env
from tests.support.processes import PYTHON, Proc, Processes, free_port, wait_http

TERMINAL = {"SUCCESS", "FAILURE"}


@dataclass
class CallbackSink:
    """A consumer's callback endpoint: records every POST."""

    port: int
    received: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://localhost:{self.port}/hook"


def start_sink() -> tuple[CallbackSink, ThreadingHTTPServer]:
    sink = CallbackSink(free_port())

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            sink.received.append(
                {"body": json.loads(body), "raw": body, "headers": dict(self.headers)}
            )
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", sink.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return sink, server


class Stack:
    def __init__(
        self,
        procs: Processes,
        gateway: GatewayProcess,
        function_url: str,
        amqp_url: str,
        service: Service,
    ) -> None:
        self.procs = procs
        self.gateway = gateway
        self.function_url = function_url
        self.amqp_url = amqp_url
        self.service = service
        self.client: Client = service.clients[0]
        self.http = gateway.http(self.client)
        self.dispatcher_ports: dict[str, int] = {}  # by name: its /healthz, /readyz, /metrics

    def dispatcher(self, name: str, **env: str) -> Proc:
        port = self.dispatcher_ports[name] = free_port()
        proc = self.procs.conveyor(
            name,
            "dispatcher",
            env={
                "CONVEYOR_QUEUE": self.service.queue_name,
                "CONVEYOR_AMQP_URL": self.amqp_url,
                "FUNCTION_URL": self.function_url,
                "HOSTNAME": name,
                "DISPATCHER_PORT": str(port),
                "CONCURRENCY": "4",
                "PROGRESS_INTERVAL": "0.2",
                "RETRY_BACKOFF": "0.1",
                "CONVEYOR_LOG_FORMAT": "json",
                **env,
            },
        )
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout=20, proc=proc)
        return proc

    def submit(self, body: dict[str, Any], callback: str | None = None) -> str:
        payload: dict[str, Any] = {"body": body}
        if callback:
            payload["callback"] = {"type": "http", "url": callback}
        answer = self.http.post(self.gateway.tasks_url(self.service.name), json=payload)
        assert answer.status_code == 201, answer.text
        return answer.json()["data"]["taskId"]

    def poll(self, task_id: str) -> dict[str, Any]:
        answer = self.http.get(f"{self.gateway.tasks_url(self.service.name)}/{task_id}")
        assert answer.status_code == 200, answer.text
        return answer.json()["data"]

    def watch(
        self, task_id: str, until: Callable[[dict[str, Any]], bool], timeout: float = 30
    ) -> list[dict[str, Any]]:
        """Polls every 50 ms; returns every distinct state seen, the last one matching."""
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            data = self.poll(task_id)
            if not seen or seen[-1] != data:
                seen.append(data)
            if until(data):
                return seen
            time.sleep(0.05)
        raise AssertionError(f"task {task_id} timed out; states seen: {seen[-5:]}")

    def finish(self, task_id: str, timeout: float = 60) -> dict[str, Any]:
        return self.watch(task_id, lambda d: d["status"] in TERMINAL, timeout)[-1]


@pytest.fixture(scope="module")
def e2e_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    procs = Processes(tmp_path_factory.mktemp("e2e"))
    yield procs
    procs.stop_all()


@pytest.fixture(scope="module")
def e2e_gateway(e2e_procs: Processes, database_url: str, amqp_url: str) -> GatewayProcess:
    return GatewayProcess(e2e_procs, gateway_env(database_url, amqp_url), "gateway")


@pytest.fixture(scope="module")
def call_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("calls") / "calls.log"


@pytest.fixture(scope="module")
def sleeper_url(e2e_procs: Processes, call_log: Path) -> str:
    port = free_port()
    proc = e2e_procs.start(
        "sleeper",
        [PYTHON, "functions/sleeper/main.py"],
        env={"PORT": str(port), "CALL_LOG": str(call_log), "FAIL_FIRST_N_CALLS_PER_TASK": "0"},
    )
    wait_http(f"http://127.0.0.1:{port}/healthz", proc=proc)
    return f"http://127.0.0.1:{port}/"


@pytest.fixture(scope="module")
def flaky_url(e2e_procs: Processes) -> str:
    """The sleeper answering 503 to the first call of each task."""
    port = free_port()
    proc = e2e_procs.start(
        "flaky-sleeper",
        [PYTHON, "functions/sleeper/main.py"],
        env={"PORT": str(port), "FAIL_FIRST_N_CALLS_PER_TASK": "1"},
    )
    wait_http(f"http://127.0.0.1:{port}/healthz", proc=proc)
    return f"http://127.0.0.1:{port}/"


@pytest.fixture
def stack(
    procs: Processes,
    e2e_gateway: GatewayProcess,
    sleeper_url: str,
    amqp_url: str,
    platform: Platform,
) -> Iterator[Stack]:
    service = platform.service(
        jsonSchema={"type": "object", "required": ["sleep"]}, taskTimeout=60, maxAttempts=3
    )
    s = Stack(procs, e2e_gateway, sleeper_url, amqp_url, service)
    yield s
    s.http.close()


@pytest.fixture
def sink() -> Iterator[CallbackSink]:
    made, server = start_sink()
    yield made
    server.shutdown()


def calls_of(call_log: Path, task_id: str) -> list[list[str]]:
    if not call_log.exists():
        return []
    return [
        line.split("\t") for line in call_log.read_text().splitlines() if line.startswith(task_id)
    ]
