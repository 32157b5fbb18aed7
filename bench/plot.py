"""Draws `bench/results/bench.png` from the newest results: throughput and latency.

Four panels: end-to-end tasks/s (Conveyor, Celery, and the floor consumers),
submit -> start latency (p50 and p99), gateway submit throughput and p99 by
concurrency, and submit/poll p99 by number of stored tasks. matplotlib with the
Agg backend (no display needed).

    python -m bench.plot
"""

from __future__ import annotations

import sys
from typing import Any

from bench.record import RESULTS
from bench.report import load


def _bars(ax: Any, labels: list[str], values: list[float | None], title: str, unit: str) -> None:
    heights = [v or 0 for v in values]
    bars = ax.bar(range(len(labels)), heights, color="#4c72b0")
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    for bar, value in zip(bars, values, strict=True):
        if value is not None:
            ax.annotate(
                f"{value:.0f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )


def throughput(ax: Any, e2e: dict[str, Any] | None, floor: dict[str, Any] | None) -> None:
    labels, values = [], []
    for peer, data in ((e2e or {}).get("peers") or {}).items():
        labels.append(peer)
        values.append(data.get("throughput_tps"))
    for kind, data in ((floor or {}).get("consumers") or {}).items():
        labels.append(f"floor: {kind}")
        values.append(data.get("throughput_tps"))
    _bars(ax, labels, values, "tasks/s (end to end; floor: pre-loaded queue)", "tasks/s")


def latency(ax: Any, e2e: dict[str, Any] | None) -> None:
    peers = (e2e or {}).get("peers") or {}
    names = list(peers)
    x = range(len(names))
    p50 = [peers[n].get("latency_p50_ms") or 0 for n in names]
    p99 = [peers[n].get("latency_p99_ms") or 0 for n in names]
    ax.bar([i - 0.2 for i in x], p50, width=0.4, label="p50", color="#55a868")
    ax.bar([i + 0.2 for i in x], p99, width=0.4, label="p99", color="#c44e52")
    ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
    ax.set_title("submit answered -> function invoked, idle", fontsize=10)
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)


def submit(ax: Any, result: dict[str, Any] | None) -> None:
    levels = (result or {}).get("levels") or []
    concurrency = [lvl["concurrency"] for lvl in levels]
    ax.plot(concurrency, [lvl["throughput_rps"] or 0 for lvl in levels], "o-", color="#4c72b0")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("POST/s", color="#4c72b0")
    ax.set_title("gateway submit", fontsize=10)
    twin = ax.twinx()
    twin.plot(concurrency, [lvl["p99_ms"] or 0 for lvl in levels], "s--", color="#c44e52")
    twin.set_ylabel("p99 ms", color="#c44e52")


def scale(ax: Any, result: dict[str, Any] | None) -> None:
    levels = (result or {}).get("levels") or []
    rows = [lvl["rows"] for lvl in levels]
    for kind, style in (("submit", "o-"), ("poll_finished", "s-"), ("poll_pending", "^-")):
        ax.plot(rows, [lvl[kind]["p99_ms"] or 0 for lvl in levels], style, label=kind)
    ax.set_xscale("log")
    ax.set_xlabel("stored tasks")
    ax.set_ylabel("p99 ms")
    ax.set_title("latency by table size (4 clients)", fontsize=10)
    ax.legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = {name: load(name) for name in ("submit", "e2e", "floor", "scale")}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    throughput(axes[0][0], found["e2e"], found["floor"])
    latency(axes[0][1], found["e2e"])
    submit(axes[1][0], found["submit"])
    scale(axes[1][1], found["scale"])
    meta = next((r["meta"] for r in found.values() if r), {})
    fig.suptitle(f"Conveyor benchmarks — {meta.get('date', '')}", fontsize=11)
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.savefig(RESULTS / "bench.png", dpi=100)
    print("wrote bench/results/bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
