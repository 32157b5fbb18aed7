"""The `conveyor` command groups, each in its own module."""

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
