"""Leases on a clock every conductor shares, and a record of each attempt's start.

``conductors.lease_clock`` names the clock its leases are written on (on SQLite the
host's boot-time clock, tagged with the boot id; on a database server, the server's
clock): a lease is compared only with a reading of the same clock, so a conductor
whose wall clock steps can neither take a live conductor's lease nor keep a dead
one's. A conductor of another clock (one from before a reboot, or from before this
revision) holds nothing. Steps lose their own lease column: a step in flight is held
under its strategy's lease, and its owner (checked by every write) says by whom.

``attempts`` has one row per attempt of a state sent to a target after its first (which
is the state's entry in the journal), written before the attempt is sent, unique on
(step, state, attempt): ``fleetwave check`` verifies from it that no attempt was sent
twice and that each retry followed the attempt before it.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("conductors") as batch:
        batch.add_column(sa.Column("lease_clock", sa.String(80)))
    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("strategy_id", sa.Integer, nullable=False),
        sa.Column("step_id", sa.Integer, nullable=False),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("conductor", sa.String(64), nullable=False),
        sa.Column("fence", sa.Integer, nullable=False),
        sa.Column("how", sa.String(16), nullable=False),
        sa.UniqueConstraint("step_id", "state", "attempt", name="uq_attempts_step_state"),
    )
    op.create_index("ix_attempts_strategy", "attempts", ["strategy_id", "id"])
    # A step in flight is held under its strategy's lease: its own copy was renewed but
    # decided nothing (its owner, which every write now checks, stays).
    with op.batch_alter_table("steps") as batch:
        batch.drop_column("lease_expires_at")


def downgrade() -> None:
    op.drop_index("ix_attempts_strategy", "attempts")
    op.drop_table("attempts")
    with op.batch_alter_table("steps") as batch:
        batch.add_column(sa.Column("lease_expires_at", sa.Float))
    with op.batch_alter_table("conductors") as batch:
        batch.drop_column("lease_clock")
