"""Alembic environment: runs migrations on CONVEYOR_DATABASE_URL (or the URL the
caller put in the config), synchronously through psycopg.

psycopg opens the connection from the URL as libpq reads it, so a host list and
`target_session_attrs` work as they do for the gateway; SQLAlchemy only names the dialect.
"""

from __future__ import annotations

import psycopg
from alembic import context
from sqlalchemy import create_engine, pool

from conveyor.settings import GatewaySettings, normalize_database_url
from gateway.database_url import libpq
from gateway.models import metadata

config = context.config


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    return normalize_database_url(url) if url else GatewaySettings().database_url


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


# How long a revision waits for a table's lock (a long transaction holds it) before it gives
# up, and `gateway.migrate` tries again: while it waits, every statement on that table, the
# running gateways' included, queues behind it.
LOCK_TIMEOUT = "5s"


def _connect(url: str) -> psycopg.Connection[object]:
    connection = psycopg.connect(libpq(url))
    connection.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
    connection.commit()
    return connection


def run_online() -> None:
    url = _url()
    engine = create_engine(
        "postgresql+psycopg://",
        creator=lambda: _connect(url),
        poolclass=pool.NullPool,
    )
    with engine.connect() as connection:
        # Each revision in a transaction of its own: the locks a revision takes are held
        # until it commits, not until the last one does (a rolling update migrates under
        # running gateways).
        context.configure(
            connection=connection, target_metadata=metadata, transaction_per_migration=True
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
