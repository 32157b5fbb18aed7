"""The chaos run in small: 300 tasks through every kind of fault, nothing lost or stuck.

The same code as `make chaos` (bench.chaos), with a compressed schedule that
still injects each fault kind at least once: dispatcher SIGKILL, SIGTERM in
requeue and in drain mode, function SIGKILL, RabbitMQ restart and SIGKILL,
PostgreSQL restart and SIGKILL, and a gateway SIGKILL in the middle of a burst
of submissions. The run starts its own RabbitMQ node and PostgreSQL cluster and
breaks only those.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.chaos import ChaosConfig, FaultKind, FaultPlan, run
from bench.chaos.config import SPARSE_KINDS

pytestmark = pytest.mark.timeout(240)

TASKS = 300
RATE = 20.0  # a 15 s nominal window: faults land between 5 % and 90 % of the submissions


def test_nothing_is_lost_or_stuck_through_every_kind_of_fault(tmp_path: Path) -> None:
    config = ChaosConfig(
        tasks=TASKS,
        rate=RATE,
        seed=20250423,
        report=tmp_path / "chaos.json",
        plan=FaultPlan.for_window(TASKS / RATE, per_kind=1, kill_interval=5.0),
        drain_limit=90.0,
        hard_timeout=170.0,
        keep_logs=tmp_path / "logs",
        command="pytest tests/chaos/test_chaos_small.py",
        hostile_fraction=0.06,  # every hostile kind, a few times, in 300 tasks
    )
    report = run(config)
    summary = json.dumps({k: v for k, v in report.items() if k != "fault_log"}, indent=1)

    assert report["error"] is None, summary
    assert not report["timed_out"], summary
    # Keyless submissions are not retried when the answer is lost (a retry could make a second
    # task): those are neither accepted nor lost.
    assert report["accepted"] + report["keyless"]["no_answer"] == TASKS, summary
    assert report["keyless"]["accepted"] > 0, summary
    assert {kind.split()[0] for kind in report["hostile_outcomes"]} == {
        "nul",
        "deep",
        "huge",
        "trickle",
    }, summary
    assert not report["callbacks"]["well_behaved_not_delivered"], summary
    assert report["lost"] == 0, summary
    assert report["stuck"] == 0, summary
    assert report["wrong_outcome"] == 0, summary
    assert report["in_queue_empty"], summary
    assert report["idempotency_holds"], summary
    assert report["idempotency"]["keys_with_several_rows"] == 0, summary
    assert report["notification_statuses_set"], summary
    assert report["callbacks"]["expected"] > 0, summary
    assert not report["fault_errors"], summary
    # A database outage is a 503 (retry), never a 500: see test_database_down.py.
    assert "500" not in report["submissions"]["answers"], summary
    planned = {*SPARSE_KINDS, FaultKind.DISPATCHER_SIGKILL}  # the cluster kinds are elsewhere
    expected = {k.value for k in planned} - set(report["faults_skipped"])
    assert {k for k, n in report["faults"].items() if n > 0} == expected, summary
    gateway_kills = [f for f in report["fault_log"] if f["kind"] == "gateway_sigkill"]
    assert any(f["detail"].get("in_flight_at_kill", 0) > 0 for f in gateway_kills), summary
    assert report["ok"], summary
