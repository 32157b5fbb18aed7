"""Initial schema: services, clients, grants, tasks, outbox, attempts, poison messages.

Revision ID: 0001
Revises:
Create Date: 2026-11-21 23:53:01.314531
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "clients",
        sa.Column("client_id", sa.Text(), nullable=False),
        sa.Column("secret_hash", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("client_id"),
    )
    op.create_table(
        "poison_messages",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("queue", sa.Text(), nullable=False),
        sa.Column(
            "received_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("headers", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("body", sa.LargeBinary(), nullable=True),
        sa.Column("body_size", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "services",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("queue_name", sa.Text(), nullable=False),
        sa.Column("capacity", sa.Integer(), nullable=True),
        sa.Column("json_schema", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("message_format", sa.Text(), server_default="cloudevents", nullable=False),
        sa.Column("task_timeout", sa.Integer(), server_default="300", nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default="3", nullable=False),
        sa.Column("retention_seconds", sa.BigInteger(), server_default="604800", nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "message_format IN ('cloudevents', 'legacy')", name="ck_services_format"
        ),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "tasks",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("task_id", sa.UUID(), nullable=False),
        sa.Column("client_id", sa.Text(), nullable=False),
        sa.Column("service", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default="PENDING", nullable=False),
        sa.Column("request", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("response", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("progress", sa.Float(), server_default="0", nullable=False),
        sa.Column("callback", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column(
            "submission_date",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("start_date", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_date", sa.DateTime(timezone=True), nullable=True),
        sa.Column("notification_status", sa.Text(), nullable=True),
        sa.Column("notification_attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("notify_claimed_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("worker_host", sa.Text(), nullable=True),
        sa.Column("attempt_id", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "status IN ('PENDING', 'IN_PROGRESS', 'SUCCESS', 'FAILURE')", name="ck_tasks_status"
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("task_id"),
    )
    op.create_index(
        "ix_tasks_finished",
        "tasks",
        ["service", "end_date"],
        unique=False,
        postgresql_where=sa.text("status IN ('SUCCESS', 'FAILURE')"),
    )
    op.create_index(
        "ix_tasks_notify",
        "tasks",
        ["id"],
        unique=False,
        postgresql_where=sa.text("notification_status = 'PENDING'"),
    )
    op.create_index(
        "ix_tasks_pending",
        "tasks",
        ["service", "id"],
        unique=False,
        postgresql_where=sa.text("status = 'PENDING'"),
    )
    op.create_index(
        "ix_tasks_pending_client",
        "tasks",
        ["service", "client_id"],
        unique=False,
        postgresql_where=sa.text("status = 'PENDING'"),
    )
    op.create_index("ix_tasks_submission_date", "tasks", ["submission_date"], unique=False)
    op.create_index(
        "ux_tasks_idempotency",
        "tasks",
        ["client_id", "service", "idempotency_key"],
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.create_table(
        "authorizations",
        sa.Column("client_id", sa.Text(), nullable=False),
        sa.Column("service", sa.Text(), nullable=False),
        sa.Column("capacity", sa.Integer(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(["client_id"], ["clients.client_id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["service"], ["services.name"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("client_id", "service"),
    )
    op.create_table(
        "outbox",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("task_id", sa.UUID(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("claimed_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.task_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(op.f("ix_outbox_task_id"), "outbox", ["task_id"], unique=False)
    op.create_table(
        "task_attempts",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("task_id", sa.UUID(), nullable=False),
        sa.Column("attempt_id", sa.Text(), nullable=False),
        sa.Column("worker_host", sa.Text(), nullable=True),
        sa.Column("start_date", sa.DateTime(timezone=True), nullable=False),
        sa.Column("end_date", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.Text(), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.task_id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("task_id", "attempt_id", name="ux_task_attempts_attempt"),
    )


def downgrade() -> None:
    op.drop_table("task_attempts")
    op.drop_index(op.f("ix_outbox_task_id"), table_name="outbox")
    op.drop_table("outbox")
    op.drop_table("authorizations")
    op.drop_index(
        "ux_tasks_idempotency",
        table_name="tasks",
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.drop_index("ix_tasks_submission_date", table_name="tasks")
    op.drop_index(
        "ix_tasks_pending_client",
        table_name="tasks",
        postgresql_where=sa.text("status = 'PENDING'"),
    )
    op.drop_index(
        "ix_tasks_pending", table_name="tasks", postgresql_where=sa.text("status = 'PENDING'")
    )
    op.drop_index(
        "ix_tasks_notify",
        table_name="tasks",
        postgresql_where=sa.text("notification_status = 'PENDING'"),
    )
    op.drop_index(
        "ix_tasks_finished",
        table_name="tasks",
        postgresql_where=sa.text("status IN ('SUCCESS', 'FAILURE')"),
    )
    op.drop_table("tasks")
    op.drop_table("services")
    op.drop_table("poison_messages")
    op.drop_table("clients")
