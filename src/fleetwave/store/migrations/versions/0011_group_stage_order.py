"""A group's place in a rollout by stages (``group add --order N``): with
``--stages-by-group`` groups run by this number, then by name.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("groups") as batch:
        batch.add_column(sa.Column("stage_order", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("groups") as batch:
        batch.drop_column("stage_order")
