"""The database engine: one async SQLAlchemy engine per process, over psycopg 3."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from conveyor.settings import GatewaySettings


def create_engine(settings: GatewaySettings) -> AsyncEngine:
    return create_async_engine(
        settings.database_url,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_pool_size,
        pool_pre_ping=True,  # survive a PostgreSQL restart without failing the first request
        pool_recycle=300,
    )
