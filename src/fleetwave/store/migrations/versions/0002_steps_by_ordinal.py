"""Index a strategy's steps by (strategy, ordinal) instead of (strategy, state).

Every transition changed the indexed state, so each one rewrote an index entry:
index pages written (and fsynced) on every group commit. The key (strategy,
ordinal) never changes after a strategy is created; it serves the same queries
(a strategy's steps, in admission order, filtered by state) without a sort.

Revision ID: 0002
Revises: 0001
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_steps_strategy_ordinal", "steps", ["strategy_id", "ordinal"])
    op.drop_index("ix_steps_strategy_state", table_name="steps")


def downgrade() -> None:
    op.create_index("ix_steps_strategy_state", "steps", ["strategy_id", "state"])
    op.drop_index("ix_steps_strategy_ordinal", table_name="steps")
