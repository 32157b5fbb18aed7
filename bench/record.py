"""Where every benchmark writes: machine, date, commit and command with each result file
(`bench/results/<name>-<UTC timestamp>.json`), never an absolute path of this machine."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from conveyor.settings import DEFAULT_AMQP_URL, normalize_database_url
from gateway.database_url import libpq

REPO = Path(__file__).resolve().parents[1]
# A smoke run (the test suite) writes elsewhere, so as not to mix with recorded results.
RESULTS = Path(os.environ.get("CONVEYOR_BENCH_RESULTS") or REPO / "bench" / "results")
PYTHON = sys.executable
ADMIN_DB_URL = normalize_database_url(
    os.environ.get("CONVEYOR_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
)
AMQP_URL = os.environ.get("CONVEYOR_AMQP_URL", DEFAULT_AMQP_URL)
_PACKAGES = (
    "aio-pika",
    "celery",
    "fastapi",
    "httpx",
    "kombu",
    "orjson",
    "psycopg",
    "sqlalchemy",
    "starlette",
    "uvicorn",
    "uvloop",
)


def read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _memory_mib() -> int | None:
    for line in read_text("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return None


def _cpu_model() -> str:
    for line in read_text("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or "unknown"


def _git_commit() -> dict[str, Any]:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    if head.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            found[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            found[name] = None
    return found


def server_versions() -> dict[str, str | None]:
    """PostgreSQL's and RabbitMQ's own version strings, when reachable."""
    versions: dict[str, str | None] = {"postgresql": None, "rabbitmq": None}
    with contextlib.suppress(Exception):
        import psycopg

        with psycopg.connect(libpq(ADMIN_DB_URL), connect_timeout=3) as conn:
            versions["postgresql"] = conn.execute("SHOW server_version").fetchone()[0]
    with contextlib.suppress(Exception):
        versions["rabbitmq"] = asyncio.run(_rabbitmq_version())
    return versions


async def _rabbitmq_version() -> str | None:
    from conveyor.connection import connect

    connection = await connect(AMQP_URL, name="conveyor bench", timeout=3)
    try:
        props = connection.transport.connection.server_properties  # type: ignore[union-attr]
        version = props.get("version")
        return version.decode() if isinstance(version, bytes) else version
    finally:
        await connection.close()


def machine() -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_mib": _memory_mib(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "kernel": platform.release(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def command_line(module: str) -> str:
    """The command as typed, without this machine's paths."""
    return shlex.join(["python", "-m", module, *sys.argv[1:]])


def metadata(module: str, params: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command_line(module),
        "params": dict(params),
        "machine": machine(),
        "git": _git_commit(),
        "packages": _versions(),
        "servers": server_versions(),
    }


def timestamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def write_result(name: str, payload: Mapping[str, Any], folder: Path = RESULTS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{timestamp()}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}")
    return path


def latest_result(name: str, folder: Path = RESULTS, since: float = 0.0) -> Path | None:
    """The newest `<name>-*.json` written after `since` (a time.time() value)."""
    found = [p for p in folder.glob(f"{name}-*.json") if p.stat().st_mtime >= since]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def run_json(args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> Any:
    """Runs a helper process (e.g. the load generator) and parses the JSON it prints last."""
    done = subprocess.run(
        list(args),
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        helper = " ".join(a for a in args[1:3] if not a.startswith("{"))
        raise RuntimeError(f"{helper} failed:\n{no_paths(done.stderr[-3000:])}")
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return json.loads(lines[-1])


def no_paths(text: str) -> str:
    """Error text for a result file, without this machine's folders."""
    replacements = [
        (str(REPO), "."),
        (sys.prefix, "<venv>"),
        (sys.base_prefix, "<python>"),
        (str(Path.home()), "~"),
    ]
    for path, name in replacements:
        text = text.replace(path, name)
    return text


def banner(text: str) -> None:
    print(f"\n== {text}", flush=True)
