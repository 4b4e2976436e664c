"""Strategy ids are never given twice: a counter of the last id handed out.

SQLite gives a new row the highest id plus one, so deleting the newest strategy
freed its id for the next one created. The counter starts at the highest id in
the database when it is upgraded (ids freed before then may have been reused).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "id_counters",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("last_id", sa.Integer, nullable=False),
    )
    op.execute(
        "INSERT INTO id_counters (name, last_id) "
        "SELECT 'strategies', COALESCE(MAX(id), 0) FROM strategies"
    )


def downgrade() -> None:
    op.drop_table("id_counters")
