"""The gateway's (and the CLI's) configuration, from the environment (pydantic-settings).

Every setting has a safe default that points at loopback, so a newcomer runs the
platform with no configuration. Gateway settings use the `CONVEYOR_` prefix. The
dispatcher's settings are not here: the sidecar reads its own without importing pydantic
(conveyor/dispatcher_settings.py), and shares its broker defaults with these.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from conveyor.dispatcher_settings import (
    DEFAULT_AMQP_HEARTBEAT,
    DEFAULT_AMQP_URL,
    MAX_AMQP_HEARTBEAT,
    amqp_nodes,
)
from conveyor.events import MAX_TIMEOUT
from conveyor.logs import LogFormat, LogLevel

# The ranges a setting may take: a value outside them is refused at start, naming the variable.
# Unchecked, 0, a negative number or NaN started a gateway that misbehaved quietly (a loop
# interval of 0 spun a core; a NaN time to live made every submission 500). Durations end
# where PostgreSQL's intervals and Python's clocks still hold them.
Seconds = Annotated[float, Field(gt=0, le=MAX_TIMEOUT)]
SecondsOrNone = Annotated[float, Field(ge=0, le=MAX_TIMEOUT)]  # 0: none at all
Count = Annotated[int, Field(ge=1)]
# How often a loop runs: a billionth of a second took half a core idle (thousands of
# transactions a second), which a positive bound alone let through.
Interval = Annotated[float, Field(ge=0.01, le=MAX_TIMEOUT)]
# A connection's limits go to PostgreSQL as integer milliseconds (statement_timeout).
MAX_DB_TIMEOUT = (2**31 - 1) // 1000
# x-delivery-limit, and the header each submission carries it in (a 64-bit integer at most).
MAX_DELIVERY_LIMIT = 2**31 - 1

DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/conveyor"


_DATABASE_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg")
# A URL's scheme (RFC 3986), at the very start: a conninfo string may hold `://` in a value.
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def normalize_database_url(url: str) -> str:
    """Accept the plain `postgresql://` spelling; SQLAlchemy needs the driver named."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def _names_a_database(url: str) -> None:
    """Read as libpq reads it, and naming its database: libpq would quietly take the user's
    name for a missing one, and `conveyor db upgrade` would try to create "" (psycopg is the
    gateway's: the dispatcher never reads this setting)."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    scheme = _URL_SCHEME.match(url)
    if scheme and scheme[1] not in _DATABASE_SCHEMES:  # `mysql://…` was read as PostgreSQL's
        raise ValueError(f"not a PostgreSQL URL: the scheme must be one of {_DATABASE_SCHEMES}")
    try:
        params = conninfo_to_dict(f"postgresql://{url[scheme.end() :]}" if scheme else url)
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"not a PostgreSQL URL or conninfo: {str(exc).splitlines()[0]}") from None
    if not params.get("dbname"):
        raise ValueError("names no database (e.g. postgresql://user@host:5432/conveyor)")


SETTINGS_MODELS = ("CommonSettings", "GatewaySettings")  # a ValidationError's `title`


def refusals(error: ValidationError) -> list[str]:
    """One line per setting refused, named as it is set (`CONVEYOR_RELAY_INTERVAL`), with
    what it should be: what a command prints instead of pydantic's traceback."""
    return [
        f"CONVEYOR_{'_'.join(str(part) for part in problem['loc']).upper()}: {problem['msg']}"
        for problem in error.errors()
    ]


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore", allow_inf_nan=False)

    # One broker URL, or several nodes of a cluster separated by `;` (conveyor/connection.py).
    amqp_url: str = DEFAULT_AMQP_URL
    # AMQP heartbeat, seconds: a frozen node is noticed after a few of them.
    amqp_heartbeat: int = Field(DEFAULT_AMQP_HEARTBEAT, ge=0, le=MAX_AMQP_HEARTBEAT)
    log_level: LogLevel = LogLevel.INFO
    log_format: LogFormat = LogFormat.AUTO

    @field_validator("amqp_url")
    @classmethod
    def _names_nodes(cls, value: str) -> str:
        amqp_nodes(value)
        return value


class GatewaySettings(CommonSettings):
    database_url: str = DEFAULT_DATABASE_URL
    db_pool_size: Count = 10
    # A connection is lent at most this long: a frozen or silently cut-off server fails what
    # waits on it (503 503001; loops retry) instead of holding it for as long as it lasts.
    db_timeout: float = Field(10.0, gt=0, le=MAX_DB_TIMEOUT)
    max_body_bytes: Count = 1024 * 1024
    # A request must arrive whole (head and body) within this many seconds of its connection,
    # or of its first byte: a client that trickles it, or sends nothing, is dropped.
    request_read_timeout: Seconds = 60.0
    # An idle connection is kept this long after an answer: longer than the clients and proxies
    # in front keep theirs idle (httpx 5 s, nginx's upstream keep-alive and cloud load
    # balancers 60 s), else a request they send on it as the gateway closes it is lost.
    keep_alive_timeout: Seconds = 75.0
    # A batch submission (POST …/tasks/batch): how many tasks, and its own size limit.
    max_batch_items: Count = 1000
    max_batch_bytes: Count = 16 * 1024 * 1024
    # How far ahead a task may be scheduled (notBefore / delaySeconds), seconds.
    max_delay: int = Field(30 * 24 * 3600, ge=0, le=MAX_TIMEOUT)
    # bcrypt verifications are cached under a keyed hash of the credentials.
    auth_cache_ttl: SecondsOrNone = 30.0
    # Failed authentications per (client id, source address) pair, per minute, before that
    # pair's wrong secrets are refused without bcrypt when possible (the right one never is).
    auth_failures_per_minute: Count = 20
    # The proxies (addresses or CIDRs, comma-separated; `*` for any) whose X-Forwarded-For
    # names a request's source, for the throttle above. Empty: the connection's peer is.
    forwarded_allow_ips: str = ""
    # Crash redeliveries allowed before a submission is dead-lettered (SPEC §7.1).
    delivery_limit: int = Field(5, ge=1, le=MAX_DELIVERY_LIMIT)
    # A PENDING task older than this (bounded by its service's retention) fails.
    pending_ttl: Seconds = 24 * 3600
    # Tasks of any status older than this are purged whatever their service says.
    purge_max_age: Seconds = 90 * 24 * 3600
    purge_batch_size: Count = 5000
    # Signs every callback (HMAC-SHA256); the gateway refuses to start without a real one.
    callback_signing_secret: str = ""
    # The secret being rotated out: callbacks carry a second signature with it meanwhile.
    callback_previous_signing_secret: str = ""
    callback_allow_http: bool = False
    callback_allow_private: bool = False
    # Comma-separated host names exempt from the SSRF guard.
    callback_allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    callback_timeout: Seconds = 10.0
    callback_attempts: Count = 3
    callback_backoff: SecondsOrNone = 1.0
    # Callbacks delivered at once by one gateway: a slow target holds one slot, not the rest.
    callback_concurrency: Count = 20
    # Slots kept for targets (host and port) with nothing in flight: a target's further
    # deliveries take only slots that leave this many free, so targets that hang delay their
    # own callbacks, not everyone's.
    callback_per_target: Count = 5
    # A claimed callback is renewed while it is delivered; a dead replica's go out after this.
    callback_lease: Seconds = 30.0
    # How long a publish may take in all (reconnecting if it must, then the broker's confirm).
    publish_timeout: Seconds = 5.0
    # A confirmed submission is published again if the broker connection drops within this
    # long (a crashed broker may lose what it just confirmed); it is marked published within
    # a second all the same (gateway.outbox.MARK_AFTER).
    outbox_keep_confirmed: SecondsOrNone = 5.0
    relay_interval: Interval = 1.0
    # A comment line on each task event stream (SSE) after this many quiet seconds.
    stream_heartbeat: Interval = 15.0
    reaper_interval: Interval = 30.0
    # How often the gateway checks whether autovacuum, when off, left its tables' planner
    # statistics stale (gateway/planner_statistics.py).
    analyze_interval: Interval = 5.0
    # An IN_PROGRESS task whose worker says nothing for its service's taskTimeout times maxAttempts
    # plus this margin fails: its worker is gone, or its result was lost.
    silence_margin: SecondsOrNone = 300.0
    service_refresh_interval: Interval = 5.0
    # What the results a gateway has received and not applied yet may weigh, bytes (one result
    # alone may weigh more): past it, a result queue waits (gateway/results.py).
    results_memory: Count = 64 * 1024 * 1024
    # How often the gateway looks for the `-in` of each service with PENDING tasks: one deleted
    # (an operator, a node lost) is declared again and its tasks published again.
    queue_check_interval: Interval = 10.0
    # The per-service gauges of /metrics (tasks by status, queue depths) are this fresh.
    stats_interval: Interval = 15.0

    @property
    def outbox_grace(self) -> float:
        """How long an outbox row is left to its fast-path publish before the relay takes it.

        Twice the publish timeout (that publish ends, confirmed or failed, within one; the
        other covers its wait before it starts), plus the time a confirmed row is kept: the
        relay does not publish a second copy of a submission whose confirm is merely slow.
        """
        return 2 * self.publish_timeout + self.outbox_keep_confirmed

    def signing_secret_problem(self) -> str | None:
        """Why the callback signing secret is unfit to run a gateway with, if it is."""
        secret = self.callback_signing_secret
        if not secret or secret == "change-me":
            return (
                "CONVEYOR_CALLBACK_SIGNING_SECRET is not set: consumers could not verify callbacks"
            )
        if len(secret) < 16:
            return "CONVEYOR_CALLBACK_SIGNING_SECRET must be at least 16 characters"
        previous = self.callback_previous_signing_secret
        if previous and len(previous) < 16:
            return "CONVEYOR_CALLBACK_PREVIOUS_SIGNING_SECRET must be at least 16 characters"
        return None

    @field_validator("database_url")
    @classmethod
    def _normalize(cls, value: str) -> str:
        url = normalize_database_url(value)
        _names_a_database(url)
        return url

    @field_validator("purge_max_age")
    @classmethod
    def _outlives_a_waiting_task(cls, value: float, info: ValidationInfo) -> float:
        """Shorter, the purge would delete tasks still waiting to run before they expire
        (FAILURE, and their callback): they would vanish, never ended."""
        pending_ttl = info.data.get("pending_ttl")
        if pending_ttl is not None and value < pending_ttl:
            raise ValueError(
                f"must be at least CONVEYOR_PENDING_TTL ({pending_ttl:g} s): the purge would"
                " delete tasks still waiting to run before they expire"
            )
        return value

    @field_validator("callback_allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [h.strip().lower() for h in value.split(",") if h.strip()]
        return value
