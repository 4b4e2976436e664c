"""Keep a YAML workflow's text with each strategy created from it.

Editing or deleting a stored workflow must not change what a strategy already
created from it does: the conductor drives the strategy from this copy.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("strategies") as batch:
        batch.add_column(sa.Column("workflow_yaml", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("strategies") as batch:
        batch.drop_column("workflow_yaml")
