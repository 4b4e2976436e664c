"""A conductor's own lease (``conductors.lease_until``, on its lease clock): the steps
it drives of strategies another conductor leads are held under it, so another may take
them over once it runs out (conductors sharing a strategy).

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("conductors") as batch:
        batch.add_column(sa.Column("lease_until", sa.Float))


def downgrade() -> None:
    with op.batch_alter_table("conductors") as batch:
        batch.drop_column("lease_until")
