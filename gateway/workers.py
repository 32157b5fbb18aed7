"""`conveyor gateway --workers N`: N processes serve the API on one port, and exactly one of them
runs the background loops.

uvicorn's supervisor starts the workers on one shared socket and starts a new one when a worker
dies. Which worker runs the loops is decided by an exclusive lock on a file the supervisor names:
the first worker to take it runs them; the kernel releases it when that process dies, and the
worker started in its place takes it. So there is never a second relay, result consumer or
notifier in the group, and never none for longer than a restart.
"""

from __future__ import annotations

import fcntl
import os

from fastapi import FastAPI

from conveyor import logs
from conveyor.settings import GatewaySettings
from gateway.app import create_app

LOCK_ENV = "CONVEYOR_GATEWAY_LOOPS_LOCK"
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode
_held: list[int] = []  # the lock's descriptor, open for the life of the process


def takes_the_loops(path: str) -> bool:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _held.append(fd)
    return True


def worker_app() -> FastAPI:
    """The app of one worker (uvicorn's factory, called in each worker process)."""
    settings = GatewaySettings()
    logs.configure(settings.log_level, settings.log_format)
    return create_app(settings, background=takes_the_loops(os.environ[LOCK_ENV]), server=True)
