"""The chaos run on a cluster (SPEC §11.7): a 3-node RabbitMQ cluster and a synchronous
PostgreSQL pair of the run's own, four faults under a steady load, done both ways.

    node-list    Conveyor is given the three broker URLs (`;`) and a libpq multi-host
                 database URL (`target_session_attrs=read-write`)
    one-address  Conveyor is given one address per engine: a TCP proxy in front of the three
                 nodes, another in front of the primary (re-pointed at the promoted standby),
                 as Kubernetes Services would be

The faults, one after the other while tasks are submitted (keyed, keyless, with callbacks):
(a) the node leading the task queue SIGKILLed and restarted, (b) the primary SIGKILLed and the
standby promoted, (c) the node leading the task queue frozen (SIGSTOP) for a minute, (d) the
node leading the results queue down for a minute. Everything else is `bench.chaos`'s: the
submitter, the verifier (every accepted task ends as the function decided, here SUCCESS;
none lost, none stuck; every callback delivered) and the watchdog.

The figure of each fault is its *stall*: the longest time in which no task reached a terminal
state, from the fault's start until the first completion after its end (completion times are
the rows' `updated_at`). A frozen node must
stall completions for less than 45 s, a node down for a minute for less than 30 s.

    python -m bench.chaos.cluster [--tasks 1000] [--ways node-list,one-address]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

from bench.chaos import infra, report, verify
from bench.chaos.config import CLUSTER_KINDS, ChaosConfig, FaultKind, FaultPlan, ScheduledFault
from bench.chaos.faults import FaultInjector
from bench.chaos.run import ChaosRun, run
from bench.chaos.submitter import SubmitResult
from conveyor import topology
from tests.support.servers import PostgresServer, RabbitCluster, RabbitNode
from tests.support.tcpproxy import TcpProxy

log = logging.getLogger("bench.chaos")

WAYS = ("node-list", "one-address")
HEARTBEAT = "10"  # seconds: SPEC §11.7's bound on a frozen node going unnoticed
OUTAGE = 60.0  # seconds a frozen or stopped node stays away
# Where the faults land, as fractions of the submissions: far enough apart that the load
# goes on through each of them at the default rate.
POINTS = dict(zip(CLUSTER_KINDS, (0.06, 0.28, 0.5, 0.72), strict=True))
# The stall each fault may cause at most; the others are reported only.
STALL_LIMITS = {FaultKind.NODE_FREEZE: 45.0, FaultKind.RESULTS_NODE_DOWN: 30.0}


class Servers:
    """The run's own cluster and database pair, and the addresses Conveyor is given."""

    def __init__(self, way: str) -> None:
        self.way = way
        self.cluster = RabbitCluster(3).start()
        self.primary = PostgresServer().start()
        self.standby = PostgresServer(primary=self.primary).start()
        self.primary.synchronous()  # a commit is acknowledged once the standby has it
        self.broker_proxy: TcpProxy | None = None
        self.database_proxy: TcpProxy | None = None
        if way == "one-address":
            first, *others = [("127.0.0.1", node.port) for node in self.cluster.nodes]
            self.broker_proxy = TcpProxy(*first, others)
            self.database_proxy = TcpProxy("127.0.0.1", self.primary.port)

    @property
    def amqp_url(self) -> str:
        if self.broker_proxy is not None:
            return f"amqp://guest:guest@127.0.0.1:{self.broker_proxy.port}/"
        return self.cluster.urls

    @property
    def admin_url(self) -> str:
        if self.database_proxy is not None:
            return f"postgresql://postgres@127.0.0.1:{self.database_proxy.port}/postgres"
        ports = f"{self.primary.port},{self.standby.port}"
        return (
            "postgresql://postgres@/postgres?host=127.0.0.1,127.0.0.1"
            f"&port={ports}&target_session_attrs=read-write&connect_timeout=3"
        )

    def fail_over(self) -> None:
        """The primary crashes; the standby is promoted (and the Service follows it)."""
        self.primary.kill()
        self.standby.promote()
        if self.database_proxy is not None:
            self.database_proxy.upstreams = [("127.0.0.1", self.standby.port)]

    def stop(self) -> None:
        for proxy in (self.broker_proxy, self.database_proxy):
            if proxy is not None:
                proxy.close()
        self.cluster.stop()
        for server in (self.standby, self.primary):
            server.stop()


def leader(cluster: RabbitCluster, queue: str, timeout: float = 60.0) -> RabbitNode:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return cluster.leader(queue)
        except LookupError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class ClusterFaults(FaultInjector):
    """The four cluster faults; each records the wall-clock window of its disruption."""

    def __init__(self, servers: Servers, queue: str, outage: float, *args: Any) -> None:
        super().__init__(*args)
        self.servers = servers
        self.queue = queue
        self.outage = outage

    def inject(self, kind: FaultKind) -> dict[str, Any]:
        cluster = self.servers.cluster
        began = time.time()
        match kind:
            case FaultKind.LEADER_NODE_SIGKILL:
                node = leader(cluster, topology.in_queue(self.queue))
                node.kill()
                time.sleep(5.0)
                node.start()
                cluster.wait_healthy()
            case FaultKind.PRIMARY_FAILOVER:
                self.servers.fail_over()
                node = None
            case FaultKind.NODE_FREEZE:
                node = leader(cluster, topology.in_queue(self.queue))
                node.freeze()  # no socket closes: only heartbeats and net_ticktime tell
                time.sleep(self.outage)
                node.thaw()
            case FaultKind.RESULTS_NODE_DOWN:
                node = leader(cluster, topology.out_queue(self.queue))
                node.kill()
                time.sleep(self.outage)
                node.start()
            case _:
                raise ValueError(f"not a cluster fault: {kind}")
        ended = time.time()
        if kind in (FaultKind.NODE_FREEZE, FaultKind.RESULTS_NODE_DOWN):
            cluster.wait_healthy(240)  # a thawed node rejoins after autoheal restarts it
        return {
            "node": None if node is None else node.name,
            "window": [round(began, 3), round(ended, 3)],
            "healthy_after_s": round(time.time() - ended, 1),
        }


def stall(completions: Sequence[float], begin: float, end: float) -> float | None:
    """The longest time without a task completing, from the fault's start until the first
    completion after its end (seconds); None if nothing completed after its end."""
    after = sorted(t for t in completions if t > begin)
    closing = next((i for i, t in enumerate(after) if t > end), None)
    if closing is None:
        return None
    points = [begin, *after[: closing + 1]]
    return max(b - a for a, b in pairwise(points))


class ClusterChaosRun(ChaosRun):
    def __init__(self, servers: Servers, outage: float, config: ChaosConfig, log_dir: Path) -> None:
        self.servers = servers
        self.outage = outage
        super().__init__(config, log_dir)

    def start_servers(self) -> None:
        self.config.amqp_url = self.servers.amqp_url
        self.config.database_url = self.servers.admin_url

    def skipped(self) -> dict[str, str]:
        return {}

    def plan(self) -> FaultPlan:
        return FaultPlan(self.config.window, dict.fromkeys(CLUSTER_KINDS, 1), 0.0)

    def schedule(self) -> list[ScheduledFault]:
        return [ScheduledFault(at, kind) for kind, at in POINTS.items()]

    def make_injector(self, schedule: list[ScheduledFault]) -> FaultInjector:
        assert self.stack is not None and self.submitter is not None
        assert self.platform is not None
        return ClusterFaults(
            self.servers,
            self.platform.queue,
            self.outage,
            self.stack,
            schedule,
            self.config.tasks,
            self.submitter,
            self.rng,
            None,
            None,
        )

    def record(
        self, result: SubmitResult | None, verdict: verify.Verdict | None, settled: bool
    ) -> dict[str, Any]:
        out = super().record(result, verdict, settled)
        out["way"] = self.servers.way
        out["stalls_s"] = self._stalls()
        over = {
            kind: seconds
            for kind, seconds in out["stalls_s"].items()
            if seconds is None or seconds >= STALL_LIMITS.get(FaultKind(kind), float("inf"))
        }
        out["stall_limits_s"] = {k.value: v for k, v in STALL_LIMITS.items()}
        out["stalls_over_limit"] = over
        out["ok"] = out["ok"] and not over and len(out["stalls_s"]) == len(CLUSTER_KINDS)
        return out

    def _stalls(self) -> dict[str, float | None]:
        if self.injector is None or self.database_url is None or self.platform is None:
            return {}
        try:
            rows = infra.query(
                self.database_url,
                "SELECT extract(epoch FROM updated_at)::float8 FROM tasks"
                " WHERE service = %(s)s AND status IN ('SUCCESS', 'FAILURE')",
                {"s": self.platform.service},
            )
        except Exception as exc:
            log.warning("completion times unreadable: %r", exc)
            return {r.kind.value: None for r in self.injector.records}
        completions = [row[0] for row in rows]
        found: dict[str, float | None] = {}
        for record in self.injector.records:
            window = record.detail.get("window")
            seconds = stall(completions, *window) if window is not None else None
            found[record.kind.value] = None if seconds is None else round(seconds, 2)
        return found


def config_for(options: argparse.Namespace, way: str, report_path: Path) -> ChaosConfig:
    heartbeat = {"CONVEYOR_AMQP_HEARTBEAT": HEARTBEAT}
    return ChaosConfig(
        tasks=options.tasks,
        dispatchers=2,
        seed=options.seed,
        report=report_path,
        rate=options.rate,
        fail_rate=0.0,  # every task must end SUCCESS, exactly as the function answered
        hostile_fraction=0.0,
        hostile_hook_fraction=0.0,
        hard_timeout=options.hard_timeout,
        gateway_env=heartbeat,
        dispatcher_env=heartbeat,
        command=f"python -m bench.chaos.cluster ({way})",
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(prog="python -m bench.chaos.cluster")
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=3.5, help="submissions per second")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--outage", type=float, default=OUTAGE, help="seconds a frozen or stopped node is away"
    )
    parser.add_argument("--hard-timeout", type=float, default=1500.0, help="seconds per way")
    options = parser.parse_args(sys.argv[1:] if argv is None else argv)
    started = report.now()
    ways: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        for way in options.ways.split(","):
            print(f"chaos-cluster: {way}: starting 3 RabbitMQ nodes and a PostgreSQL pair")
            servers = Servers(way)
            try:
                config = config_for(options, way, Path(folder) / f"{way}.json")
                ways[way] = run(config, partial(ClusterChaosRun, servers, options.outage))
            finally:
                servers.stop()
    out = {
        "kind": "chaos-cluster",
        "ok": bool(ways) and all(w["ok"] for w in ways.values()),
        "date": started.isoformat(timespec="seconds"),
        "machine": report.machine(),
        "git": report.git_commit(),
        "command": " ".join(["python", "-m", "bench.chaos.cluster", *(argv or sys.argv[1:])]),
        "summary": {way: _summary(w) for way, w in ways.items()},
        "ways": ways,
    }
    path = report.write(out, report.RESULTS / f"chaos-cluster-{started:%Y%m%dT%H%M%SZ}.json")
    for way, numbers in out["summary"].items():
        print(f"chaos-cluster: {way}: {numbers}")
    print(f"chaos-cluster: {'PASS' if out['ok'] else 'FAIL'}; report: {path.name}")
    return 0 if out["ok"] else 1


def _summary(way: dict[str, Any]) -> dict[str, Any]:
    return {
        "ok": way["ok"],
        "accepted": way.get("accepted"),
        "lost": way.get("lost"),
        "stuck": way.get("stuck"),
        "wrong_outcome": way.get("wrong_outcome"),
        "statuses": way.get("statuses"),
        "callbacks": way.get("callbacks"),
        "stalls_s": way.get("stalls_s"),
        "error": way.get("error"),
    }


if __name__ == "__main__":
    sys.exit(main())
