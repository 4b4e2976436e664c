"""Strategy and step ids are never given twice: a counter of the last id handed out.

SQLite gives a new row the highest id plus one, so deleting the newest strategy
freed its id, and its steps' ids, for the next one created: a late callback for a
deleted step would have moved the new strategy's step that got its id. The counters
start above every id the database still mentions: earlier versions deleted a
strategy but left its callbacks (ids freed before the upgrade and mentioned nowhere
may have been reused already). Those leftover callbacks are removed.

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
        "INSERT INTO id_counters (name, last_id) SELECT 'strategies', COALESCE(MAX(id), 0) "
        "FROM (SELECT id FROM strategies UNION ALL SELECT strategy_id FROM callbacks "
        "UNION ALL SELECT strategy_id FROM journal UNION ALL SELECT strategy_id FROM events "
        "WHERE strategy_id IS NOT NULL) AS ids"  # (PostgreSQL before 16 needs the name)
    )
    op.execute(
        "INSERT INTO id_counters (name, last_id) SELECT 'steps', COALESCE(MAX(id), 0) "
        "FROM (SELECT id FROM steps UNION ALL SELECT step_id FROM callbacks "
        "UNION ALL SELECT step_id FROM journal UNION ALL SELECT step_id FROM events "
        "WHERE step_id IS NOT NULL) AS ids"
    )
    op.execute("DELETE FROM callbacks WHERE strategy_id NOT IN (SELECT id FROM strategies)")


def downgrade() -> None:
    op.drop_table("id_counters")
