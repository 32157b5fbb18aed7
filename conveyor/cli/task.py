"""Consumer CLI: `conveyor task submit|get|watch` (owned by the client SDK work)."""

import typer

app = typer.Typer(help="Submit and follow tasks through the gateway.", no_args_is_help=True)
