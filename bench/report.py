"""The summary of the latest results against SPEC §10's targets, as a markdown table.

Reads the newest `bench/results/<name>-*.json` of each benchmark, prints the
table and writes it to `bench/results/summary.md`. A target is "met" or
"missed", with the margin: how far the measured value is from the target,
relative to the target.

    python -m bench.report
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.record import RESULTS, latest_result
from bench.stats import median


@dataclass(frozen=True)
class Row:
    what: str
    measured: float | None
    target: float
    higher_is_better: bool
    unit: str = ""
    note: str = ""

    def verdict(self) -> str:
        if self.measured is None:
            return "not measured"
        if self.higher_is_better:
            change = self.measured / self.target - 1
            return f"met (+{change:.0%})" if change >= 0 else f"missed ({change:.0%})"
        if not self.target:  # a count that must be zero
            return "met" if self.measured <= 0 else f"missed ({self.measured:g})"
        times = self.measured / self.target
        if times <= 1:
            return f"met ({1 - times:.0%} under)"
        return (
            f"missed ({times - 1:.0%} over)" if times < 3 else f"missed ({times:.1f}x the target)"
        )

    def line(self) -> str:
        measured = "-" if self.measured is None else f"{_number(self.measured)}{self.unit}"
        sign = "≥" if self.higher_is_better else "≤"
        note = f" {self.note}" if self.note else ""
        target = f"{sign} {_number(self.target)}{self.unit}"
        return f"| {self.what} | {measured} | {target} | {self.verdict()}{note} |"


def _number(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def load(name: str, folder: Path = RESULTS) -> dict[str, Any] | None:
    path = latest_result(name, folder)
    return None if path is None else json.loads(path.read_text()) | {"_file": path.name}


def _get(data: dict[str, Any] | None, *keys: Any) -> Any:
    for key in keys:
        if data is None:
            return None
        data = data.get(key) if isinstance(data, dict) else None
    return data


def submit_rows(submit: dict[str, Any] | None) -> list[Row]:
    levels = {lvl["concurrency"]: lvl for lvl in (_get(submit, "levels") or [])}
    top = levels.get(64) or (levels[max(levels)] if levels else None)
    best = max((lvl["throughput_rps"] or 0 for lvl in levels.values()), default=None)
    return [
        Row(
            "gateway POST throughput, 64 clients",
            _get(top, "throughput_rps"),
            1000,
            True,
            " /s",
            f"(best level: {best:,.0f}/s)" if best else "",
        ),
        Row("gateway POST p99, 64 clients", _get(top, "p99_ms"), 50, False, " ms"),
    ]


def e2e_rows(e2e: dict[str, Any] | None) -> list[Row]:
    rows = []
    for name, value in (_get(e2e, "ratios") or {}).items():
        peer = name.split("/")[0]
        tps = _get(e2e, "peers", peer, "throughput_tps")
        rows.append(
            Row(
                f"end-to-end {peer} / Celery",
                value,
                1.5,
                True,
                "x",
                f"({tps} tasks/s)" if tps else "",
            )
        )
    for peer, data in (_get(e2e, "peers") or {}).items():
        if peer.startswith("conveyor"):
            rows.append(Row(f"submit → start p50, {peer}", data["latency_p50_ms"], 5, False, " ms"))
            rows.append(
                Row(f"submit → start p99, {peer}", data["latency_p99_ms"], 15, False, " ms")
            )
    return rows or [Row("end-to-end Conveyor / Celery", None, 1.5, True, "x")]


def floor_rows(floor: dict[str, Any] | None) -> list[Row]:
    bare = _get(floor, "consumers", "bare", "throughput_tps")
    return [
        Row(
            "dispatcher / bare aio-pika consumer",
            _get(floor, "ratio_dispatcher_to_bare"),
            0.8,
            True,
            "x",
            f"(bare: {bare} tasks/s)" if bare else "",
        )
    ]


def footprint_rows(footprint: dict[str, Any] | None) -> list[Row]:
    rss_mib = _get(footprint, "idle_rss_mib", "median")
    # SPEC §10 says 50 MB: compared in megabytes (10^6 bytes), i.e. 47.7 MiB.
    rss_mb = None if rss_mib is None else round(rss_mib * 1.048576, 1)
    return [
        Row("dispatcher RSS, idle", rss_mb, 50, False, " MB"),
        Row(
            "dispatcher start → ready",
            _get(footprint, "start_to_ready_s", "median"),
            1,
            False,
            " s",
        ),
    ]


def scale_rows(scale: dict[str, Any] | None) -> list[Row]:
    levels = _get(scale, "levels") or []
    rows = []
    span = f"({levels[-1]['rows']:,} vs {levels[0]['rows']:,} rows)" if len(levels) > 1 else ""
    for kind in ("submit", "poll_finished", "poll_pending"):
        value = _get(scale, "p99_ratio_largest_to_smallest", kind)
        rows.append(Row(f"scale: {kind} p99 ratio", value, 1.5, False, "x", span))
    deep = _get(scale, "deep_backlog", "pending")
    if deep:
        for kind in ("submit", "poll_pending"):
            value = _get(scale, "p99_ratio_deep_backlog", kind)
            label = f"({deep:,} PENDING vs 100, {levels[-1]['rows']:,} rows)" if levels else ""
            rows.append(
                Row(f"scale: {kind} p99, deep backlog ratio", value, 1.5, False, "x", label)
            )
    seq = [
        f"{lvl['rows']:,}: {name}"
        for lvl in levels
        for name, plan in lvl.get("plans", {}).items()
        if plan.get("seq_scan_on_tasks")
    ]
    rows.append(
        Row(
            "scale: plans with a Seq Scan on tasks",
            float(len(seq)) if levels else None,
            0,
            False,
            "",
            "; ".join(seq),
        )
    )
    return rows


def _maybe(value: float | None) -> str:
    return "-" if value is None else _number(value)


def reference_lines(e2e: dict[str, Any] | None, floor: dict[str, Any] | None) -> list[str]:
    lines = [
        "| system | throughput, concurrency 4 | submit → start, idle (p50 / p99) | CPU ms/task |",
        "|---|---|---|---|",
    ]
    for peer, data in (_get(e2e, "peers") or {}).items():
        lines.append(
            f"| {peer} | {_maybe(data['throughput_tps'])} tasks/s |"
            f" {_maybe(data['latency_p50_ms'])} / {_maybe(data['latency_p99_ms'])} ms |"
            f" {_maybe(data.get('platform_cpu_ms_per_task'))} |"
        )
    for kind, data in (_get(floor, "consumers") or {}).items():
        lines.append(
            f"| floor: {kind} (pre-loaded queue) | {_maybe(data['throughput_tps'])} tasks/s | - |"
            f" {_maybe(data.get('cpu_ms_per_task'))} |"
        )
    return lines


_PARTS = ("gateway", "dispatchers", "workers", "function", "postgresql", "rabbitmq", "total")


def cpu_breakdown_lines(e2e: dict[str, Any] | None) -> list[str]:
    """Median CPU ms per task of each part, servers included, per end-to-end peer."""
    by_peer: dict[str, list[dict[str, float]]] = {}
    for run in _get(e2e, "runs") or []:
        if run.get("cpu_ms_per_task_by_process"):
            by_peer.setdefault(run["peer"], []).append(run["cpu_ms_per_task_by_process"])
    if not by_peer:
        return []
    lines = [
        "| CPU ms per task (end to end, medians) | gateway | dispatchers / workers | function"
        " | PostgreSQL | RabbitMQ | total |",
        "|---|---|---|---|---|---|---|",
    ]
    for peer, runs in by_peer.items():
        parts = {name: median(r.get(name) for r in runs) for name in _PARTS}
        runner = parts["dispatchers"] if parts["dispatchers"] is not None else parts["workers"]
        cells = [parts["gateway"], runner, parts["function"], parts["postgresql"]]
        cells += [parts["rabbitmq"], parts["total"]]
        lines.append(f"| {peer} | " + " | ".join(_maybe(c) for c in cells) + " |")
    return ["", *lines]


def markdown(folder: Path = RESULTS) -> str:
    found = {name: load(name, folder) for name in ("submit", "e2e", "floor", "footprint", "scale")}
    builders: list[Callable[[Any], list[Row]]] = [
        submit_rows,
        e2e_rows,
        floor_rows,
        footprint_rows,
        scale_rows,
    ]
    names = ["submit", "e2e", "floor", "footprint", "scale"]
    rows = [row for name, build in zip(names, builders, strict=True) for row in build(found[name])]
    meta = next((r["meta"] for r in found.values() if r), {})
    machine = meta.get("machine", {})
    lines = [
        "| target (SPEC §10) | measured | target | verdict |",
        "|---|---|---|---|",
        *(row.line() for row in rows),
        "| faults: lost or stuck tasks | see `make chaos` | 0 | bench/results/chaos-*.json |",
        "",
        *reference_lines(found["e2e"], found["floor"]),
        *cpu_breakdown_lines(found["e2e"]),
        "",
        f"Machine: {machine.get('cores')} cores, {machine.get('memory_mib')} MiB,"
        f" {machine.get('cpu')}, Python {machine.get('python')}, kernel {machine.get('kernel')};"
        f" load average at start {machine.get('load_average')}.",
        f"Commit {(meta.get('git') or {}).get('commit')}; files: "
        + ", ".join(r["_file"] for r in found.values() if r),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    text = markdown()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
