"""`conveyor inject`: wires the dispatcher into a function's Kubernetes manifest."""

import typer


def inject() -> None:
    """Inject the dispatcher sidecar into a function manifest."""
    raise typer.Exit(2)
