"""`conveyor db upgrade|downgrade`: the only way the schema changes."""

from __future__ import annotations

import typer

from conveyor.settings import GatewaySettings

app = typer.Typer(help="Database schema (Alembic migrations).", no_args_is_help=True)


@app.command()
def upgrade(revision: str = typer.Argument("head")) -> None:
    """Create the database if needed, then migrate it to REVISION (default: head)."""
    from gateway.migrate import ensure_database
    from gateway.migrate import upgrade as run_upgrade

    url = GatewaySettings().database_url
    if ensure_database(url):
        typer.echo("database created")
    run_upgrade(url, revision)
    typer.echo(f"database at {revision}")


@app.command()
def downgrade(revision: str = typer.Argument(...)) -> None:
    """Migrate the database down to REVISION (`base` removes everything)."""
    from gateway.migrate import downgrade as run_downgrade

    run_downgrade(GatewaySettings().database_url, revision)
    typer.echo(f"database at {revision}")
