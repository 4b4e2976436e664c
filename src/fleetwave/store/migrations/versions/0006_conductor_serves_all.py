"""Record whether a conductor serves every strategy (``fleetwave serve``) or only the
ones it was started for (``strategy apply --wait``, the demo).

Without it, nothing could tell an operator that a strategy applied without
``--wait`` has no conductor to drive it.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("conductors") as batch:
        batch.add_column(
            sa.Column("serves_all", sa.Boolean, nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("conductors") as batch:
        batch.drop_column("serves_all")
