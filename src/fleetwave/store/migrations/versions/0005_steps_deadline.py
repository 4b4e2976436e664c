"""Store when a step's current state runs out of time.

A state's timeout used to live only in the conductor's memory, so a takeover
started it again from zero: a state whose conductors kept dying never timed out.
The deadline is written with the transition that enters the state; the next
owner's recover hook gets what is left of it.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("deadline_at", sa.Float))


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("deadline_at")
