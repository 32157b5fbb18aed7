"""The single `conveyor` entry point.

Each command group lives in its own module and imports its component lazily, so
that `conveyor dispatcher` works in an image without the gateway's dependencies.
"""

import typer

from conveyor.cli import admin, db, inject, run, task

app = typer.Typer(
    name="conveyor",
    help="Asynchronous HTTP functions on Kubernetes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(db.app, name="db")
app.add_typer(admin.app, name="admin")
app.add_typer(task.app, name="task")
app.command("gateway")(run.gateway)
app.command("dispatcher")(run.dispatcher)
app.command("purge")(run.purge)
app.command("inject")(inject.inject)


def main() -> None:
    app()
