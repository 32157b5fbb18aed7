"""`make bench`: the benchmarks with their default sizes, then the plot and the summary.

Each benchmark runs in its own process (a crash in one does not stop the
others) and writes `bench/results/<name>-<timestamp>.json`; then `bench.plot`
draws `bench/results/bench.png` and `bench.report` prints the markdown table
of results against the SPEC §10 targets (also written to
`bench/results/summary.md`). Sized to finish within 20 minutes on 2 cores.

    python -m bench.run_all [--quick] [--only e2e,floor] [--skip scale]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench.record import PYTHON, REPO, banner

# name -> arguments of its default run (and of --quick, for a smoke test)
BENCHMARKS: dict[str, tuple[list[str], list[str]]] = {
    "submit": ([], ["--duration", "2", "--reps", "1", "--auth-duration", "2"]),
    "e2e": ([], ["--tasks", "300", "--reps", "1", "--latency-samples", "30"]),
    "floor": (["--with-pg", "--tasks", "3000"], ["--tasks", "500", "--reps", "1"]),
    "footprint": ([], ["--starts", "2", "--load-tasks", "300"]),
    "scale": (
        [],
        ["--levels", "1000,100000", "--requests", "300", "--reps", "1", "--deep-backlog", "5000"],
    ),
    "batch": ([], ["--duration", "1", "--reps", "1"]),
    "streams": ([], ["--duration", "1", "--reps", "1", "--streams", "200"]),
    "tracing": ([], ["--duration", "1", "--reps", "1"]),
}
TIMEOUTS = {
    "submit": 300,
    "e2e": 1200,
    "floor": 480,
    "footprint": 240,
    "scale": 600,
    "batch": 240,
    "streams": 300,
    "tracing": 300,
}


def run_one(name: str, quick: bool) -> tuple[int, float]:
    default, smoke = BENCHMARKS[name]
    args = [PYTHON, "-m", f"bench.{name}", *(smoke if quick else default)]
    banner(f"bench.{name} {' '.join(args[3:])}")
    started = time.monotonic()
    try:
        code = subprocess.run(
            args, cwd=REPO, timeout=TIMEOUTS[name] * (3 if quick else 1)
        ).returncode
    except subprocess.TimeoutExpired:
        print(f"bench.{name} did not finish within {TIMEOUTS[name]} s", file=sys.stderr)
        code = 124
    return code, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--skip", default="", help="comma-separated benchmark names")
    options = parser.parse_args(argv)
    names = [n for n in BENCHMARKS if not options.only or n in options.only.split(",")]
    names = [n for n in names if n not in options.skip.split(",")]
    started = time.time()
    outcomes = {}
    for name in names:
        outcomes[name] = run_one(name, options.quick)
    from bench import plot, report

    plot.main([])
    report.main([])
    banner("durations")
    for name, (code, seconds) in outcomes.items():
        print(f"  {name:<10} {seconds:6.0f} s  {'ok' if code == 0 else f'exit {code}'}")
    print(f"  total      {time.time() - started:6.0f} s")
    return 0 if all(code == 0 for code, _ in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
