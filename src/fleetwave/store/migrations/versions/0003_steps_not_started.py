"""Record on the step that its state was entered but its action never started.

A conductor that stops cleanly lets running actions finish and commits their
outcomes, which enters each step's next state; it starts no new action. This
flag, written in that same transaction, tells the next owner to start the
action rather than call the state's recover hook (which a state may not have).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(
            sa.Column("not_started", sa.Boolean, nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("not_started")
