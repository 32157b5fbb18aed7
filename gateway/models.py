"""The schema, as SQLAlchemy Core tables.

Alembic migrations in `migrations/` are the only way the schema changes; this
module describes the same tables for queries. The indexes are chosen for the
three hot questions at millions of finished rows: "where is this task" (unique
task_id), "how many PENDING before me / in total" (partial indexes on PENDING
only, so their size follows the backlog, not the history), and "what is due for
purge / notification" (partial indexes again).
"""

from __future__ import annotations

import enum

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

metadata = MetaData()


class TaskStatus(enum.StrEnum):
    PENDING = "PENDING"
    IN_PROGRESS = "IN_PROGRESS"
    SUCCESS = "SUCCESS"
    FAILURE = "FAILURE"


def _now() -> Column:
    return Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now())


def _updated() -> Column:
    return Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now())


services = Table(
    "services",
    metadata,
    Column("name", Text, primary_key=True),
    Column("queue_name", Text, nullable=False),
    Column("capacity", Integer),
    Column("json_schema", JSONB),
    Column("message_format", Text, nullable=False, server_default="cloudevents"),
    Column("task_timeout", Integer, nullable=False, server_default="300"),
    Column("max_attempts", Integer, nullable=False, server_default="3"),
    Column("retention_seconds", BigInteger, nullable=False, server_default=str(7 * 86400)),
    _now(),
    _updated(),
    CheckConstraint("message_format IN ('cloudevents', 'legacy')", name="ck_services_format"),
)

# The queue names services moved away from (a trigger on `services` records them, migration
# 0011): the gateways consume their result queues until the operator deletes them, or the
# service is removed.
moved_queues = Table(
    "moved_queues",
    metadata,
    Column("queue_name", Text, primary_key=True),
    Column(
        "service",
        Text,
        ForeignKey("services.name", ondelete="CASCADE", onupdate="CASCADE"),
        nullable=False,
    ),
    Column("moved_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

# Cancels the broker has not taken yet (migration 0019): any gateway tells them
# (gateway.cancel.Broadcast), and removes each once it did.
untold_cancels = Table(
    "untold_cancels",
    metadata,
    Column("task_id", UUID(as_uuid=True), primary_key=True),
    Column("service", Text, nullable=False),
    Column("queue_names", ARRAY(Text), nullable=False),
    Column("retry_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("ix_untold_cancels_retry_at", "retry_at"),
)

clients = Table(
    "clients",
    metadata,
    Column("client_id", Text, primary_key=True),
    Column("secret_hash", Text, nullable=False),
    _now(),
    _updated(),
)

operators = Table(
    "operators",
    metadata,
    Column("operator_id", Text, primary_key=True),
    Column("secret_hash", Text, nullable=False),
    _now(),
    _updated(),
)

authorizations = Table(
    "authorizations",
    metadata,
    Column("client_id", Text, ForeignKey("clients.client_id", ondelete="CASCADE"), nullable=False),
    Column("service", Text, ForeignKey("services.name", ondelete="CASCADE"), nullable=False),
    Column("capacity", Integer),
    _now(),
    PrimaryKeyConstraint("client_id", "service"),
)

tasks = Table(
    "tasks",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("task_id", UUID(as_uuid=True), nullable=False, unique=True),
    Column("client_id", Text, nullable=False),
    Column("service", Text, nullable=False),
    Column("status", Text, nullable=False, server_default="PENDING"),
    Column("request", JSONB, nullable=False),
    # The body as accepted (0020): `json` keeps its text, which the relay publishes (jsonb
    # wrote 1e308 out in 309 digits); NULL on older rows, published from `request`.
    Column("request_json", JSON),
    Column("response", JSONB),
    Column("error_message", Text),
    Column("progress", Float, nullable=False, server_default="0"),
    Column("callback", JSONB),
    Column("submission_date", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("start_date", DateTime(timezone=True)),
    Column("end_date", DateTime(timezone=True)),
    Column("notification_status", Text),
    Column("notification_attempts", Integer, nullable=False, server_default="0"),
    Column("notify_claimed_until", DateTime(timezone=True)),
    Column("worker_host", Text),
    Column("attempt_id", Text),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("idempotency_key", Text),
    # SHA-256 of the request the key was used for (0013); NULL without a key, or from before
    Column("idempotency_fingerprint", LargeBinary),
    Column("not_before", DateTime(timezone=True)),  # run later (SPEC §11.4)
    Column("traceparent", Text),  # W3C trace context: the task's trace (SPEC §11.6)
    # The task row is the outbox: when the relay may publish it; NULL once published.
    Column("publish_at", DateTime(timezone=True)),
    Column("publish_attempts", Integer, nullable=False, server_default="0"),
    Column("publish_error", Text),
    # Seconds the watchdog waits for a word about the task (its margin apart): timeout times
    # attempts as its message says them; NULL on rows older than migration 0010.
    Column("time_limit", Integer),
    # When a PENDING task fails "expired": its message's own expiry (0012). NULL on rows older
    # than that, until the reaper's next pass gives them one.
    Column("expires_at", DateTime(timezone=True)),
    # Set by a cancel, in the transaction that ends the task (0014): a function's own failure
    # may carry the same message.
    Column("cancelled_at", DateTime(timezone=True)),
    # A `requeued` read while the task was PENDING, before its own `started` (0015): that
    # `started` then records the attempt as handed back instead of starting it.
    Column("handed_back_attempt", Text),
    Column("handed_back_at", DateTime(timezone=True)),
    # Every such attempt (0018), its id to its hand-back's time, until its `started` is read;
    # the two columns above keep the last one, for gateways of the release before.
    Column("handed_back", JSONB),
    _updated(),
    CheckConstraint(
        "status IN ('PENDING', 'IN_PROGRESS', 'SUCCESS', 'FAILURE')", name="ck_tasks_status"
    ),
    Index(
        "ix_tasks_pending",
        "service",
        "id",
        postgresql_where=text("status = 'PENDING'"),
        postgresql_include=["not_before"],
    ),
    # the reaper reads only the PENDING tasks past their expiry, or without one yet (0012)
    Index("ix_tasks_pending_expiry", "expires_at", postgresql_where=text("status = 'PENDING'")),
    Index(
        "ux_tasks_idempotency",
        "client_id",
        "service",
        "idempotency_key",
        unique=True,
        postgresql_where=text("idempotency_key IS NOT NULL"),
    ),
    Index("ix_tasks_notify", "id", postgresql_where=text("notification_status = 'PENDING'")),
    Index(
        "ix_tasks_finished",
        "service",
        "end_date",
        postgresql_where=text("status IN ('SUCCESS', 'FAILURE')"),
        postgresql_include=["status", "start_date"],  # the admin figures, index-only
    ),
    Index("ix_tasks_submission_date", "submission_date"),
    Index("ix_tasks_service_id", "service", "id"),  # the admin API's newest first
    Index("ix_tasks_running", "service", postgresql_where=text("status = 'IN_PROGRESS'")),
    Index(
        "ix_tasks_unpublished", "publish_at", "id", postgresql_where=text("publish_at IS NOT NULL")
    ),
    # the PENDING tasks that wait for their time: counted live in a position, once due
    Index(
        "ix_tasks_pending_later",
        "service",
        "not_before",
        postgresql_where=text("status = 'PENDING' AND not_before IS NOT NULL"),
        postgresql_include=["id"],
    ),
)

# How many PENDING tasks each service and client has, kept by triggers on `tasks` (migration
# 0008) so that a position or a capacity check sums a few rows instead of counting the
# backlog. `shard`: the writing backend's pid, so that no two transactions share a row (-1:
# the reaper's merged counts); only sums mean anything.
task_backlog = Table(
    "task_backlog",
    metadata,
    Column("service", Text, nullable=False),
    Column("client_id", Text, nullable=False),
    Column("shard", Integer, nullable=False),
    Column("pending", BigInteger, nullable=False),
    PrimaryKeyConstraint("service", "client_id", "shard"),
)

# The PENDING tasks without a notBefore, per block of 1,024 row ids (`store.BLOCK_BITS`): a
# submission's position sums the service's blocks, a PENDING task's the blocks before its own.
task_backlog_blocks = Table(
    "task_backlog_blocks",
    metadata,
    Column("service", Text, nullable=False),
    Column("block", BigInteger, nullable=False),
    Column("shard", Integer, nullable=False),
    Column("pending", BigInteger, nullable=False),
    PrimaryKeyConstraint("service", "block", "shard"),
)

task_attempts = Table(
    "task_attempts",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column(
        "task_id",
        UUID(as_uuid=True),
        ForeignKey("tasks.task_id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("attempt_id", Text, nullable=False),
    Column("worker_host", Text),
    Column("start_date", DateTime(timezone=True), nullable=False),
    Column("end_date", DateTime(timezone=True)),
    Column("outcome", Text),
    Column("error_message", Text),
    UniqueConstraint("task_id", "attempt_id", name="ux_task_attempts_attempt"),
)

poison_messages = Table(
    "poison_messages",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("queue", Text, nullable=False),
    Column("received_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("reason", Text, nullable=False),
    Column("headers", JSONB),
    Column("body", LargeBinary),
    Column("body_size", Integer, nullable=False),
)

# What /readyz writes to (`SELECT setval(...)`): a commit that must reach a synchronous standby,
# as a submission's must (migration 0017).
readiness_writes = Sequence("readiness_writes", metadata=metadata)
