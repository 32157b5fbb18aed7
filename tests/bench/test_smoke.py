"""The benchmarks in small, so that their code cannot rot: each runs for real against the
test run's servers and writes its result file (to a temporary folder). No timing is
asserted: figures are only meaningful from `make bench`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import REPO

pytestmark = pytest.mark.timeout(240)


def _run(module: str, *args: str, results: Path) -> dict:
    env = {**os.environ, "CONVEYOR_BENCH_RESULTS": str(results)}
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    written = sorted(results.glob("*.json"))
    assert written, done.stdout[-2000:]
    return json.loads(written[-1].read_text())


def test_submit_benchmark_runs(tmp_path: Path) -> None:
    result = _run(
        "bench.submit",
        "--duration",
        "1",
        "--reps",
        "1",
        "--warmup",
        "0.2",
        "--concurrency",
        "4",
        "--skip-auth",
        results=tmp_path,
    )
    assert {"machine", "git", "command"} <= set(result["meta"])
    assert result["levels"]
    # the gateway's collector, read from its /metrics: counted, and its pauses timed
    [level] = result["levels"]
    assert level["gateway_full_gc_per_10k_requests"] is not None
    assert level["gateway_gc_pause_ms_per_request"] is not None
    assert str(REPO) not in json.dumps(result)


def test_floor_benchmark_runs(tmp_path: Path) -> None:
    result = _run("bench.floor", "--tasks", "200", "--reps", "1", "--buffer", "2", results=tmp_path)
    consumers = result["consumers"]
    assert set(consumers) == {"dispatcher", "bare", "dispatcher+buffer"}
    assert all(c["throughput_tps"] for c in consumers.values())
    for kind in ("dispatcher", "dispatcher+buffer"):  # read from the dispatcher's /metrics
        assert 0 < consumers[kind]["slot_busy_fraction"] <= 1
        assert consumers[kind]["slot_idle_ms_per_task"] >= 0
    assert "slot_busy_fraction" not in consumers["bare"]


def test_apply_benchmark_runs(tmp_path: Path) -> None:
    result = _run(
        "bench.apply", "--events", "200", "--reps", "1", "--rate", "0,400", results=tmp_path
    )
    assert set(result["rates"]) == {"0.0", "400.0"}
    for run in result["runs"]:  # every event was applied: the run waits for 200 SUCCESS rows
        assert run["events"] == 200 and run["events_per_s"] > 0
        assert set(run["cpu_ms_per_event"]) == {"gateway", "postgresql", "rabbitmq"}


def test_scale_benchmark_runs(tmp_path: Path) -> None:
    # Its query plans run the gateway's own statements: a change of their parameters broke it
    # once without a test noticing (make bench only).
    result = _run(
        "bench.scale",
        "--levels",
        "1000",
        "--requests",
        "30",
        "--reps",
        "1",
        "--deep-backlog",
        "2000",
        results=tmp_path,
    )
    [level] = result["levels"]
    assert level["rows"] == 1000
    assert set(level["plans"]) == {
        "insert (with position)",
        "poll",
        "position",
        "capacity, service",
        "capacity, client",
        "reaper pass (expiry)",
    }
    assert all(plan["nodes"] for plan in level["plans"].values())
    deep = result["deep_backlog"]  # the backlog grew to 2,000 PENDING: submit and poll again
    assert deep["pending"] == 2000
    assert deep["submit"]["non_2xx"] == 0 and deep["poll_pending"]["non_2xx"] == 0
    assert set(result["p99_ratio_deep_backlog"]) == {"submit", "poll_pending"}


def test_end_to_end_benchmark_runs(tmp_path: Path) -> None:
    result = _run(
        "bench.e2e",
        "--tasks",
        "40",
        "--reps",
        "1",
        "--latency-samples",
        "5",
        "--peers",
        "conveyor",
        results=tmp_path,
    )
    assert result["peers"], result
    assert str(REPO) not in json.dumps(result)
    for run in result["runs"]:  # the idle probes' answers, split into commit and confirm
        phases = run["latency"]["gateway_phases_mean_ms"]
        assert phases["store"] > 0 and phases["publish"] > 0, phases


def test_streams_benchmark_runs(tmp_path: Path) -> None:
    result = _run(
        "bench.streams",
        "--streams",
        "20",
        "--duration",
        "0.5",
        "--reps",
        "1",
        "--concurrency",
        "2",
        results=tmp_path,
    )
    assert {run["gauge_during"] for run in result["runs"] if run["streams"]} == {20.0}
    assert result["gauge_after_all_closed"] == 0.0
    assert set(result["summary"]) == {"create", "poll"}


def test_batch_benchmark_runs(tmp_path: Path) -> None:
    result = _run(
        "bench.batch",
        "--size",
        "10",
        "--duration",
        "0.5",
        "--reps",
        "1",
        "--concurrency",
        "2",
        results=tmp_path,
    )
    assert {run["size"] for run in result["runs"]} == {1, 10}
    assert all(set(run["statuses"]) == {"201"} for run in result["runs"])


def test_tracing_benchmark_runs(tmp_path: Path) -> None:
    result = _run(
        "bench.tracing",
        "--duration",
        "0.5",
        "--reps",
        "1",
        "--warmup",
        "0.2",
        "--concurrency",
        "2",
        results=tmp_path,
    )
    (level,) = result["summary"]
    assert set(level) == {"concurrency", "off", "on", "on_over_off"}
    assert all(set(run["statuses"]) == {"201"} for run in result["runs"])
    assert result["spans_received"] > 0  # the `on` gateway did export
    assert str(REPO) not in json.dumps(result)


def test_admin_figures_benchmark_runs(tmp_path: Path) -> None:
    result = _run(
        "bench.admin_figures",
        "--finished",
        "2000",
        "--last-hour",
        "200",
        "--pending",
        "10",
        "--running",
        "2",
        "--reps",
        "1",
        results=tmp_path,
    )
    assert {"figures", "throughput_first", "throughput_then", "task_page"} <= set(result["queries"])
    assert all(q["plan"] for q in result["queries"].values())


def test_codec_benchmark_runs(tmp_path: Path) -> None:
    result = _run("bench.codec", "--reps", "1", "--number", "20", results=tmp_path)
    assert set(result["codec"]) == set(result["json"]) == {"small", "large"}
    assert result["codec"]["small"]["decode_event_us"] > 0


def test_wakeup_benchmark_runs(tmp_path: Path) -> None:
    result = _run("bench.wakeup", "--samples", "3", "--gaps", "0,0.01", results=tmp_path)
    figures = result["round_trip_ms"]
    assert set(figures) == {
        "select_1",
        "insert_commit",
        "confirmed_publish_quorum",
        "confirmed_publish_classic",
    }
    assert all(by_gap[gap]["n"] == 3 for by_gap in figures.values() for gap in ("0.0", "0.01"))


def test_footprint_benchmark_runs(tmp_path: Path) -> None:
    """Its figures of record come from a venv as the dispatcher's image makes one."""
    result = _run(
        "bench.footprint",
        "--starts",
        "1",
        "--settle",
        "0.2",
        "--load-tasks",
        "50",
        results=tmp_path,
    )
    assert result["shipped"] == {"built": True}
    shipped = result["entrypoints"]["conveyor dispatcher, as its image installs it"]
    assert result["idle_rss_mib"] == shipped["idle_rss_mib"]
    assert shipped["under_load"]["finished"]
    assert str(REPO) not in json.dumps(result)
