"""Profiles the gateway under submit load, or a dispatcher under end-to-end load, with py-spy.

    python -m bench.profile gateway    [--seconds 10] [--concurrency 16]
    python -m bench.profile dispatcher [--seconds 10] [--tasks 3000]

Writes `bench/results/profile-<target>-<timestamp>.txt`: py-spy's collapsed
stacks folded into the top functions by own and by cumulative samples, and
beside it the stacks themselves as `.folded` (for any flame graph tool), with
file paths shortened to `package/module.py`. `--idle` includes samples of
threads waiting in the event loop's selector.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.record import PYTHON, RESULTS, run_json, timestamp
from bench.stack import (
    Processes,
    create_service,
    fresh_database,
    processes,
    start_dispatcher,
    start_gateway,
    start_noop_function,
)
from bench.submit import BODY, SCHEMA


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(PYTHON).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: pip install -e '.[bench]'")
    return found


def record(pid: int, seconds: float, out: Path, idle: bool) -> None:
    """py-spy's raw collapsed stacks of `pid` for `seconds`, into `out`."""
    args = [_py_spy(), "record", "--pid", str(pid), "--duration", str(int(seconds))]
    args += ["--format", "raw", "--output", str(out), "--rate", "200", "--nonblocking"]
    if idle:
        args.append("--idle")
    subprocess.run(args, check=True, capture_output=True, timeout=seconds + 60)


def fold(folded: Path, top: int = 40) -> str:
    """Top functions by own samples and by cumulative samples, from collapsed stacks."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in folded.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        samples += n
        frames = stack.split(";")
        own[_short(frames[-1])] += n
        for frame in {_short(f) for f in frames}:
            total[frame] += n
    lines = [f"samples: {samples}", "", "own:"]
    lines += [f"{100 * n / samples:6.1f}%  {name}" for name, n in own.most_common(top)]
    lines += ["", "cumulative:"]
    lines += [f"{100 * n / samples:6.1f}%  {name}" for name, n in total.most_common(top)]
    return "\n".join(lines)


def shorten(raw: Path, out: Path) -> None:
    """The collapsed stacks with every frame shortened: no path of this machine is kept."""
    lines = []
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            lines.append(";".join(_short(f) for f in stack.split(";")) + f" {count}")
    out.write_text("\n".join(lines) + "\n")


def _short(frame: str) -> str:
    """`fn (path/to/site-packages/pkg/mod.py:12)` -> `fn (pkg/mod.py)`."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rpartition(":")[0]
    for marker in ("site-packages/", "lib/python3"):
        if marker in where:
            where = where.split(marker, 1)[1]
    parts = Path(where).parts
    return f"{name} ({'/'.join(parts[-2:])})"


def _in_background(target: Any) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def profile_gateway(procs: Processes, database_url: str, options: argparse.Namespace) -> int:
    service = create_service(database_url, schema=SCHEMA)
    gateway = start_gateway(procs, database_url)
    job = {
        "url": gateway.url,
        "requests": [{"method": "POST", "path": service.tasks_path, "body": BODY}],
        "concurrency": options.concurrency,
        "duration": options.seconds + 4,
        "warmup": 1.0,
        "auth": list(service.auth),
    }
    load = _in_background(
        lambda: print(run_json([PYTHON, "-m", "bench.loadgen", json.dumps(job)], timeout=300))
    )
    time.sleep(2)
    return _record_and_wait(gateway.proc.pid, options, load)


def profile_dispatcher(procs: Processes, database_url: str, options: argparse.Namespace) -> int:
    function = start_noop_function(procs)
    service = create_service(database_url)
    gateway = start_gateway(procs, database_url)
    dispatcher = start_dispatcher(
        procs, "dispatcher", service.name, function.url, CONCURRENCY=str(options.concurrency)
    )
    job = {
        "url": gateway.url,
        "requests": [{"method": "POST", "path": service.tasks_path, "body": {"body": {}}}],
        "concurrency": 16,
        "count": options.tasks,
        "auth": list(service.auth),
    }
    load = _in_background(
        lambda: print(run_json([PYTHON, "-m", "bench.loadgen", json.dumps(job)], timeout=300))
    )
    time.sleep(1)
    pid = dispatcher.proc.pid if options.target == "dispatcher" else gateway.proc.pid
    return _record_and_wait(pid, options, load)


def _record_and_wait(pid: int, options: argparse.Namespace, load: threading.Thread) -> int:
    name = f"profile-{options.target}-{timestamp()}"
    folded = RESULTS / f"{name}.folded"
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "raw.folded"
        record(pid, options.seconds, raw, options.idle)
        shorten(raw, folded)
    load.join(timeout=300)
    report = fold(folded)
    (RESULTS / f"{name}.txt").write_text(report + "\n")
    print(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=["gateway", "dispatcher", "gateway-e2e"])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--idle", action="store_true")
    options = parser.parse_args(argv)
    with fresh_database() as database_url, processes() as procs:
        if options.target == "gateway":
            return profile_gateway(procs, database_url, options)
        if options.target == "gateway-e2e":
            options.concurrency = 4
        return profile_dispatcher(procs, database_url, options)


if __name__ == "__main__":
    sys.exit(main())
