"""Found by the chaos run: a SIGTERM arriving while the dispatcher finishes its shutdown.

The chaos harness signalled every dispatcher and then, while waiting for each,
signalled it again: a dispatcher that had already removed its signal handlers
died by that second SIGTERM (exit code -15, 143 in Kubernetes: a failed Job in
ONE_SHOT mode) instead of exiting 0. SPEC §7.1: "A second signal during
shutdown is harmless." Here the signals keep coming until the process is gone.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.support.processes import REPO, Processes, free_port, wait_http

pytestmark = pytest.mark.timeout(60)


def test_signals_until_the_very_end_still_exit_0(procs: Processes, amqp_url: str) -> None:
    port = free_port()
    dispatcher = procs.conveyor(
        "dispatcher",
        "dispatcher",
        env={
            # Nothing to consume: it waits for queues that never come, then is stopped.
            "CONVEYOR_QUEUE": f"never-declared-{port}",
            "CONVEYOR_AMQP_URL": amqp_url,
            "FUNCTION_URL": f"http://127.0.0.1:{free_port()}/",
            "DISPATCHER_PORT": str(port),
        },
    )
    wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30, proc=dispatcher)
    deadline = time.monotonic() + 20
    while dispatcher.alive() and time.monotonic() < deadline:
        dispatcher.signal(signal.SIGTERM)
        time.sleep(0.001)
    assert dispatcher.wait(timeout=5) == 0, dispatcher.logs()[-2000:]


# The instant between removing the loop's handler (the default action is back) and SIG_IGN,
# made certain: the signal is sent from inside that instant.
_RACE = """
import asyncio, os, signal
from dispatcher.shutdown import Shutdown

async def main():
    shutdown = Shutdown()
    shutdown.install()
    loop = asyncio.get_running_loop()
    remove = loop.remove_signal_handler

    def remove_then_signal(sig):
        removed = remove(sig)
        os.kill(os.getpid(), signal.SIGTERM)
        return removed

    loop.remove_signal_handler = remove_then_signal
    shutdown.uninstall()
    print("survived", flush=True)

asyncio.run(main())
"""


def test_a_signal_in_the_instant_the_handler_is_removed_is_ignored() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _RACE], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert (done.returncode, done.stdout.strip()) == (0, "survived"), done.stderr[-2000:]
