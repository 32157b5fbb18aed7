"""Callback slots shared across targets, however many of them hang (a black-box test).

Found by a tester: one hanging target left `CALLBACK_PER_TARGET` slots free, but four or more
(each accepting the connection, never answering) held every slot between them, `per_target`
each, and the claim's oldest-first order put a healthy consumer's callbacks, finished later,
behind all of theirs: they went out only after every hanging callback had spent its attempts
(306 and 488 s late). The gateway here has 8 slots, 2 "per target", 2 s attempts; five
hanging targets with 15 callbacks each would take about a minute to drain.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.integration.test_callbacks import _notifier
from tests.support import metrics
from tests.support.amqp import (
    wait_until,
)
from tests.support.gateway import GatewayProcess, Platform, Service
from tests.support.processes import Processes

TIMEOUT = 2.0  # CALLBACK_TIMEOUT: one attempt
HANGING_TARGETS = 5
CALLBACKS_EACH = 15
HEALTHY = 3


class Hanging:
    """A target that takes every connection and never answers a byte."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.port: int = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self.held.append(conn)
            self.accepted += 1

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


class Healthy:
    """A target that answers 200 at once, noting when each callback arrived."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        arrivals = self.arrivals

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                arrivals.append(time.monotonic())
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port: int = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _submit(gateway: GatewayProcess, svc: Service, urls: list[str]) -> list[str]:
    with gateway.http(svc.clients[0]) as http:
        answer = http.post(
            f"{gateway.tasks_url(svc.name)}/batch",
            json={"tasks": [{"body": {}, "callback": {"type": "http", "url": u}} for u in urls]},
        )
    assert answer.status_code == 201, answer.text
    return [item["taskId"] for item in answer.json()["data"]["tasks"]]


def _finish(platform: Platform, task_ids: list[str]) -> None:
    """Ends the tasks in one go, as the result consumer does: SUCCESS, callback due."""
    platform.sql(
        """
        UPDATE tasks SET status = 'SUCCESS', start_date = now(), end_date = now(), progress = 100,
               response = '{"done": true}', notification_status = 'PENDING'
         WHERE task_id = ANY(CAST(%(ids)s AS uuid[]))
        """,
        {"ids": task_ids},
    )


def _slow_targets(gateway: GatewayProcess) -> float:
    with gateway.http() as http:
        return metrics.value(http.get("/metrics").text, "conveyor_gateway_callback_slow_targets")


@dataclass
class Scene:
    gateway: GatewayProcess
    platform: Platform
    svc: Service
    hanging: list[Hanging]
    healthy: Healthy

    def submit(self, each: int) -> tuple[list[str], list[str]]:
        """`each` callbacks per hanging target, interleaved; then HEALTHY healthy ones."""
        dead = [f"http://localhost:{t.port}/hook" for _ in range(each) for t in self.hanging]
        good = [f"http://localhost:{self.healthy.port}/hook"] * HEALTHY
        return _submit(self.gateway, self.svc, dead), _submit(self.gateway, self.svc, good)

    def healthy_delays(self, good_ids: list[str], bound: float) -> list[float]:
        """Ends the healthy consumer's tasks; how long each callback took to arrive."""
        ended = time.monotonic()
        _finish(self.platform, good_ids)
        wait_until(
            lambda: len(self.healthy.arrivals) >= HEALTHY,
            timeout=bound,
            what=f"the healthy consumer's {HEALTHY} callbacks within {bound:g} s",
        )
        return [round(at - ended, 2) for at in self.healthy.arrivals]


@contextmanager
def _scene(
    database_url: str, amqp_url: str, procs: Processes, targets: int, attempts: int
) -> Iterator[Scene]:
    """Hanging targets and a healthy one, and a gateway with 8 slots, 2 "per target"."""
    hanging = [Hanging() for _ in range(targets)]
    healthy = Healthy()
    try:
        tuned = _notifier(
            database_url,
            amqp_url,
            procs,
            CONVEYOR_CALLBACK_TIMEOUT=f"{TIMEOUT:g}",
            CONVEYOR_CALLBACK_ATTEMPTS=str(attempts),
            CONVEYOR_CALLBACK_CONCURRENCY="8",
            CONVEYOR_CALLBACK_PER_TARGET="2",
        )
        with tuned as (gateway, platform, svc):
            yield Scene(gateway, platform, svc, hanging, healthy)
    finally:
        for target in hanging:
            target.close()
        healthy.close()


@pytest.mark.timeout(90)
def test_many_hanging_targets_delay_no_other_consumer(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    with _scene(database_url, amqp_url, procs, HANGING_TARGETS, attempts=3) as scene:
        dead_ids, good_ids = scene.submit(CALLBACKS_EACH)
        _finish(scene.platform, dead_ids)
        # The hanging callbacks are under way: the pool has taken all it will of them.
        wait_until(
            lambda: sum(t.accepted for t in scene.hanging) >= 5,
            timeout=10,
            what="calls to the hanging targets",
        )
        time.sleep(0.5)
        bound = 2 * TIMEOUT + 2
        delays = scene.healthy_delays(good_ids, bound)
        assert max(delays) < bound, delays
        # Round-robin: every hanging target has had a go, none was left out for later.
        assert all(t.accepted for t in scene.hanging), [t.accepted for t in scene.hanging]


@pytest.mark.timeout(120)
def test_more_hanging_targets_than_slots_delay_no_other_consumer_past_their_first_round(
    database_url: str, amqp_url: str, procs: Processes
) -> None:
    """Ten hanging targets, eight slots: each target's first delivery took any free slot, so
    at every round of their callbacks they held all eight between them, and a healthy
    consumer's callbacks, finished later, went out only after every hanging one (~4 rounds of
    two 2 s attempts here). A target that let an attempt time out now gives way: its
    deliveries take only slots that leave CALLBACK_PER_TARGET free, after other targets'."""
    with _scene(database_url, amqp_url, procs, targets=10, attempts=2) as scene:
        dead_ids, good_ids = scene.submit(3)
        _finish(scene.platform, dead_ids)
        wait_until(
            lambda: sum(t.accepted for t in scene.hanging) >= 8,
            timeout=10,
            what="the first round of calls to the hanging targets",
        )
        time.sleep(TIMEOUT + 0.5)  # their first attempts have timed out
        wait_until(
            lambda: _slow_targets(scene.gateway) >= 8, timeout=5, what="the slow targets counted"
        )
        bound = 2 * TIMEOUT + 2  # the first round's second attempts, and a margin
        delays = scene.healthy_delays(good_ids, bound)
        assert max(delays) < bound, delays

        # The hanging targets are slowed, not starved: every callback of theirs ends.
        def pending() -> int:
            rows = scene.platform.sql(
                "SELECT count(*) FROM tasks WHERE task_id = ANY(CAST(%(ids)s AS uuid[]))"
                " AND notification_status = 'PENDING'",
                {"ids": dead_ids},
            )
            return int(rows[0][0])

        wait_until(lambda: pending() == 0, timeout=60, what="every hanging callback ended")
        assert all(t.accepted for t in scene.hanging), [t.accepted for t in scene.hanging]
