"""The fault injector: runs the schedule against the live stack, one fault at a time.

Every fault ends with the platform restored: a killed or terminated process
is started again (a gateway on its port), a restarted server is running again.
What was done, when, how long it took and what was seen (exit codes, requests
in flight at a gateway kill) is recorded for the report.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.chaos.config import FaultKind, ScheduledFault
from bench.chaos.infra import PostgreSQL, RabbitMQ
from bench.chaos.stack import Stack
from bench.chaos.submitter import Submitter

log = logging.getLogger("bench.chaos")

BURST_WAIT = 3.0  # how long a gateway kill waits for its burst to be in flight


@dataclass
class FaultRecord:
    kind: FaultKind
    at: float  # seconds after the injector started
    duration: float
    detail: dict[str, Any] = field(default_factory=dict)


class FaultInjector(threading.Thread):
    def __init__(
        self,
        stack: Stack,
        schedule: list[ScheduledFault],
        total: int,
        submitter: Submitter,
        rng: random.Random,
        rabbitmq: RabbitMQ | None,
        postgres: PostgreSQL | None,
    ) -> None:
        super().__init__(name="fault-injector", daemon=True)
        self.stack = stack
        self.schedule = schedule
        self.total = total
        self.submitter = submitter
        self.rng = rng
        self.rabbitmq = rabbitmq
        self.postgres = postgres
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.records: list[FaultRecord] = []
        self.errors: list[str] = []

    @property
    def counts(self) -> Counter[str]:
        """Faults injected by kind (those skipped or failed are in `records`/`errors`)."""
        return Counter(
            r.kind.value for r in self.records if not {"skipped", "error"} & set(r.detail)
        )

    def run(self) -> None:
        self.t0 = time.monotonic()
        try:
            for number, fault in enumerate(self.schedule):
                if not self._wait_for_point(fault):
                    return
                self._release_until(number + 1)
                self._inject_and_record(fault)
        finally:
            self.submitter.gate.open()

    def _point(self, fault: ScheduledFault) -> int:
        return int(fault.at * self.total)

    def _release_until(self, number: int) -> None:
        """Submissions may go on up to the point of fault `number`."""
        if number < len(self.schedule):
            self.submitter.gate.limit = self._point(self.schedule[number])
        else:
            self.submitter.gate.open()

    def _wait_for_point(self, fault: ScheduledFault) -> bool:
        """Until the submissions reach the fault's point; False if stopped."""
        point = self._point(fault)
        while self.submitter.submitted < point and not self.submitter.finished:
            if self.stop.wait(0.01):
                return False
        return not self.stop.is_set()

    def _inject_and_record(self, fault: ScheduledFault) -> None:
        began = time.monotonic()
        try:
            detail = self.inject(fault.kind)
        except Exception as exc:  # recorded and reported; the run goes on
            log.exception("fault %s failed", fault.kind)
            self.errors.append(f"{fault.kind.value}: {exc!r}"[:2000])
            detail = {"error": repr(exc)[:500]}
        detail["submitted"] = self.submitter.submitted
        self.records.append(
            FaultRecord(fault.kind, round(began - self.t0, 2), time.monotonic() - began, detail)
        )
        log.info("fault %s done: %s", fault.kind.value, detail)

    def inject(self, kind: FaultKind) -> dict[str, Any]:
        match kind:
            case FaultKind.DISPATCHER_SIGKILL:
                slot = self.rng.choice(self.stack.slots)
                self.stack.kill_dispatcher(slot)
                return {"dispatcher": slot.index}
            case FaultKind.DISPATCHER_SIGTERM_REQUEUE:
                return self._terminate("requeue")
            case FaultKind.DISPATCHER_SIGTERM_DRAIN:
                return self._terminate("drain")
            case FaultKind.FUNCTION_SIGKILL:
                self.stack.kill_function()
                return {}
            case FaultKind.RABBITMQ_RESTART:
                assert self.rabbitmq is not None
                return {"seconds": round(self.rabbitmq.restart(), 2)}
            case FaultKind.RABBITMQ_SIGKILL:
                assert self.rabbitmq is not None
                return {"seconds": round(self.rabbitmq.crash(), 2)}
            case FaultKind.POSTGRES_RESTART:
                assert self.postgres is not None
                return {"seconds": round(self.postgres.restart(), 2)}
            case FaultKind.POSTGRES_SIGKILL:
                assert self.postgres is not None
                return {"seconds": round(self.postgres.crash(), 2)}
            case FaultKind.GATEWAY_SIGKILL:
                return self._kill_gateway_mid_burst()
            case FaultKind.OVERLAPPING:
                return self._overlapping()

    def _overlapping(self) -> dict[str, Any]:
        """Both servers crash at once while a dispatcher is killed: recoveries overlap."""
        assert self.rabbitmq is not None and self.postgres is not None
        timings: dict[str, float] = {}
        crashes = [
            threading.Thread(target=lambda: timings.update(rabbitmq=self.rabbitmq.crash())),
            threading.Thread(target=lambda: timings.update(postgres=self.postgres.crash())),
        ]
        for crash in crashes:
            crash.start()
        slot = self.rng.choice(self.stack.slots)
        self.stack.kill_dispatcher(slot)
        for crash in crashes:
            crash.join()
        return {"dispatcher": slot.index, **{k: round(v, 2) for k, v in timings.items()}}

    def _terminate(self, mode: str) -> dict[str, Any]:
        slots = [s for s in self.stack.slots if s.mode == mode]
        if not slots:
            return {"skipped": f"no dispatcher in {mode} mode"}
        slot = self.rng.choice(slots)
        began = time.monotonic()
        code = self.stack.terminate_dispatcher(slot)
        return {
            "dispatcher": slot.index,
            "exit_code": code,
            "seconds": round(time.monotonic() - began, 2),
        }

    def _kill_gateway_mid_burst(self) -> dict[str, Any]:
        want = max(1, self.submitter.concurrency // 2)
        burst = self.submitter.concurrency * 2
        gate = self.submitter.gate
        gate.limit = max(gate.limit, self.submitter.submitted + burst)
        self.submitter.burst(burst)
        deadline = time.monotonic() + BURST_WAIT
        while self.submitter.in_flight < want and time.monotonic() < deadline:
            time.sleep(0.005)
        in_flight = self.submitter.in_flight
        began = time.monotonic()
        self.stack.kill_gateway()
        return {
            "in_flight_at_kill": in_flight,
            "restart_seconds": round(time.monotonic() - began, 2),
        }
