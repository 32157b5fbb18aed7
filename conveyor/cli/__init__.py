"""The `conveyor` console script: the top of the house, above both apps.

`conveyor dispatcher` runs next to every function, where start-up time and
memory are part of the product (ready within 1 s, 50 MB): it goes straight to
the dispatcher. Every other command loads the CLI framework (typer, rich) from
`conveyor.cli.app`, whose command modules import their component lazily, so
`conveyor dispatcher` works in an image without the gateway's dependencies.
"""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:] == ["dispatcher"]:  # as `python -m dispatcher` does
        from dispatcher.__main__ import exit_on_early_signals

        exit_on_early_signals()
        from dispatcher.main import main as dispatcher

        sys.exit(dispatcher())
    from pydantic import ValidationError

    from conveyor.cli.app import app
    from conveyor.settings import SETTINGS_MODELS, refusals

    try:
        app()
    except ValidationError as exc:  # a setting it cannot run with: named, one line each
        if exc.title not in SETTINGS_MODELS:
            raise
        for refusal in refusals(exc):
            print(f"error: {refusal}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:
        _fail_plainly(exc)


def _fail_plainly(exc: Exception) -> None:
    """A missing extra or an operator's situation (conveyor.cli.failures) in one line; any
    other exception is raised on, traceback and all."""
    from conveyor.cli.failures import explain

    if isinstance(exc, ModuleNotFoundError):  # a command of a component whose extra is missing
        component = "dispatcher" if sys.argv[1:2] == ["dispatcher"] else "gateway"
        print(
            f"error: {exc.name} is not installed; this command needs"
            f" pip install 'conveyor[{component}]'",
            file=sys.stderr,
        )
        sys.exit(2)
    message = explain(exc)
    if message is None:
        raise exc
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)
