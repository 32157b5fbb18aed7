"""`python -m dispatcher`: the sidecar, configured by environment variables."""

import os
import signal
import sys


def exit_on_early_signals() -> None:
    """SIGTERM or SIGINT exits 0 at once, until `shutdown.Shutdown.install` takes over.

    First thing in the process, with nothing but the standard library: the imports and set-up
    that follow take a few tenths of a second, a pod may be stopped meanwhile (a scale-in right
    after a scale-out), and the default actions turned that orderly stop into exit code 143 or
    a KeyboardInterrupt traceback. Nothing is held yet: no connection, no message. `os._exit`
    rather than an exception, which a `finally` or a `__del__` could swallow, and the signal
    with it.
    """
    for sig in (signal.SIGTERM, signal.SIGINT):  # those `Shutdown` handles once installed
        signal.signal(sig, _exit_at_once)


def _exit_at_once(signum: int, _frame: object) -> None:
    os.write(2, f"{signal.Signals(signum).name} while starting: stopped\n".encode())
    os._exit(0)


if __name__ == "__main__":
    exit_on_early_signals()
    from dispatcher.main import main

    sys.exit(main())
