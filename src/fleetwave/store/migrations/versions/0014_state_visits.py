"""Visits: a state on a bounded cycle of branches (``max_visits``) may be entered more
than once per step, each visit its own journal entry.

``steps.visit`` says which visit of its state a step is in (every compare-and-set checks
it with the state and fence), ``steps.visits`` the visits so far of the states that
count them. The journal and the attempts gain ``visit``; their unique keys become
(step, state, visit) and (step, state, visit, attempt): G1 per visit. Rows written
before are visit 1.

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("visit", sa.Integer, nullable=False, server_default="1"))
        batch.add_column(sa.Column("visits", sa.Text))
    with op.batch_alter_table("journal") as batch:
        batch.add_column(sa.Column("visit", sa.Integer, nullable=False, server_default="1"))
        batch.drop_constraint("uq_journal_step_state", type_="unique")
        batch.create_unique_constraint(
            "uq_journal_step_state_visit", ["step_id", "to_state", "visit"]
        )
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("visit", sa.Integer, nullable=False, server_default="1"))
        batch.drop_constraint("uq_attempts_step_state", type_="unique")
        batch.create_unique_constraint(
            "uq_attempts_step_state_visit", ["step_id", "state", "visit", "attempt"]
        )


def downgrade() -> None:
    # (fails on a database whose journal has a second visit of a state: G1 of the older
    # schema could not hold it)
    with op.batch_alter_table("attempts") as batch:
        batch.drop_constraint("uq_attempts_step_state_visit", type_="unique")
        batch.create_unique_constraint("uq_attempts_step_state", ["step_id", "state", "attempt"])
        batch.drop_column("visit")
    with op.batch_alter_table("journal") as batch:
        batch.drop_constraint("uq_journal_step_state_visit", type_="unique")
        batch.create_unique_constraint("uq_journal_step_state", ["step_id", "to_state"])
        batch.drop_column("visit")
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("visits")
        batch.drop_column("visit")
