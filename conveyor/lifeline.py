"""A child process that ends with its parent: Linux's parent-death signal.

A supervisor killed outright (SIGKILL, the OOM killer) stops none of its children: they went on
as orphans holding its ports (`make up`'s programs; a `--workers` gateway's workers, one still
running the background loops, and the next gateway could not bind). Each child asks the kernel
for SIGTERM when its parent goes, which ends it as a stop does.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """SIGTERM to this process when its parent ends; `parent`, if given, is the pid it must
    have: one that ended before this was asked cannot signal, so that is checked after."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return  # not Linux: a stop still ends the children, a SIGKILL does not
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
