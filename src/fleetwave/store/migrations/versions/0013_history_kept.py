"""History that survives ``strategy delete``: a deleted strategy keeps its row (state
``deleted``, ``deleted_at``), its journal, attempts, events and callbacks; its steps move
to ``deleted_steps``. ``fleetwave prune`` drops old history.

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("strategies") as batch:
        batch.add_column(sa.Column("deleted_at", sa.Float))
        batch.add_column(sa.Column("deleted_from", sa.String(32)))
    op.create_table(
        "deleted_steps",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("strategy_id", sa.Integer, nullable=False),
        sa.Column("target_id", sa.Integer, nullable=False),
        sa.Column("target", sa.String(255), nullable=False),
        sa.Column("ordinal", sa.Integer, nullable=False),
        sa.Column("stage", sa.Integer, nullable=False),
        sa.Column("group_id", sa.Integer),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("details", sa.Text, nullable=False),
        sa.Column("started_at", sa.Float),
        sa.Column("finished_at", sa.Float),
        sa.Column("attempt", sa.Integer, nullable=False),
    )
    op.create_index(
        "ix_deleted_steps_strategy_ordinal", "deleted_steps", ["strategy_id", "ordinal"]
    )


def downgrade() -> None:
    op.drop_index("ix_deleted_steps_strategy_ordinal", "deleted_steps")
    op.drop_table("deleted_steps")
    with op.batch_alter_table("strategies") as batch:
        batch.drop_column("deleted_from")
        batch.drop_column("deleted_at")
