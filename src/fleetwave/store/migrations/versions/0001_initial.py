"""Initial schema: conductors, groups, targets, workflows, strategies, steps, journal,
events, callbacks.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "conductors",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
        sa.Column("stopped_at", sa.Float),
    )
    op.create_table(
        "groups",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(255), nullable=False, unique=True),
        sa.Column("max_parallel", sa.Integer, nullable=False),
        sa.Column("apply_type", sa.String(16), nullable=False),
    )
    op.create_table(
        "targets",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(255), nullable=False, unique=True),
        sa.Column("group_id", sa.Integer, sa.ForeignKey("groups.id")),
        sa.Column("driver", sa.String(64), nullable=False),
        sa.Column("settings", sa.Text, nullable=False),
        sa.Column("managed", sa.Boolean, nullable=False),
        sa.Column("labels", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_targets_group_id", "targets", ["group_id"])
    op.create_table(
        "workflows",
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("source_yaml", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "strategies",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("workflow", sa.String(255), nullable=False),
        sa.Column("workflow_version", sa.Integer, nullable=False),
        sa.Column("states", sa.Text, nullable=False),
        sa.Column("state", sa.String(32), nullable=False),
        sa.Column("options", sa.Text, nullable=False),
        sa.Column("group_caps", sa.Text, nullable=False),
        sa.Column("step_count", sa.Integer, nullable=False),
        sa.Column("details", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("owner", sa.String(64)),
        sa.Column("fence", sa.Integer, nullable=False),
        sa.Column("lease_expires_at", sa.Float),
    )
    op.create_table(
        "steps",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("strategy_id", sa.Integer, sa.ForeignKey("strategies.id"), nullable=False),
        sa.Column("target_id", sa.Integer, sa.ForeignKey("targets.id"), nullable=False),
        sa.Column("ordinal", sa.Integer, nullable=False),
        sa.Column("stage", sa.Integer, nullable=False),
        sa.Column("group_id", sa.Integer),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("details", sa.Text, nullable=False),
        sa.Column("started_at", sa.Float),
        sa.Column("finished_at", sa.Float),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("fence", sa.Integer, nullable=False),
        sa.Column("owner", sa.String(64)),
        sa.Column("lease_expires_at", sa.Float),
    )
    op.create_index("ix_steps_strategy_state", "steps", ["strategy_id", "state"])
    op.create_index("ix_steps_target", "steps", ["target_id"])
    op.create_table(
        "journal",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("strategy_id", sa.Integer, nullable=False),
        sa.Column("step_id", sa.Integer, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("conductor", sa.String(64), nullable=False),
        sa.Column("from_state", sa.String(64), nullable=False),
        sa.Column("to_state", sa.String(64), nullable=False),
        sa.Column("fence", sa.Integer, nullable=False),
        sa.Column("details", sa.Text, nullable=False),
        sa.UniqueConstraint("step_id", "to_state", name="uq_journal_step_state"),
    )
    op.create_index("ix_journal_strategy", "journal", ["strategy_id", "id"])
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("conductor", sa.String(64)),
        sa.Column("strategy_id", sa.Integer),
        sa.Column("step_id", sa.Integer),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("details", sa.Text, nullable=False),
    )
    op.create_index("ix_events_strategy", "events", ["strategy_id", "id"])
    op.create_table(
        "callbacks",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("strategy_id", sa.Integer, nullable=False),
        sa.Column("step_id", sa.Integer, nullable=False),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("details", sa.Text, nullable=False),
        sa.Column("received_at", sa.Float, nullable=False),
        sa.Column("outcome", sa.String(16)),
        sa.Column("reason", sa.Text),
        sa.Column("processed_at", sa.Float),
    )
    op.create_index("ix_callbacks_open", "callbacks", ["strategy_id", "outcome", "id"])


def downgrade() -> None:
    for name in (
        "callbacks",
        "events",
        "journal",
        "steps",
        "strategies",
        "workflows",
        "targets",
        "groups",
    ):
        op.drop_table(name)
    op.drop_table("conductors")
