"""The chaos run from start to end, and its command line.

    set up     own database (migrated), own service and client, own queues;
               gateway, sleeper function, dispatchers, callback receiver
    storm      submit N tasks at a steady rate while the injector runs the
               fault schedule (dispatcher SIGKILL/SIGTERM, function SIGKILL,
               RabbitMQ and PostgreSQL restarts and SIGKILLs, gateway SIGKILL
               mid-burst)
    settle     wait until every task is terminal, notified and `-in` is empty
    verify     stop the dispatchers, then check everything (verify.py)
    report     bench/results/chaos-<timestamp>.json and a summary table
    tear down  kill every process started, including the run's own RabbitMQ
               node and PostgreSQL cluster (the shared servers are never touched)

A watchdog bounds the whole run (`--hard-timeout`): when it fires, every
process is killed and the run reports a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.chaos import infra, report, verify
from bench.chaos.callbacks import CallbackReceiver
from bench.chaos.config import ChaosConfig, FaultKind, FaultPlan, ScheduledFault
from bench.chaos.faults import FaultInjector
from bench.chaos.stack import Stack
from bench.chaos.submitter import Gate, SubmitResult, Submitter, make_specs
from conveyor import topology
from gateway.migrate import drop_database

log = logging.getLogger("bench.chaos")


class ChaosRun:
    def __init__(self, config: ChaosConfig, log_dir: Path) -> None:
        self.config = config
        self.seed = config.seed if config.seed is not None else random.randrange(2**31)
        self.rng = random.Random(self.seed)
        self.log_dir = log_dir
        self.stop = threading.Event()
        self.timed_out = False
        self.began = time.monotonic()
        self.database_url: str | None = None
        self.platform: infra.PlatformData | None = None
        self.stack: Stack | None = None
        self.receiver = CallbackReceiver()
        self.submitter: Submitter | None = None
        self.injector: FaultInjector | None = None
        self.blockers: dict[str, str] = {}
        self.rabbitmq: infra.RabbitMQ | None = None
        self.postgres: infra.PostgreSQL | None = None
        self.start_servers()
        self.timings: dict[str, float | None] = {}
        self.dispatcher_exits: list[int | None] = []

    def start_servers(self) -> None:
        """The run's own servers, so that it can restart and kill them; without them it uses
        the configured ones and injects no server fault."""
        self.blockers = infra.private_servers_missing()
        self.rabbitmq = None if "rabbitmq" in self.blockers else infra.RabbitMQ()
        self.postgres = None if "postgres" in self.blockers else infra.PostgreSQL()
        if self.rabbitmq is not None:
            self.config.amqp_url = self.rabbitmq.url
        if self.postgres is not None:
            self.config.database_url = self.postgres.admin_url

    # -- phases ------------------------------------------------------------------

    def skipped(self) -> dict[str, str]:
        reasons = {k.value: "not in the plan (--skip)" for k in self.config.skip}
        if self.rabbitmq is None:
            for kind in (FaultKind.RABBITMQ_RESTART, FaultKind.RABBITMQ_SIGKILL):
                reasons[kind.value] = self.blockers["rabbitmq"]
        if self.postgres is None:
            for kind in (FaultKind.POSTGRES_RESTART, FaultKind.POSTGRES_SIGKILL):
                reasons[kind.value] = self.blockers["postgres"]
        if self.rabbitmq is None or self.postgres is None:
            reasons[FaultKind.OVERLAPPING.value] = "needs both private servers"
        return reasons

    def plan(self) -> FaultPlan:
        blocked = tuple(FaultKind(k) for k in self.skipped())
        return self.config.fault_plan().without(blocked)

    def set_up(self) -> None:
        print(f"chaos: seed {self.seed}, logs in {self.log_dir}", flush=True)
        self.database_url = infra.create_database(self.config.database_url)
        self.platform = infra.apply_platform(self.database_url, self.config.amqp_url)
        self.receiver.start()
        self.stack = Stack(self.config, self.database_url, self.platform, self.log_dir)
        self.stack.start()
        self.timings["set_up_s"] = time.monotonic() - self.began
        print(f"chaos: stack up in {self.timings['set_up_s']:.1f}s", flush=True)

    def storm(self) -> SubmitResult:
        assert self.stack is not None and self.platform is not None
        c = self.config
        specs = make_specs(
            c.tasks,
            uuid.uuid4().hex[:8],
            self.rng,
            fail_rate=c.fail_rate,
            max_sleep=c.max_sleep,
            callback_fraction=c.callback_fraction,
            repeat_fraction=c.repeat_fraction,
            keyless_fraction=c.keyless_fraction,
            hostile_fraction=c.hostile_fraction,
            hostile_hook_fraction=c.hostile_hook_fraction,
        )
        self.submitter = Submitter(
            self.stack.gateway_url,
            self.platform.service,
            (self.platform.client_id, self.platform.secret),
            self.receiver.url_for,
            concurrency=c.submit_concurrency,
            rate=c.rate,
            retry_budget=c.retry_budget,
        )
        schedule = self.schedule()
        self.injector = self.make_injector(schedule)
        self.submitter.gate.limit = int(schedule[0].at * c.tasks) if schedule else Gate.OPEN
        print(f"chaos: submitting {c.tasks} tasks, {len(schedule)} faults scheduled", flush=True)
        self.injector.start()
        result = asyncio.run(self.submitter.run(specs))
        self.timings["submissions_s"] = _since(result.first_submit, result.last_accept)
        print(
            f"chaos: {len(result.accepted)} accepted in {self.timings['submissions_s']}s;"
            " waiting for the remaining faults",
            flush=True,
        )
        self.injector.join(max(0.0, self._time_left()))
        return result

    def schedule(self) -> list[ScheduledFault]:
        return self.plan().schedule(self.rng)

    def make_injector(self, schedule: list[ScheduledFault]) -> FaultInjector:
        assert self.stack is not None and self.submitter is not None
        return FaultInjector(
            self.stack,
            schedule,
            self.config.tasks,
            self.submitter,
            self.rng,
            self.rabbitmq,
            self.postgres,
        )

    def settle(self, result: SubmitResult) -> bool:
        assert self.database_url is not None and self.platform is not None
        timeout = min(self.config.drain_seconds(), max(0.0, self._time_left() - 60))
        settled, terminal_at = verify.wait_until_settled(
            self.database_url,
            self.config.amqp_url,
            self.platform.service,
            self.platform.queue,
            timeout,
            self.stop,
            len(result.accepted),
        )
        self.timings["time_to_drain_s"] = _since(result.last_accept, terminal_at)
        if settled:  # every notification recorded too, and `-in` empty
            self.timings["time_to_settle_s"] = _since(result.last_accept, time.monotonic())
        return settled

    def check(self, result: SubmitResult) -> verify.Verdict:
        assert self.stack is not None and self.database_url and self.platform is not None
        self.dispatcher_exits = self.stack.stop_dispatchers()
        queue = self.platform.queue
        in_state = infra.queue_state(self.config.amqp_url, topology.in_queue(queue))
        dlq_state = infra.queue_state(self.config.amqp_url, topology.dead_letter_queue(queue))
        return verify.verify(
            self.database_url,
            self.platform.service,
            result,
            self.stack.call_log,
            self.config.fail_rate,
            self.receiver.snapshot(),
            in_state,
            dlq_state,
        )

    def tear_down(self) -> None:
        self.receiver.stop()
        if self.stack is not None:
            self.stack.kill_all()
        if self.database_url is not None and self.postgres is None:
            try:
                drop_database(self.database_url)
            except Exception as exc:
                print(f"chaos: could not drop the database: {exc!r}", flush=True)
        if self.platform is not None and self.rabbitmq is None:
            infra.delete_queues(self.config.amqp_url, self.platform.queue)
        for server in (self.rabbitmq, self.postgres):
            if server is not None:
                server.stop()  # the run's own: its data goes with it

    # -- the watchdog --------------------------------------------------------------

    def _time_left(self) -> float:
        return self.began + self.config.hard_seconds() - time.monotonic()

    def on_hard_timeout(self) -> None:
        self.timed_out = True
        self.stop.set()
        print("chaos: hard timeout reached; killing everything", flush=True)
        if self.submitter is not None:
            self.submitter.stop.set()
        if self.injector is not None:
            self.injector.stop.set()
        if self.stack is not None:
            self.stack.kill_all()

    # -- the record ------------------------------------------------------------------

    def record(
        self, result: SubmitResult | None, verdict: verify.Verdict | None, settled: bool
    ) -> dict[str, Any]:
        c = self.config
        out: dict[str, Any] = {
            "kind": "chaos",
            "ok": bool(verdict and verdict.ok and settled and not self.timed_out),
            "date": None,
            "machine": report.machine(),
            "git": report.git_commit(),
            "command": c.command,
            "seed": self.seed,
            "tasks": c.tasks,
            "dispatchers": c.dispatchers,
            "settings": _settings(c, self.plan()),
        }
        if result is not None:
            out.update(_submission_numbers(result))
        if verdict is not None:
            out.update(_verdict_numbers(verdict))
        out["faults"] = dict(self.injector.counts) if self.injector else {}
        out["faults_skipped"] = self.skipped()
        out["fault_errors"] = self.injector.errors if self.injector else []
        out["fault_log"] = [_fault_row(r) for r in self.injector.records] if self.injector else []
        out["dispatcher_exit_codes"] = _exit_codes(self.stack, self.dispatcher_exits)
        out["settled"] = settled
        out["timed_out"] = self.timed_out
        out.update({k: _round(v) for k, v in self.timings.items()})
        out["duration_s"] = round(time.monotonic() - self.began, 1)
        return out


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(max(0.0, end - start), 2)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _settings(c: ChaosConfig, plan: FaultPlan) -> dict[str, Any]:
    return {
        "rate_per_s": c.rate,
        "submit_concurrency": c.submit_concurrency,
        "dispatcher_concurrency": c.dispatcher_concurrency,
        "dispatcher_drain_timeout_s": c.drain_timeout_setting,
        "callback_fraction": c.callback_fraction,
        "repeat_fraction": c.repeat_fraction,
        "keyless_fraction": c.keyless_fraction,
        "hostile_fraction": c.hostile_fraction,
        "hostile_hook_fraction": c.hostile_hook_fraction,
        "fail_rate": c.fail_rate,
        "max_sleep_s": c.max_sleep,
        "service": {"maxAttempts": 3, "taskTimeout": 30, "capacity": None},
        "plan": {
            "window_s": round(plan.window, 1),
            "per_kind": {k.value: n for k, n in plan.counts.items()},
            "dispatcher_kill_interval_s": plan.dispatcher_kill_interval,
        },
    }


def _submission_numbers(result: SubmitResult) -> dict[str, Any]:
    return {
        "accepted": len(result.accepted),
        "submissions": {
            "answers": dict(result.answers),
            "retried_keys": result.retried,
            "found_after_failure": result.found_after_failure,
            "abandoned": len(result.abandoned),
            "rejected": len(result.rejected),
            "rejected_statuses": sorted(set(result.rejected.values())),
        },
    }


def _verdict_numbers(v: verify.Verdict) -> dict[str, Any]:
    return {
        "rows": v.rows,
        "rows_never_acknowledged": v.rows_never_acknowledged,
        "keyless": v.keyless,
        "hostile_outcomes": v.hostile,
        "statuses": v.statuses,
        "lost": len(v.lost),
        "stuck": len(v.stuck),
        "wrong_outcome": len(v.wrong_outcome),
        "unexpected_failure_reasons": v.unexpected_failure_reasons,
        "in_queue": v.in_queue,
        "in_queue_empty": v.in_queue_empty,
        "dead_lettered": v.dead_lettered,
        "idempotency_holds": v.idempotent,
        "idempotency": v.idempotency,
        "notification_statuses_set": v.notifications_set,
        "duplicates": v.duplicates,
        "callbacks": v.callbacks,
        "attempts_per_task": v.attempts,
        "backlog_counts": v.backlog,
        "backlog_counts_exact": v.backlog_exact,
        "samples": {
            "lost": v.lost[: verify.SAMPLE],
            "stuck": v.stuck[: verify.SAMPLE],
            "wrong_outcome": v.wrong_outcome[: verify.SAMPLE],
        },
    }


def _fault_row(record: Any) -> dict[str, Any]:
    row = asdict(record)
    row["kind"] = record.kind.value
    row["duration"] = round(record.duration, 2)
    return row


def _exit_codes(stack: Stack | None, final: list[int | None]) -> dict[str, Any]:
    during = [code for slot in stack.slots for code in slot.exits] if stack else []
    return {"sigterm_during_run": during, "final_stop": final}


# ---------------------------------------------------------------------------
# entry points


def run(
    config: ChaosConfig, kind: Callable[[ChaosConfig, Path], ChaosRun] = ChaosRun
) -> dict[str, Any]:
    """One chaos run; returns the report (also written to disk and summarized)."""
    started = report.now()
    log_dir = config.keep_logs or Path(tempfile.mkdtemp(prefix="chaos-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    chaos = kind(config, log_dir)
    watchdog = threading.Timer(config.hard_seconds(), chaos.on_hard_timeout)
    watchdog.daemon = True
    watchdog.start()
    result: SubmitResult | None = None
    verdict: verify.Verdict | None = None
    settled = False
    error: str | None = None
    try:
        chaos.set_up()
        result = chaos.storm()
        settled = chaos.settle(result)
        verdict = chaos.check(result)
    except Exception as exc:
        log.exception("chaos run failed")
        error = repr(exc)[:4000]
        if chaos.stack is not None:
            print(chaos.stack.tails(), flush=True)
    finally:
        watchdog.cancel()
        out = chaos.record(result, verdict, settled)
        chaos.tear_down()
    out["date"] = started.isoformat(timespec="seconds")
    out["error"] = error
    out["ok"] = out["ok"] and error is None
    path = report.write(out, config.report or report.default_path(started))
    print(report.summary(out), flush=True)
    print(f"report: {_display(path)}", flush=True)
    if out["ok"] and config.keep_logs is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        print(f"logs kept in {log_dir}", flush=True)
    return out


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def parse_args(argv: list[str] | None) -> ChaosConfig:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[0])
    d = ChaosConfig()
    p.add_argument("--tasks", type=int, default=d.tasks)
    p.add_argument("--dispatchers", type=int, default=d.dispatchers)
    p.add_argument("--seed", type=int)
    p.add_argument("--report", type=Path, help="default: bench/results/chaos-<timestamp>.json")
    p.add_argument("--database-url", default=d.database_url, help="admin URL (creates our DB)")
    p.add_argument("--amqp-url", default=d.amqp_url)
    p.add_argument("--rate", type=float, default=d.rate, help="submissions per second")
    p.add_argument("--concurrency", type=int, default=d.submit_concurrency)
    p.add_argument("--skip", action="append", default=[], choices=[k.value for k in FaultKind])
    p.add_argument("--drain-timeout", type=float, help="seconds to wait for terminal states")
    p.add_argument("--hard-timeout", type=float, help="seconds for the whole run")
    p.add_argument("--keep-logs", type=Path, help="write process logs here and keep them")
    args = p.parse_args(argv)
    return ChaosConfig(
        tasks=args.tasks,
        dispatchers=args.dispatchers,
        seed=args.seed,
        report=args.report,
        database_url=args.database_url,
        amqp_url=args.amqp_url,
        rate=args.rate,
        submit_concurrency=args.concurrency,
        skip=tuple(FaultKind(k) for k in args.skip),
        drain_limit=args.drain_timeout,
        hard_timeout=args.hard_timeout,
        keep_logs=args.keep_logs,
        command=" ".join(["python", "-m", "bench.chaos", *(argv or [])]),
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.chaos ...`: exit code 0 only when nothing was lost or stuck."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = parse_args(sys.argv[1:] if argv is None else argv)
    return 0 if run(config)["ok"] else 1
