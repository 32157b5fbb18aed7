"""The planner's statistics of Conveyor's busiest tables, kept fresh when autovacuum does not.

The hot statements are prepared once per pooled connection, and PostgreSQL keeps the generic
plan it chose the first times they ran. Chosen while `tasks` was empty, that plan is a
sequential scan (cheapest for a few rows), and it stays one as the table grows: every results
batch and every publish then reads the whole table (1.3 ms a batch at 20,000 rows against
0.08 ms with an index, bench/README.md, "Plans made on an empty table"). An ANALYZE makes
PostgreSQL drop those plans and plan again with the table's real size. Autovacuum runs it; with
autovacuum off (server-wide, or for the table) nothing does, so this loop applies autovacuum's
own rule (`autovacuum_analyze_threshold` + `autovacuum_analyze_scale_factor` times rows) to the
tables below. With autovacuum on it never acts. One replica at a time (an advisory lock), and
never waiting for a lock another ANALYZE or a VACUUM holds.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
from psycopg import sql

from conveyor import logs
from gateway import metrics, supervisor
from gateway.pgpool import MAINTENANCE_TIMEOUT, Pool

log = logging.getLogger("conveyor.gateway.planner_statistics")

TABLES = ("tasks", "task_attempts", "task_backlog", "task_backlog_blocks")

# Stale: more rows changed since the last ANALYZE than autovacuum would allow, on a table
# autovacuum leaves alone, that this role may analyze (ANALYZE skips others with a warning).
_STALE = """
    SELECT s.relname
      FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
     WHERE s.schemaname = current_schema() AND s.relname = ANY(%(tables)s)
       AND (current_setting('autovacuum') = 'off'
            OR EXISTS (SELECT FROM unnest(c.reloptions) o
                        WHERE o ~* '^autovacuum_enabled=(false|off|no|0)$'))
       AND pg_has_role(c.relowner, 'USAGE')
       AND s.n_mod_since_analyze > current_setting('autovacuum_analyze_threshold')::float8
           + current_setting('autovacuum_analyze_scale_factor')::float8 * greatest(c.reltuples, 0)
     ORDER BY s.relname
    """
_LOCK = "SELECT pg_try_advisory_xact_lock(hashtext('conveyor.analyze'))"


async def refresh(conn: psycopg.AsyncConnection[Any]) -> list[str]:
    """ANALYZE the stale tables, unless another replica is at it; the tables analyzed."""
    rows = await (await conn.execute(_STALE, {"tables": list(TABLES)})).fetchall()
    stale = [row[0] for row in rows]
    if not stale:
        return []
    async with conn.transaction():
        locked = await (await conn.execute(_LOCK)).fetchone()
        if locked is None or not locked[0]:
            return []
        await conn.execute("SET LOCAL lock_timeout = '1s'")
        await conn.execute(
            sql.SQL("ANALYZE {}").format(sql.SQL(", ").join(map(sql.Identifier, stale)))
        )
    for table in stale:
        metrics.TABLES_ANALYZED.labels(table).inc()
    log.info("analyzed tables autovacuum left stale", extra={"tables": stale})
    return stale


async def analyze_loop(pool: Pool, interval: float) -> None:
    while True:
        try:
            async with pool.connection(MAINTENANCE_TIMEOUT) as conn:
                await refresh(conn)
            supervisor.pass_succeeded()
        except Exception as exc:  # lock timeout, outage: the next pass tries again
            supervisor.pass_failed(exc)
            log.warning("statistics pass failed", extra={"error": logs.describe(exc)})
        await asyncio.sleep(interval)
