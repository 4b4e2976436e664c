"""Record when a conductor began a clean stop (``fleetwave conductor list`` says it is
draining: it starts nothing new, lets running actions finish, then hands back).

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("conductors") as batch:
        batch.add_column(sa.Column("draining_at", sa.Float))


def downgrade() -> None:
    with op.batch_alter_table("conductors") as batch:
        batch.drop_column("draining_at")
