"""The run's record: a JSON file in bench/results/ and a summary table on stdout.

The record names the machine, the date, the git commit and the exact command,
as SPEC §10 asks of every result. It holds no absolute path and no secret.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"


def machine() -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def git_commit() -> dict[str, Any]:
    repo = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=False
        )
        return done.stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def default_path(started: datetime) -> Path:
    return RESULTS / f"chaos-{started.strftime('%Y%m%dT%H%M%SZ')}.json"


def write(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")
    return path


def now() -> datetime:
    return datetime.now(UTC)


def summary(report: dict[str, Any]) -> str:
    """A two-column table of the numbers that matter."""
    dup = report.get("duplicates", {})
    cb = report.get("callbacks", {})
    rows = [
        ("result", "PASS" if report.get("ok") else "FAIL"),
        ("tasks (N)", report.get("tasks")),
        ("accepted", report.get("accepted")),
        ("rows in database", report.get("rows")),
        ("lost", report.get("lost")),
        ("stuck", report.get("stuck")),
        ("wrong outcome", report.get("wrong_outcome")),
        ("statuses", report.get("statuses")),
        ("-in empty", report.get("in_queue_empty")),
        ("idempotency holds", report.get("idempotency_holds")),
        ("backlog counts exact", report.get("backlog_counts_exact")),
        ("abandoned submissions", report.get("submissions", {}).get("abandoned")),
        ("keyless (accepted/no answer)", _pair(report.get("keyless"), "accepted", "no_answer")),
        ("hostile function outcomes", report.get("hostile_outcomes")),
        ("hostile callback targets", cb.get("hostile_targets")),
        ("well-behaved callbacks lost", len(cb.get("well_behaved_not_delivered") or [])),
        ("tasks called > once", dup.get("tasks_called_more_than_once")),
        ("extra calls", dup.get("extra_calls")),
        ("callbacks expected/received", f"{cb.get('expected')}/{cb.get('received_tasks')}"),
        ("notification status", cb.get("notification_status")),
        ("faults", report.get("faults")),
        ("time to drain (s)", report.get("time_to_drain_s")),
        ("time to settle (s)", report.get("time_to_settle_s")),
        ("gateway answers", report.get("submissions", {}).get("answers")),
        ("total duration (s)", report.get("duration_s")),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _pair(values: dict[str, Any] | None, first: str, second: str) -> str:
    values = values or {}
    return f"{values.get(first)}/{values.get(second)}"
