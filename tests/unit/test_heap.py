"""The start-up's objects leave the collector's walk; later garbage is still collected."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def test_frozen_start_up_objects_are_not_walked_and_later_cycles_are_still_freed() -> None:
    # In a child process: freezing is for the life of a process, and this one runs other tests.
    script = textwrap.dedent(
        """
        import gc, json, weakref
        from conveyor import heap

        class Node:
            pass

        kept = [Node() for _ in range(5000)]   # loaded at start, lives for ever
        a = Node(); b = Node(); a.peer = b; b.peer = a   # start-up garbage: a cycle
        early = weakref.ref(a)
        del a, b
        frozen = heap.freeze_startup_objects()
        tracked_after = len(gc.get_objects())

        c = Node(); d = Node(); c.peer = d; d.peer = c   # garbage made once serving
        late = weakref.ref(c)
        del c, d
        seen = []
        heap.watch_pauses(lambda generation, seconds: seen.append((generation, seconds)))
        gc.collect()
        print(json.dumps({
            "observed": seen,
            "young_threshold": gc.get_threshold()[0],
            "frozen": frozen,
            "tracked_after": tracked_after,
            "early_freed": early() is None,
            "late_freed": late() is None,
            "kept": len(kept),
        }))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    seen = json.loads(run.stdout)
    assert seen["frozen"] >= 5000  # the kept objects, and everything imported
    assert seen["tracked_after"] < 100  # the collector's next walks skip them
    assert seen["early_freed"], "a cycle of the start-up was frozen instead of collected"
    assert seen["late_freed"], "garbage made after the freeze was not collected"
    assert seen["young_threshold"] == 7_000
    [(generation, seconds)] = seen["observed"]  # the one full collection, and how long it took
    assert generation == "2" and 0 <= seconds < 60
