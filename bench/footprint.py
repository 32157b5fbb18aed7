"""Benchmark 4: the dispatcher sidecar's footprint (SPEC §10: RSS <= 50 MB idle, ready <= 1 s).

* start -> ready: from `Popen(conveyor dispatcher)` to the first `200` of its
  `/readyz` (broker connected and consuming, function reachable), with the
  queues declared and the function already up, polled every 5 ms; median of
  several starts;
* RSS: `VmRSS` from `/proc/<pid>/status` once ready and idle for a moment, and
  its peak (`VmHWM`, and VmRSS sampled every 20 ms) while it works through
  pre-loaded messages;
* import time: `python -X importtime -c "import dispatcher.main"` (the module
  the sidecar runs) and of the whole `conveyor dispatcher` command line,
  parsed from CPython's own report; plus the wall time of a bare
  `python -c pass` for reference.

The figures of record are those of the sidecar as its image installs it: a venv
with the `dispatcher` extra only, the project installed, not editable
(dispatcher/Dockerfile). In the benchmarks' own venv, which has the gateway's
extras too, aiohttp finds aiodns and loads c-ares (~1.8 MB more). Should that venv
not build (`pip` cannot reach its registry), the bench venv's figures stand in,
and `shipped` says why.

    python -m bench.footprint [--starts 5] [--load-tasks 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.floor import ResultCounter, preload
from bench.meters import rss_kib
from bench.record import PYTHON, REPO, banner, metadata, write_result
from bench.stack import (
    Processes,
    declare_queues,
    delete_queues,
    dispatcher_env,
    free_port,
    processes,
    start_noop_function,
    unique,
)
from bench.stats import median


def import_time(code: list[str]) -> dict[str, Any]:
    """Cumulative import time (ms) of the top-level imports, from `-X importtime`."""
    done = subprocess.run(
        [PYTHON, "-X", "importtime", *code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CONVEYOR_QUEUE": "x"},
    )
    top: dict[str, int] = {}
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, _, rest = line.partition(":")
        fields = [f for f in rest.split("|")]
        if len(fields) != 3:
            continue
        name = fields[2]
        if name.startswith(" ") and not name.startswith("  "):
            top[name.strip()] = int(fields[1])
    heaviest = sorted(top.items(), key=lambda kv: -kv[1])[:8]
    return {
        "total_ms": round(sum(top.values()) / 1000, 1),
        "heaviest_ms": {k: round(v / 1000, 1) for k, v in heaviest},
    }


def wall_time(code: list[str], runs: int = 5) -> float | None:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([PYTHON, *code], cwd=REPO, capture_output=True, timeout=60)
        times.append((time.perf_counter() - started) * 1000)
    return None if not times else round(median(times) or 0, 1)


ENTRYPOINTS = {  # in the benchmarks' venv
    "conveyor dispatcher": [PYTHON, "-m", "conveyor", "dispatcher"],  # what `inject` deploys
    "python -m dispatcher": [PYTHON, "-m", "dispatcher"],
}
SHIPPED = "conveyor dispatcher, as its image installs it"


def shipped_venv(scratch: Path) -> Path:
    """A venv as dispatcher/Dockerfile makes one: the `dispatcher` extra, then the project
    from a copy of what the image copies (not editable, compiled)."""
    source = scratch / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("conveyor", "dispatcher"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("*.pyc"))
    venv = scratch / "venv"
    python = str(venv / "bin" / "python")
    for args in (
        [PYTHON, "-m", "venv", str(venv)],
        [
            python,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            f"{source}[dispatcher]",
        ],
        [python, "-m", "compileall", "-q", str(venv / "lib")],
    ):
        subprocess.run(args, check=True, capture_output=True, timeout=600, cwd=scratch)
    return venv


def start_to_ready(
    procs: Processes, queue: str, function_url: str, command: list[str]
) -> tuple[float, Any]:
    """Seconds from Popen to /readyz 200; the process is left running."""
    port = free_port()
    env = dispatcher_env(queue, function_url, port)
    started = time.monotonic()
    proc = procs.start(unique("footprint"), command, env)
    url = f"http://127.0.0.1:{port}/readyz"
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while time.monotonic() - started < 60:
            if not proc.alive():
                raise RuntimeError(f"dispatcher exited:\n{proc.tail()}")
            try:
                if client.get(url).status_code == 200:
                    return time.monotonic() - started, proc
            except httpx.HTTPError:
                pass
            time.sleep(0.005)
    raise TimeoutError("dispatcher not ready after 60 s")


def under_load(proc: Any, queue: str, tasks: int, timeout: float) -> dict[str, Any]:
    """Peak RSS while the running dispatcher works through `tasks` pre-loaded messages."""
    peak = [rss_kib(proc.pid)["VmRSS"] or 0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_kib(proc.pid)["VmRSS"] or 0)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    async def go() -> bool:
        import aio_pika

        from bench.stack import AMQP_URL
        from conveyor.topology import out_queue

        counter = ResultCounter(tasks)
        connection = await aio_pika.connect(AMQP_URL)
        try:
            channel = await connection.channel()
            out = await channel.get_queue(out_queue(queue), ensure=False)
            await out.consume(counter.on_message, no_ack=True)
            await preload(queue, tasks)
            await asyncio.wait_for(counter.done.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            await connection.close()

    finished = asyncio.run(go())
    stop.set()
    sampler.join()
    status = rss_kib(proc.pid)
    return {
        "tasks": tasks,
        "finished": finished,
        "peak_rss_mib": round(peak[0] / 1024, 1),
        "vm_hwm_mib": round((status["VmHWM"] or 0) / 1024, 1),
        "rss_after_mib": round((status["VmRSS"] or 0) / 1024, 1),
    }


def run(options: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "benchmark": "footprint",
        "meta": metadata("bench.footprint", vars(options)),
    }
    banner("import time")
    result["import"] = {
        "dispatcher.main": import_time(["-c", "import dispatcher.main"]),
        "conveyor dispatcher --help": import_time(["-m", "conveyor", "dispatcher", "--help"]),
        "python -c pass wall ms": wall_time(["-c", "pass"]),
        "python -c 'import dispatcher.main' wall ms": wall_time(["-c", "import dispatcher.main"]),
    }
    print(f"  {result['import']}")
    queue = unique("footprint")
    asyncio.run(declare_queues(queue))
    try:
        with processes() as procs, tempfile.TemporaryDirectory() as scratch:
            commands = dict(ENTRYPOINTS)
            banner("a venv as the dispatcher's image makes one")
            try:
                venv = shipped_venv(Path(scratch))
                commands[SHIPPED] = [str(venv / "bin" / "conveyor"), "dispatcher"]
                result["shipped"] = {"built": True}
            except (subprocess.SubprocessError, OSError) as exc:
                stderr = getattr(exc, "stderr", b"") or b""
                why = f"{exc!r}: {stderr.decode(errors='replace')[-500:]}"
                print(f"  not built, the bench venv's figures stand in: {why}")
                result["shipped"] = {"built": False, "error": why}
            function = start_noop_function(procs)
            result["entrypoints"] = {
                name: _starts(procs, queue, function.url, options, name, command)
                for name, command in commands.items()
            }
            main = (
                result["entrypoints"].get(SHIPPED) or result["entrypoints"]["conveyor dispatcher"]
            )
            result["start_to_ready_s"] = main["start_to_ready_s"]
            result["idle_rss_mib"] = main["idle_rss_mib"]
            result["under_load"] = main["under_load"]
    finally:
        asyncio.run(delete_queues(queue))
    return result


def _starts(
    procs: Processes,
    queue: str,
    function_url: str,
    options: argparse.Namespace,
    entrypoint: str,
    command: list[str],
) -> dict[str, Any]:
    banner(f"start -> ready, RSS: {entrypoint}")
    readiness, idle = [], []
    proc = None
    for index in range(options.starts):
        seconds, proc = start_to_ready(procs, queue, function_url, command)
        readiness.append(round(seconds, 3))
        time.sleep(options.settle)
        idle.append(round((rss_kib(proc.pid)["VmRSS"] or 0) / 1024, 1))
        if index < options.starts - 1:
            procs.stop(proc)
    print(f"  start->ready s: {readiness}; idle RSS MiB: {idle}")
    assert proc is not None
    load = under_load(proc, queue, options.load_tasks, options.timeout)
    procs.stop(proc)
    print(f"  under load: {load}")
    return {
        "start_to_ready_s": {"runs": readiness, "median": median(readiness)},
        "idle_rss_mib": {"runs": idle, "median": median(idle)},
        "under_load": load,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--settle", type=float, default=2.0, help="idle seconds before RSS")
    parser.add_argument("--load-tasks", type=int, default=2000)
    parser.add_argument("--timeout", type=float, default=300.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    write_result("footprint", run(parse(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
