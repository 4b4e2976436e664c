"""Callbacks on bounded cycles: a callback and an agent token name the visit of their
state they are for, so that a late callback of one visit is ignored (with its reason)
instead of answering the next visit. An agent token is unique per step, state and
visit (a visit's token stays valid for that visit's late reports). Rows written before
are visit 1.

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("callbacks") as batch:
        batch.add_column(sa.Column("visit", sa.Integer, nullable=False, server_default="1"))
    with op.batch_alter_table("agent_tokens") as batch:
        batch.add_column(sa.Column("visit", sa.Integer, nullable=False, server_default="1"))
        batch.drop_constraint("uq_agent_tokens_step_state", type_="unique")
        batch.create_unique_constraint(
            "uq_agent_tokens_step_state_visit", ["step_id", "state", "visit"]
        )


def downgrade() -> None:
    # (tokens of a later visit than the first are dropped: the older key cannot hold them)
    op.execute("DELETE FROM agent_tokens WHERE visit > 1")
    with op.batch_alter_table("agent_tokens") as batch:
        batch.drop_constraint("uq_agent_tokens_step_state_visit", type_="unique")
        batch.create_unique_constraint("uq_agent_tokens_step_state", ["step_id", "state"])
        batch.drop_column("visit")
    with op.batch_alter_table("callbacks") as batch:
        batch.drop_column("visit")
