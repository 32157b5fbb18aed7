"""CPU seconds and memory of processes and of the local servers, read from /proc;
the cyclic collector's runs of a Python server, read from its /metrics.

On a busy machine, CPU time per task is a steadier figure than wall-clock
throughput: other load slows a process down but does not make it do more.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from bench.record import ADMIN_DB_URL, read_text

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, ...].

    The command name may contain spaces, so split after its closing parenthesis.
    Index 1 is the parent pid, 11 and 12 the user and system CPU ticks.
    """
    raw = read_text(f"/proc/{pid}/stat")
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


def write_syscalls(pid: int, tree: bool = False) -> int:
    """`write`/`writev` system calls a process made so far, and with `tree` its live
    descendants: `syscw` of /proc/<pid>/io. The event loops' socket writes (uvloop: HTTP,
    AMQP) are counted; libpq's `send()` to PostgreSQL is not."""
    total = 0
    for member in _descendants(pid) if tree else [pid]:
        for line in read_text(f"/proc/{member}/io").splitlines():
            if line.startswith("syscw:"):
                total += int(line.split()[1])
    return total


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


class WriteMeter(CpuMeter):
    """Writing system calls instead of CPU seconds: a count the VM's speed does not move,
    for what batching writes saves (each is a send on a loopback socket)."""

    def _now(self) -> float:
        return float(sum(write_syscalls(pid, self.tree) for pid in self.pids))


def _comm(pid: int) -> str:
    return read_text(f"/proc/{pid}/comm").strip()


def server_pids(database_url: str = ADMIN_DB_URL) -> dict[str, int]:
    """The local PostgreSQL postmaster and RabbitMQ (beam.smp) pids, when they are local."""
    import psycopg

    from gateway.database_url import libpq

    found: dict[str, int] = {}
    try:
        # The backend's parent, read while the backend lives: once the connection closes, it
        # may have exited already (the server's CPU went unmeasured, now and then).
        with psycopg.connect(libpq(database_url), autocommit=True) as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            fields = None if row is None else _stat_fields(row[0])
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


def rss_kib(pid: int) -> dict[str, int | None]:
    """VmRSS (now) and VmHWM (peak) of a process, in KiB."""
    found: dict[str, int | None] = {"VmRSS": None, "VmHWM": None}
    for line in read_text(f"/proc/{pid}/status").splitlines():
        key, _, value = line.partition(":")
        if key in found:
            found[key] = int(value.split()[0])
    return found


def metric_samples(metrics_url: str) -> list[Sample]:
    """Every sample a process exports on its Prometheus `/metrics`."""
    text = httpx.get(metrics_url, timeout=10.0, trust_env=False).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def gc_figures(base_url: str) -> dict[str, dict[str, float]]:
    """A Python server's cyclic collector, from its /metrics: `collections` by generation
    (`python_gc_collections_total`, prometheus_client's default collector; absent with
    `conveyor gateway --workers N`) and `pause_s`, the seconds it stood still while
    collecting (`conveyor_*_gc_pause_seconds`; absent before `conveyor/heap.py`)."""
    found: dict[str, dict[str, float]] = {"collections": {}, "pause_s": {}}
    for sample in metric_samples(f"{base_url}/metrics"):
        if sample.name == "python_gc_collections_total":
            found["collections"][sample.labels["generation"]] = sample.value
        elif sample.name.endswith("_gc_pause_seconds_sum"):
            found["pause_s"][sample.labels["generation"]] = sample.value
    return found


def submit_phases(base_url: str) -> dict[str, tuple[float, float]]:
    """The gateway's `conveyor_gateway_submit_phase_seconds`: (sum, count) by phase."""
    found: dict[str, tuple[float, float]] = {}
    for sample in metric_samples(f"{base_url}/metrics"):
        if sample.name.startswith("conveyor_gateway_submit_phase_seconds_"):
            phase = sample.labels["phase"]
            total, count = found.get(phase, (0.0, 0.0))
            if sample.name.endswith("_sum"):
                found[phase] = (sample.value, count)
            elif sample.name.endswith("_count"):
                found[phase] = (total, sample.value)
    return found


def phase_means_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float | None]:
    """Mean ms of each phase between two `submit_phases` readings."""
    means: dict[str, float | None] = {}
    for phase, (total, count) in after.items():
        total0, count0 = before.get(phase, (0.0, 0.0))
        n = count - count0
        means[phase] = round((total - total0) * 1000 / n, 3) if n > 0 else None
    return means
