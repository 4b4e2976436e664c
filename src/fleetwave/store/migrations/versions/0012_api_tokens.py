"""Tokens of the REST API: bearer tokens with a role (``fleetwave token create``), and
the agent tokens the engine issues to a step's wait-for-callback state. Only a hash of
each is stored. A callback may carry its sender's idempotency key: the same key for
the same step is stored once.

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(255), nullable=False, unique=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float),
        sa.Column("revoked_at", sa.Float),
    )
    op.create_table(
        "agent_tokens",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("strategy_id", sa.Integer, nullable=False),
        sa.Column("step_id", sa.Integer, nullable=False),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False, unique=True),
        sa.Column("issued_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float),
        sa.UniqueConstraint("step_id", "state", name="uq_agent_tokens_step_state"),
        sa.Index("ix_agent_tokens_strategy", "strategy_id"),
    )
    with op.batch_alter_table("callbacks") as batch:
        batch.add_column(sa.Column("idempotency_key", sa.String(200)))
        batch.create_index("uq_callbacks_step_key", ["step_id", "idempotency_key"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("callbacks") as batch:
        batch.drop_index("uq_callbacks_step_key")
        batch.drop_column("idempotency_key")
    op.drop_table("agent_tokens")
    op.drop_table("api_tokens")
