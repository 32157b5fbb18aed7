"""The `conveyor` console script.

`conveyor dispatcher` is the one command that runs next to every function, where
start-up time and memory are part of the product (SPEC §10: ready within 1 s,
50 MB). It goes straight to the dispatcher; every other command loads the CLI
framework (typer, rich).
"""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:] == ["dispatcher"]:
        from conveyor.settings import DispatcherSettings
        from dispatcher.main import run

        sys.exit(run(DispatcherSettings()))
    from conveyor.cli import main as cli_main

    cli_main()
