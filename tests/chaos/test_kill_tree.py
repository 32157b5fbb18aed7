"""The fault harness's SIGKILL of a server and all its processes (tests/support/servers.py).

Found by CI: `make test`'s small chaos run crashed its private PostgreSQL, and the restart
never opened the port (60 s): the postmaster had forked a backend while its children were
being listed, that backend outlived the kill, and a cluster whose shared memory an old
process still holds refuses to start. Here a process that forks without pause stands in for
a busy postmaster: after the kill, not one of its processes may be left.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

from tests.support.servers import _kill_tree

# Forks a sleeping child every millisecond, as a postmaster under a reconnecting load does.
FORKER = """
import os, sys, time
while True:
    if os.fork() == 0:
        time.sleep(30)
        os._exit(0)
    time.sleep(0.001)
"""


def _alive_with(marker: str) -> list[int]:
    """Our processes whose command line carries `marker`, zombies excepted."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "cmdline").read_bytes().decode(errors="replace"):
                continue
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def test_a_process_forking_while_it_is_killed_leaves_no_child_behind() -> None:
    survivors: list[int] = []
    for _ in range(10):
        marker = f"kill-tree-{uuid.uuid4().hex}"
        forker = subprocess.Popen([sys.executable, "-c", FORKER, marker], start_new_session=True)
        time.sleep(0.3)  # a few hundred children already, more every millisecond
        _kill_tree(forker.pid)
        forker.wait(timeout=10)
        time.sleep(0.2)
        left = _alive_with(marker)
        for pid in left:  # ours: started just above, ended by pid
            subprocess.run(["kill", "-9", str(pid)], check=False)
        survivors += left
    assert survivors == [], f"{len(survivors)} processes outlived the kill"
