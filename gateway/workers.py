"""`conveyor gateway --workers N`: N processes serve the API on one port, and exactly one of them
runs the background loops.

uvicorn's supervisor starts the workers on one shared socket and starts a new one when a worker
dies. Which worker runs the loops is decided by an exclusive lock on a file the supervisor names:
the first worker to take it runs them; the kernel releases it when that process dies. Every
other worker keeps trying it (`LOCK_RETRY`), and the first to take it starts the loops: after a
SIGHUP uvicorn starts the new workers before it stops the old ones, and a lock tried only at
start was then taken by none. So there is never a second relay, result consumer or notifier in
the group, and never none for longer than a restart.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os

from fastapi import FastAPI
from uvicorn.supervisors import multiprocess

from conveyor import logs
from conveyor.lifeline import die_with_parent
from conveyor.settings import GatewaySettings
from gateway.app import create_app

log = logging.getLogger("conveyor.gateway.workers")

LOCK_ENV = "CONVEYOR_GATEWAY_LOOPS_LOCK"
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode
SUPERVISOR_ENV = "CONVEYOR_GATEWAY_SUPERVISOR"  # the pid of uvicorn's supervisor
_held: list[int] = []  # the lock's descriptor, open for the life of the process
LOCK_RETRY = 1.0  # seconds between two tries of a worker that does not hold the lock


class Worker(multiprocess.Process):
    """uvicorn's worker, but the supervisor keeps no copy of the worker's end of their pipe.

    The supervisor pings its workers one after the other through that pipe, and kept the child's
    end open too: a worker that died while it was pinged was never seen gone, and the supervisor
    waited out the whole health-check timeout (30 s), seeing no other worker meanwhile (found by
    a black-box sweep: workers SIGKILLed, the port served nothing for 30 s). Closed once the
    worker has its own, a worker's end closes the pipe and the ping fails at once."""

    def start(self) -> None:
        super().start()
        self.child_conn.close()


def see_dead_workers_at_once() -> None:
    """The supervisor starts `Worker`s (it names its class in its own module)."""
    multiprocess.Process = Worker  # type: ignore[misc]


def takes_the_loops(path: str) -> bool:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    except OSError:
        os.close(fd)
        raise
    _held.append(fd)
    return True


async def _lock_taken(path: str) -> None:
    """Returns once this worker holds the lock. A lock file it cannot open (a directory put in
    its place, permissions changed) is said once and tried again: the take-over must not end
    silently, leaving the group without loops once their holder dies."""
    said = False
    while True:
        try:
            if takes_the_loops(path):
                return
            said = False
        except OSError as exc:
            if not said:
                log.error(
                    "cannot take the background loops' lock; trying again",
                    extra={"path": path, "error": logs.describe(exc)},
                )
                said = True
        await asyncio.sleep(LOCK_RETRY)


def worker_app() -> FastAPI:
    """The app of one worker (uvicorn's factory, called in each worker process)."""
    supervisor = os.environ.get(SUPERVISOR_ENV)  # no orphan keeps the port, or the loops
    die_with_parent(int(supervisor) if supervisor else None)
    settings = GatewaySettings()
    logs.configure(settings.log_level, settings.log_format)
    path = os.environ[LOCK_ENV]
    return create_app(
        settings,
        background=takes_the_loops(path),
        server=True,
        loops_later=lambda: _lock_taken(path),
    )
