"""What every benchmark shares: metadata, result files, statistics, processes, databases.

* `metadata()` records the machine (cores, memory, CPU, kernel, Python), the
  date, the git commit and the exact command, as SPEC §10 asks of every result.
* `write_result()` writes `bench/results/<name>-<UTC timestamp>.json`.
* `summarize()` gives medians and percentiles (linear interpolation).
* `Processes` starts subprocesses with their output in a private log folder
  and always stops them (SIGTERM, then SIGKILL) when the benchmark ends.
* `fresh_database()` creates a database for one run, migrates it and drops it
  at the end, like the test suite does; `unique()` names queues and services.
* `start_noop_function()` runs the no-op HTTP function (`bench.noop`) that
  every peer calls, so that the function costs the same for all of them.

Nothing here writes an absolute path of this machine into a result.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import httpx

from conveyor.settings import DEFAULT_AMQP_URL, normalize_database_url

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PYTHON = sys.executable
ADMIN_DB_URL = normalize_database_url(
    os.environ.get("CONVEYOR_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
)
AMQP_URL = os.environ.get("CONVEYOR_AMQP_URL", DEFAULT_AMQP_URL)
DELIVERY_LIMIT = 5  # the gateway's default CONVEYOR_DELIVERY_LIMIT
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


# ---------------------------------------------------------------------------
# metadata and result files


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _memory_mib() -> int | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return None


def _cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
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

        with psycopg.connect(psycopg_url(ADMIN_DB_URL), connect_timeout=3) as conn:
            versions["postgresql"] = conn.execute("SHOW server_version").fetchone()[0]
    with contextlib.suppress(Exception):
        versions["rabbitmq"] = asyncio.run(_rabbitmq_version())
    return versions


async def _rabbitmq_version() -> str | None:
    import aio_pika

    connection = await aio_pika.connect(AMQP_URL, timeout=3)
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


# ---------------------------------------------------------------------------
# statistics


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return percentile(present, 50) if present else None


def summarize(values: Sequence[float], digits: int = 3) -> dict[str, float | int | None]:
    """n, min, p50, p90, p99, max and mean of a sample."""

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, digits)

    return {
        "n": len(values),
        "min": rounded(min(values)) if values else None,
        "p50": rounded(percentile(values, 50)),
        "p90": rounded(percentile(values, 90)),
        "p99": rounded(percentile(values, 99)),
        "max": rounded(max(values)) if values else None,
        "mean": rounded(sum(values) / len(values)) if values else None,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


# ---------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Processes:
    """Starts subprocesses and stops every one of them, in reverse order."""

    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="conveyor-bench-")))
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                list(args), cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT
            )
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def conveyor(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> Proc:
        return self.start(name, [PYTHON, "-m", "conveyor", *args], env)

    def stop(self, proc: Proc, timeout: float = 10.0) -> int | None:
        if proc.alive():
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=5)
        if proc in self.procs:
            self.procs.remove(proc)
        return proc.popen.returncode

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)

    def cleanup(self, keep_logs: bool = False) -> None:
        self.stop_all()
        if not keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)


@contextlib.contextmanager
def processes() -> Iterator[Processes]:
    """Processes stopped at the end; their logs kept (and named) only on failure."""
    procs = Processes()
    failed = True
    try:
        yield procs
        failed = False
    finally:
        procs.cleanup(keep_logs=failed)
        if failed:
            print(f"process logs kept in {procs.log_dir}", file=sys.stderr)


def wait_http(url: str, timeout: float = 30.0, proc: Proc | None = None, ok: int = 500) -> float:
    """Polls `url` until it answers below `ok`; returns the seconds it took."""
    started = time.monotonic()
    deadline = started + timeout
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc is not None and not proc.alive():
                raise RuntimeError(f"{proc.name} exited early:\n{proc.tail()}")
            try:
                if client.get(url).status_code < ok:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    raise TimeoutError(f"{url} not ready after {timeout}s\n{proc.tail() if proc else ''}")


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, ...].

    The command name may contain spaces, so split after its closing parenthesis.
    Index 1 is the parent pid, 11 and 12 the user and system CPU ticks.
    """
    raw = _read(f"/proc/{pid}/stat")
    return raw.rpartition(")")[2].split() if raw else None


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def cpu_seconds(pid: int, tree: bool = False) -> float:
    """User + system CPU time of a process (and, with `tree`, of its live descendants)."""
    total = 0
    for member in _descendants(pid) if tree else [pid]:
        fields = _stat_fields(member)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])
    return total / _TICKS


class CpuMeter:
    """CPU seconds several processes spend between `start()` and `stop()`.

    On a busy machine, CPU time per task is a steadier figure than wall-clock
    throughput: other load slows a process down but does not make it do more.
    """

    def __init__(self, pids: Iterable[int], tree: bool = False) -> None:
        self.pids = list(pids)
        self.tree = tree
        self._start = 0.0

    def _now(self) -> float:
        return sum(cpu_seconds(pid, self.tree) for pid in self.pids)

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> float:
        return round(self._now() - self._start, 3)


def _comm(pid: int) -> str:
    return _read(f"/proc/{pid}/comm").strip()


def server_pids(database_url: str = ADMIN_DB_URL) -> dict[str, int]:
    """The local PostgreSQL postmaster and RabbitMQ (beam.smp) pids, when they are local."""
    found: dict[str, int] = {}
    try:
        backend = sql(database_url, "SELECT pg_backend_pid()")[0][0]
        fields = _stat_fields(backend)
        if fields is not None and "postgres" in _comm(int(fields[1])):
            found["postgresql"] = int(fields[1])
    except Exception:  # a remote or unreachable database: not measured
        pass
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _comm(int(entry.name)) == "beam.smp":
            found["rabbitmq"] = int(entry.name)
            break
    return found


def _server_cpu(pid: int) -> float:
    """A server's CPU: its own, its reaped children's (fields 13-14: backends that have
    exited) and its live children's."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    total = sum(int(f) for f in fields[11:15])
    for child in _descendants(pid)[1:]:
        if (child_fields := _stat_fields(child)) is not None:
            total += int(child_fields[11]) + int(child_fields[12])
    return total / _TICKS


class ServerMeter:
    """CPU seconds PostgreSQL and RabbitMQ spend between `start()` and `stop()`, each."""

    def __init__(self, database_url: str = ADMIN_DB_URL) -> None:
        self.pids = server_pids(database_url)
        self._start: dict[str, float] = {}

    def start(self) -> None:
        self._start = {name: _server_cpu(pid) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        return {
            name: round(_server_cpu(pid) - self._start.get(name, 0.0), 3)
            for name, pid in self.pids.items()
        }


def wait_for_broker(timeout: float = 60.0) -> bool:
    """Waits for RabbitMQ to accept connections (it may be restarting); True if it does."""
    from urllib.parse import urlsplit

    parts = urlsplit(AMQP_URL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), 2):
                return True
        except OSError:
            time.sleep(1.0)
    return False


def rss_kib(pid: int) -> dict[str, int | None]:
    """VmRSS (now) and VmHWM (peak) of a process, in KiB."""
    found: dict[str, int | None] = {"VmRSS": None, "VmHWM": None}
    for line in _read(f"/proc/{pid}/status").splitlines():
        key, _, value = line.partition(":")
        if key in found:
            found[key] = int(value.split()[0])
    return found


# ---------------------------------------------------------------------------
# databases


def psycopg_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _replace_db(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


@contextlib.contextmanager
def fresh_database(prefix: str = "conveyor_bench") -> Iterator[str]:
    """A database created for this run and migrated to head; dropped at the end."""
    import psycopg

    from gateway.migrate import upgrade

    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = psycopg_url(_replace_db(ADMIN_DB_URL, "postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = _replace_db(ADMIN_DB_URL, name)
    try:
        upgrade(url)
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def sql(database_url: str, statement: str, params: Mapping[str, Any] | None = None) -> list[Any]:
    import psycopg

    with psycopg.connect(psycopg_url(database_url), autocommit=True) as conn:
        cur = conn.execute(statement, params or {})
        return cur.fetchall() if cur.description else []


# ---------------------------------------------------------------------------
# the platform: services, clients, queues


@dataclass(frozen=True)
class BenchService:
    name: str
    client_id: str
    secret: str

    @property
    def auth(self) -> tuple[str, str]:
        return (self.client_id, self.secret)

    @property
    def tasks_path(self) -> str:
        return f"/v1/services/{self.name}/tasks"


def hash_secret(secret: str, rounds: int) -> str:
    import bcrypt

    return bcrypt.hashpw(secret.encode(), bcrypt.gensalt(rounds)).decode()


def create_service(
    database_url: str,
    name: str | None = None,
    schema: dict[str, Any] | None = None,
    capacity: int | None = None,
    client_capacity: int | None = None,
    bcrypt_rounds: int = 12,
) -> BenchService:
    """A service, a client granted on it (production bcrypt cost), and its queues."""
    from conveyor.settings import GatewaySettings
    from gateway import admin
    from gateway.db import create_engine
    from gateway.platform_file import PlatformSpec

    service = BenchService(name or unique("bench"), unique("client"), uuid.uuid4().hex)
    spec = PlatformSpec.model_validate(
        {
            "services": [
                {"name": service.name, "jsonSchema": schema, "capacity": capacity, "maxAttempts": 3}
            ],
            "clients": [
                {
                    "id": service.client_id,
                    "secretHash": hash_secret(service.secret, bcrypt_rounds),
                    "grants": [{"service": service.name, "capacity": client_capacity}],
                }
            ],
        }
    )

    async def go() -> None:
        engine = create_engine(GatewaySettings(database_url=database_url))
        try:
            await admin.apply(engine, spec)
        finally:
            await engine.dispose()
        await declare_queues(service.name)

    asyncio.run(go())
    return service


async def declare_queues(queue_name: str) -> None:
    import aio_pika

    from conveyor.events import MessageFormat
    from conveyor.topology import declare_service

    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel()
        await declare_service(channel, queue_name, MessageFormat.CLOUDEVENTS, DELIVERY_LIMIT)
    finally:
        await connection.close()


async def delete_queues(queue_name: str) -> None:
    import aio_pika

    from conveyor.topology import dead_letter_queue, in_queue, out_queue

    connection = await aio_pika.connect(AMQP_URL)
    try:
        for name in (in_queue(queue_name), out_queue(queue_name), dead_letter_queue(queue_name)):
            channel = await connection.channel()
            with contextlib.suppress(Exception):
                await channel.queue_delete(name)
    finally:
        await connection.close()


def purge_queue(name: str) -> None:
    async def go() -> None:
        import aio_pika

        connection = await aio_pika.connect(AMQP_URL)
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(name, passive=True)
            await queue.purge()
        finally:
            await connection.close()

    with contextlib.suppress(Exception):
        asyncio.run(go())


# ---------------------------------------------------------------------------
# gateway, dispatchers and the no-op function


def gateway_env(database_url: str, **extra: str) -> dict[str, str]:
    return {
        "CONVEYOR_DATABASE_URL": database_url,
        "CONVEYOR_AMQP_URL": AMQP_URL,
        "CONVEYOR_SERVICE_REFRESH_INTERVAL": "0.5",
        "CONVEYOR_LOG_FORMAT": "json",
        **extra,
    }


@dataclass
class Gateway:
    proc: Proc
    url: str


def start_gateway(
    procs: Processes, database_url: str, name: str = "gateway", **env: str
) -> Gateway:
    port = free_port()
    proc = procs.conveyor(
        name, "gateway", "--port", str(port), env=gateway_env(database_url, **env)
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", timeout=60, proc=proc, ok=300)
    return Gateway(proc, url)


def dispatcher_env(queue: str, function_url: str, port: int, **extra: str) -> dict[str, str]:
    return {
        "CONVEYOR_QUEUE": queue,
        "CONVEYOR_AMQP_URL": AMQP_URL,
        "FUNCTION_URL": function_url,
        "DISPATCHER_PORT": str(port),
        "HOSTNAME": f"bench-{port}",
        "CONVEYOR_LOG_FORMAT": "json",
        **extra,
    }


@dataclass
class Dispatcher:
    proc: Proc
    port: int

    @property
    def ready_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/readyz"


def start_dispatcher(
    procs: Processes, name: str, queue: str, function_url: str, wait: bool = True, **env: str
) -> Dispatcher:
    port = free_port()
    proc = procs.conveyor(name, "dispatcher", env=dispatcher_env(queue, function_url, port, **env))
    dispatcher = Dispatcher(proc, port)
    if wait:
        wait_http(dispatcher.ready_url, timeout=60, proc=proc, ok=300)
    return dispatcher


@dataclass
class NoopFunction:
    proc: Proc
    url: str

    def arrivals(self) -> dict[str, float]:
        """Task id -> time.time() at which the function received it."""
        with httpx.Client(timeout=30, trust_env=False) as client:
            return client.get(f"{self.url}arrivals").json()

    def stats(self) -> dict[str, Any]:
        with httpx.Client(timeout=10, trust_env=False) as client:
            return client.get(f"{self.url}stats").json()

    def reset(self) -> None:
        with httpx.Client(timeout=10, trust_env=False) as client:
            client.delete(f"{self.url}arrivals")


def start_noop_function(procs: Processes, name: str = "noop-function") -> NoopFunction:
    port = free_port()
    proc = procs.start(name, [PYTHON, "-m", "bench.noop", "--port", str(port)])
    url = f"http://127.0.0.1:{port}/"
    wait_http(f"{url}healthz", timeout=20, proc=proc)
    return NoopFunction(proc, url)


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
