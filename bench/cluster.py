"""End to end on a 3-node RabbitMQ cluster against one node, in the same run (SPEC §11.7).

Starts a private RabbitMQ node and a private 3-node cluster (tests/support/servers.py, other
ports, own data, stopped at the end), then runs `bench.e2e`'s Conveyor peer against each in
turn, alternating, `--reps` times: the single node by its URL, the cluster by its node list.
Records the medians and the ratio cluster/single (target: at least 0.7).

    python -m bench.cluster [--tasks 2000] [--reps 2] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.record import PYTHON, REPO, banner, metadata, no_paths, write_result
from bench.stats import median, ratio
from tests.support.servers import RabbitCluster, RabbitNode

TARGETS = ("single", "cluster")


def run_e2e(amqp_url: str, options: argparse.Namespace) -> dict[str, Any]:
    """One `bench.e2e` run of one Conveyor peer against `amqp_url`; its peer summary."""
    with tempfile.TemporaryDirectory() as folder:
        peer = f"conveyor-1x{options.concurrency}"
        args = [PYTHON, "-m", "bench.e2e", "--peers", peer, "--reps", "1"]
        args += ["--concurrency", str(options.concurrency)]
        args += ["--tasks", str(options.tasks), "--latency-samples", str(options.latency_samples)]
        env = {**os.environ, "CONVEYOR_AMQP_URL": amqp_url, "CONVEYOR_BENCH_RESULTS": folder}
        done = subprocess.run(
            args, cwd=REPO, env=env, capture_output=True, text=True, timeout=options.timeout
        )
        written = sorted(Path(folder).glob("e2e-*.json"))
        if done.returncode != 0 or not written:
            return {"error": no_paths((done.stdout + done.stderr)[-2000:])}
        result = json.loads(written[-1].read_text())
    (run,) = result["runs"]
    return {
        "throughput_tps": run.get("throughput_tps"),
        "latency_p50_ms": (run.get("latency") or {}).get("from_answer_ms", {}).get("p50"),
        "latency_p99_ms": (run.get("latency") or {}).get("from_answer_ms", {}).get("p99"),
        "platform_cpu_ms_per_task": run.get("platform_cpu_ms_per_task"),
        "failed": run.get("failed"),
        "error": run.get("error"),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for target in TARGETS:
        mine = [r for r in runs if r["target"] == target and not r.get("error")]
        found[target] = {
            "runs": len(mine),
            **{
                key: median(r[key] for r in mine)
                for key in ("throughput_tps", "latency_p50_ms", "latency_p99_ms")
            },
        }
    found["ratio_cluster_over_single"] = ratio(
        found["cluster"]["throughput_tps"], found["single"]["throughput_tps"]
    )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="CONCURRENCY of the one dispatcher (peer conveyor-1x<N>)",
    )
    parser.add_argument("--latency-samples", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per e2e run")
    options = parser.parse_args(argv)
    result: dict[str, Any] = {
        "benchmark": "cluster",
        "meta": metadata("bench.cluster", vars(options)),
    }
    runs: list[dict[str, Any]] = []
    single, cluster = RabbitNode(), RabbitCluster(3)
    try:
        banner("starting a private node and a private 3-node cluster")
        single.start()
        cluster.start()
        urls = {"single": single.url, "cluster": cluster.urls}
        for rep in range(options.reps):
            order = TARGETS if rep % 2 == 0 else TARGETS[::-1]
            for target in order:
                banner(f"repetition {rep + 1}/{options.reps}: {target}")
                found = {"target": target, "rep": rep + 1, **run_e2e(urls[target], options)}
                print(
                    f"  {target}: {found.get('throughput_tps')} tasks/s {found.get('error') or ''}"
                )
                runs.append(found)
    finally:
        cluster.stop()
        single.stop()
    result["runs"] = runs
    result["summary"] = summarize(runs)
    write_result("cluster", result)
    print(f"  cluster/single: {result['summary']['ratio_cluster_over_single']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
