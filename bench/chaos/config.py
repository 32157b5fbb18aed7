"""What a chaos run does: how many tasks, how fast, and which faults when.

The fault schedule is computed up front from a seeded random source, so that a
run can be repeated (`--seed`). A fault is placed not at a time but at a point
of the submissions (a fraction of N): the submitter waits at that point until
the fault has begun, so every fault lands while tasks are being submitted and
processed, however long the previous faults took on a loaded machine. Each
"sparse" kind comes a fixed number of times, evenly spread with jitter, and a
SIGKILL of a random dispatcher comes about every `dispatcher_kill_interval`
seconds of the nominal submission window (N / rate) in between. The injector
runs them one after the other, never two at once.
"""

from __future__ import annotations

import enum
import math
import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from conveyor.settings import DEFAULT_AMQP_URL

DEFAULT_ADMIN_DB_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


class FaultKind(enum.StrEnum):
    DISPATCHER_SIGKILL = "dispatcher_sigkill"
    DISPATCHER_SIGTERM_REQUEUE = "dispatcher_sigterm_requeue"
    DISPATCHER_SIGTERM_DRAIN = "dispatcher_sigterm_drain"
    FUNCTION_SIGKILL = "function_sigkill"
    RABBITMQ_RESTART = "rabbitmq_restart"
    RABBITMQ_SIGKILL = "rabbitmq_sigkill"
    POSTGRES_RESTART = "postgres_restart"
    POSTGRES_SIGKILL = "postgres_sigkill"
    # RabbitMQ and PostgreSQL SIGKILLed at once, and a dispatcher with them
    OVERLAPPING = "overlapping"
    GATEWAY_SIGKILL = "gateway_sigkill"
    # On a 3-node RabbitMQ cluster and a PostgreSQL pair (bench/chaos/cluster.py)
    LEADER_NODE_SIGKILL = "leader_node_sigkill"  # the node leading `-in`, restarted
    PRIMARY_FAILOVER = "primary_failover"  # the primary SIGKILLed, the standby promoted
    NODE_FREEZE = "node_freeze"  # SIGSTOP: no socket closes
    RESULTS_NODE_DOWN = "results_node_down"  # the node leading `-out`, down for a minute


CLUSTER_KINDS = (
    FaultKind.LEADER_NODE_SIGKILL,
    FaultKind.PRIMARY_FAILOVER,
    FaultKind.NODE_FREEZE,
    FaultKind.RESULTS_NODE_DOWN,
)
SPARSE_KINDS = tuple(
    k for k in FaultKind if k is not FaultKind.DISPATCHER_SIGKILL and k not in CLUSTER_KINDS
)
INFRA_KINDS = (
    FaultKind.RABBITMQ_RESTART,
    FaultKind.RABBITMQ_SIGKILL,
    FaultKind.POSTGRES_RESTART,
    FaultKind.POSTGRES_SIGKILL,
    FaultKind.OVERLAPPING,
)


@dataclass(frozen=True, slots=True)
class ScheduledFault:
    at: float  # a point of the submissions: fraction of N, in [0, 1)
    kind: FaultKind


@dataclass(frozen=True)
class FaultPlan:
    """How many faults of each kind, spread over the submissions.

    `window` is the nominal submission time (N / rate): it decides how many
    dispatcher kills there are. Faults land between `first` and `last` (fractions).
    """

    window: float
    counts: dict[FaultKind, int]
    dispatcher_kill_interval: float = 5.0
    first: float = 0.05
    last: float = 0.9
    max_faults: int = 200

    @classmethod
    def for_window(cls, window: float, per_kind: int = 1, kill_interval: float = 5.0) -> FaultPlan:
        return cls(window, dict.fromkeys(SPARSE_KINDS, per_kind), kill_interval)

    def without(self, kinds: tuple[FaultKind, ...]) -> FaultPlan:
        counts = {k: (0 if k in kinds else n) for k, n in self.counts.items()}
        return replace(self, counts=counts)

    @property
    def dispatcher_kills(self) -> int:
        if self.dispatcher_kill_interval <= 0:
            return 0
        return max(1, math.floor(self.window / self.dispatcher_kill_interval))

    def schedule(self, rng: random.Random) -> list[ScheduledFault]:
        counts = {**self.counts, FaultKind.DISPATCHER_SIGKILL: self.dispatcher_kills}
        span = self.last - self.first
        faults = [
            ScheduledFault(self.first + span * (j + rng.uniform(0.1, 0.9)) / count, kind)
            for kind, count in counts.items()
            for j in range(count)
        ]
        faults.sort(key=lambda f: f.at)
        return faults[: self.max_faults]


def _default_admin_url() -> str:
    return os.environ.get("CONVEYOR_DATABASE_URL", DEFAULT_ADMIN_DB_URL)


def _default_amqp_url() -> str:
    return os.environ.get("CONVEYOR_AMQP_URL", DEFAULT_AMQP_URL)


@dataclass
class ChaosConfig:
    tasks: int = 10_000
    dispatchers: int = 3
    seed: int | None = None
    report: Path | None = None
    database_url: str = field(default_factory=_default_admin_url)  # admin URL: creates our DB
    amqp_url: str = field(default_factory=_default_amqp_url)
    rate: float = 80.0  # submissions per second (the faults need time to land)
    submit_concurrency: int = 32
    dispatcher_concurrency: int = 8
    drain_timeout_setting: float = 5.0  # DRAIN_TIMEOUT of the dispatchers
    callback_fraction: float = 0.2
    repeat_fraction: float = 0.02  # deliberate idempotent repeats of accepted tasks
    keyless_fraction: float = 0.3  # submitted without Idempotency-Key (the group-commit path)
    hostile_fraction: float = 0.01  # tasks whose function answers NUL, deep, huge or trickled
    hostile_hook_fraction: float = 0.05  # callbacks to a trickling or an endless endpoint
    fail_rate: float = 0.1
    max_sleep: float = 0.2
    retry_budget: float = 120.0  # how long a submitter keeps retrying one key
    plan: FaultPlan | None = None  # None: the default plan for this many tasks
    skip: tuple[FaultKind, ...] = ()  # kinds not injected (e.g. no rabbitmqctl)
    drain_limit: float | None = None  # wait for terminal states at most this long
    hard_timeout: float | None = None  # the whole run, whatever happens
    keep_logs: Path | None = None
    command: str = "python -m bench.chaos"
    gateway_env: dict[str, str] = field(default_factory=dict)  # added to the gateway's
    dispatcher_env: dict[str, str] = field(default_factory=dict)  # added to each dispatcher's

    @property
    def window(self) -> float:
        return self.tasks / self.rate

    def fault_plan(self) -> FaultPlan:
        plan = self.plan or default_plan(self.tasks, self.window)
        return plan.without(self.skip) if self.skip else plan

    def drain_seconds(self) -> float:
        return self.drain_limit or max(120.0, self.tasks * 0.06)

    def hard_seconds(self) -> float:
        """The watchdog: generous for slow restarts on a loaded machine, but bounded."""
        plan = self.fault_plan()
        faults = sum(plan.counts.values()) + plan.dispatcher_kills
        return self.hard_timeout or (
            self.window * 2 + faults * FAULT_ALLOWANCE + self.drain_seconds() + 120.0
        )


FAULT_ALLOWANCE = 12.0  # seconds a fault (with its restart) may take, for the watchdog


def default_plan(tasks: int, window: float) -> FaultPlan:
    """About one sparse fault of each kind per 40 s of submissions (at least one, at most
    three), a dispatcher SIGKILL every 5 s; server restarts at most twice each, since
    they cut off everybody using those servers."""
    per_kind = max(1, min(3, round(window / 40)))
    plan = FaultPlan.for_window(window, per_kind=per_kind, kill_interval=5.0)
    counts = {k: (min(n, 2) if k in INFRA_KINDS else n) for k, n in plan.counts.items()}
    return replace(plan, counts=counts)
