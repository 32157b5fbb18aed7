"""Configuration, from the environment (pydantic-settings).

Every setting has a safe default that points at loopback, so a newcomer runs the
platform with no configuration. Gateway settings use the `CONVEYOR_` prefix; the
dispatcher's own variables (SPEC §7) are accepted with or without it, because
Kubernetes manifests conventionally spell them bare (`FUNCTION_URL`).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/conveyor"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
# Short enough that a frozen broker node is left within a minute, long enough that a
# busy 2-core machine never misses one.
DEFAULT_AMQP_HEARTBEAT = 15


def normalize_database_url(url: str) -> str:
    """Accept the plain `postgresql://` spelling; SQLAlchemy needs the driver named."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


class LogFormat(enum.StrEnum):
    AUTO = "auto"  # readable on a terminal, JSON otherwise
    JSON = "json"
    TEXT = "text"


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    # One broker URL, or several nodes of a cluster separated by `;` (conveyor/connection.py).
    amqp_url: str = DEFAULT_AMQP_URL
    # AMQP heartbeat, seconds: a frozen node is noticed after a few of them.
    amqp_heartbeat: int = Field(DEFAULT_AMQP_HEARTBEAT, ge=0)
    log_level: str = "INFO"
    log_format: LogFormat = LogFormat.AUTO


class GatewaySettings(CommonSettings):
    database_url: str = DEFAULT_DATABASE_URL
    db_pool_size: int = 10
    max_body_bytes: int = 1024 * 1024
    # A batch submission (POST …/tasks/batch): how many tasks, and its own size limit.
    max_batch_items: int = 1000
    max_batch_bytes: int = 16 * 1024 * 1024
    # How far ahead a task may be scheduled (notBefore / delaySeconds), seconds.
    max_delay: int = Field(30 * 24 * 3600, ge=0)
    # bcrypt verifications are cached under a keyed hash of the credentials.
    auth_cache_ttl: float = 30.0
    # Failed authentications per (client id, source address) pair, per minute, before that
    # pair's wrong secrets are refused without bcrypt when possible (the right one never is).
    auth_failures_per_minute: int = 20
    # Crash redeliveries allowed before a submission is dead-lettered (SPEC §7.1).
    delivery_limit: int = 5
    # A PENDING task older than this (bounded by its service's retention) fails.
    pending_ttl: float = 24 * 3600
    # Tasks of any status older than this are purged whatever their service says.
    purge_max_age: float = 90 * 24 * 3600
    purge_batch_size: int = 5000
    # Signs every callback (HMAC-SHA256); the gateway refuses to start without a real one.
    callback_signing_secret: str = ""
    callback_allow_http: bool = False
    callback_allow_private: bool = False
    # Comma-separated host names exempt from the SSRF guard.
    callback_allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    callback_timeout: float = 10.0
    callback_attempts: int = 3
    callback_backoff: float = 1.0
    # Callbacks delivered at once by one gateway: a slow target holds one slot, not the rest.
    callback_concurrency: int = 20
    # A claimed callback is renewed while it is delivered; a dead replica's go out after this.
    callback_lease: float = 30.0
    # How long a publish may take in all (reconnecting if it must, then the broker's confirm).
    publish_timeout: float = 5.0
    # A confirmed submission stays in the outbox this long, and is published again if the
    # broker connection drops meanwhile: a crashed broker may lose what it just confirmed.
    outbox_keep_confirmed: float = 5.0
    relay_interval: float = 1.0
    # A comment line on each task event stream (SSE) after this many quiet seconds.
    stream_heartbeat: float = Field(15.0, gt=0)
    reaper_interval: float = 30.0
    # An IN_PROGRESS task whose worker says nothing for its service's taskTimeout times maxAttempts
    # plus this margin fails: its worker is gone, or its result was lost.
    silence_margin: float = 300.0
    service_refresh_interval: float = 5.0
    # The per-service gauges of /metrics (tasks by status, queue depths) are this fresh.
    stats_interval: float = Field(15.0, gt=0)

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
        return None

    @field_validator("database_url")
    @classmethod
    def _normalize(cls, value: str) -> str:
        return normalize_database_url(value)

    @field_validator("callback_allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [h.strip().lower() for h in value.split(",") if h.strip()]
        return value


def _env(name: str) -> AliasChoices:
    return AliasChoices(f"CONVEYOR_{name}", name)


class ShutdownMode(enum.StrEnum):
    REQUEUE = "requeue"
    DRAIN = "drain"


class DispatcherSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    amqp_url: str = Field(DEFAULT_AMQP_URL, validation_alias=_env("AMQP_URL"))
    amqp_heartbeat: int = Field(
        DEFAULT_AMQP_HEARTBEAT, ge=0, validation_alias=_env("AMQP_HEARTBEAT")
    )
    queue: str = Field("sleeper", validation_alias=_env("QUEUE"))
    function_url: str = Field("http://127.0.0.1:8080/", validation_alias=_env("FUNCTION_URL"))
    function_ready_url: str | None = Field(None, validation_alias=_env("FUNCTION_READY_URL"))
    concurrency: int = Field(4, ge=1, le=1000, validation_alias=_env("CONCURRENCY"))
    # Messages held beyond CONCURRENCY (prefetch = CONCURRENCY + this), so that the next one is
    # already here when a call ends: a slot is free again as soon as the function has answered,
    # while its terminal event is confirmed and its message acked in the background.
    prefetch_buffer: int = Field(0, ge=0, le=1000, validation_alias=_env("PREFETCH_BUFFER"))
    shutdown_mode: ShutdownMode = Field(
        ShutdownMode.REQUEUE, validation_alias=_env("SHUTDOWN_MODE")
    )
    drain_timeout: float = Field(30.0, ge=0, validation_alias=_env("DRAIN_TIMEOUT"))
    dispatcher_port: int = Field(8081, validation_alias=_env("DISPATCHER_PORT"))
    metrics_port: int | None = Field(None, validation_alias=_env("METRICS_PORT"))
    # Knative mode (SPEC §11.5): progress reports from the function's pods reach the dispatcher
    # on POD_IP:PROGRESS_PORT, with each attempt's token in the URL.
    progress_port: int | None = Field(None, validation_alias=_env("PROGRESS_PORT"))
    pod_ip: str | None = Field(None, validation_alias=_env("POD_IP"))
    one_shot: bool = Field(False, validation_alias=_env("ONE_SHOT"))
    idle_exit_seconds: float = Field(60.0, validation_alias=_env("IDLE_EXIT_SECONDS"))
    hostname: str = Field("localhost", validation_alias=_env("HOSTNAME"))
    # Used when a message does not carry its service's values (legacy format).
    max_attempts: int = Field(3, ge=1, validation_alias=_env("MAX_ATTEMPTS"))
    task_timeout: float = Field(300.0, gt=0, validation_alias=_env("TASK_TIMEOUT"))
    retry_backoff: float = Field(0.5, ge=0, validation_alias=_env("RETRY_BACKOFF"))
    retry_backoff_max: float = Field(30.0, ge=0, validation_alias=_env("RETRY_BACKOFF_MAX"))
    progress_interval: float = Field(0.5, ge=0, validation_alias=_env("PROGRESS_INTERVAL"))
    # `started` goes out only once a call has run this long (0: always at once); a shorter
    # call sends its terminal event alone, carrying the host and start time. One confirmed
    # publish and one row write fewer per short task (legacy services always get `started`).
    started_delay_ms: int = Field(100, ge=0, validation_alias=_env("STARTED_DELAY_MS"))
    # The longest answer read from the function: a longer one fails its task (RabbitMQ's own
    # limit on a message, 128 MiB by default, must never be reached: it closes the channel).
    max_response_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, validation_alias=_env("MAX_RESPONSE_BYTES")
    )
    function_wait_timeout: float = Field(
        300.0, ge=0, validation_alias=_env("FUNCTION_WAIT_TIMEOUT")
    )
    # How long a cancelled task's id is remembered (SPEC §11.1): its message may still be
    # queued, or requeued by another dispatcher, meanwhile.
    cancel_memory_seconds: float = Field(
        24 * 3600.0, gt=0, validation_alias=_env("CANCEL_MEMORY_SECONDS")
    )
    log_level: str = Field("INFO", validation_alias=_env("LOG_LEVEL"))
    log_format: LogFormat = Field(LogFormat.AUTO, validation_alias=_env("LOG_FORMAT"))


def dispatcher_variable(field: str, prefixed: bool = False) -> str:
    """The environment variable that sets a dispatcher setting, as a manifest spells it:
    bare (`FUNCTION_URL`), or with `prefixed` the `CONVEYOR_` form for names too generic to
    stand alone in a pod's environment (`CONVEYOR_QUEUE`)."""
    alias = DispatcherSettings.model_fields[field].validation_alias
    assert isinstance(alias, AliasChoices)
    with_prefix, bare = (str(choice) for choice in alias.choices)
    return with_prefix if prefixed else bare
