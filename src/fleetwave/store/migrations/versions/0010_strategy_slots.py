"""A strategy's slots in the database: ``strategy_slots``, counted by every commit.

One row for the strategy (group 0) and one for each group it has steps of: the cap,
the steps in flight and (the strategy's row) the failed steps. A commit that enters a
step into a workflow state checks the caps in the same transaction, so the strategy's
max parallel and each group's hold across every conductor of the database (G7).
Existing strategies get their rows counted from their steps.

Revision ID: 0010
Revises: 0009
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

#: states a step is not in flight in (as of this revision)
_NOT_IN_FLIGHT = ("initial", "complete", "failed", "aborted")


def upgrade() -> None:
    op.create_table(
        "strategy_slots",
        sa.Column("strategy_id", sa.Integer, primary_key=True),
        sa.Column("group_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("cap", sa.Integer, nullable=False),
        sa.Column("in_flight", sa.Integer, nullable=False),
        sa.Column("failed", sa.Integer, nullable=False),
    )
    conn = op.get_bind()
    counts: dict[int, dict[int | None, dict[str, int]]] = {}
    for sid, gid, state, n in conn.execute(
        sa.text(
            "SELECT strategy_id, group_id, state, COUNT(*) FROM steps "
            "GROUP BY strategy_id, group_id, state"
        )
    ):
        counts.setdefault(sid, {}).setdefault(gid, {})[state] = int(n)
    rows = []
    for sid, options, group_caps in conn.execute(
        sa.text("SELECT id, options, group_caps FROM strategies")
    ):
        try:
            opts = json.loads(options)
            serial = opts.get("apply_type") == "serial"
            cap = 1 if serial else int(opts.get("max_parallel", 20))
            gcaps = {int(k): int(v) for k, v in json.loads(group_caps).items()}
        except (ValueError, TypeError, AttributeError):
            continue  # an unreadable row: a conductor fails it, with why (no slots kept)
        by_group = counts.get(sid, {})

        def flying(states: dict[str, int]) -> int:
            return sum(n for st, n in states.items() if st not in _NOT_IN_FLIGHT)

        failed = sum(states.get("failed", 0) for states in by_group.values())
        rows.append(
            {"s": sid, "g": 0, "c": cap, "f": sum(map(flying, by_group.values())), "x": failed}
        )
        for gid, states in sorted(by_group.items(), key=lambda kv: kv[0] or 0):
            if gid is None:
                continue
            cap_g = gcaps.get(gid, 1 << 30)
            rows.append({"s": sid, "g": gid, "c": cap_g, "f": flying(states), "x": 0})
    if rows:
        conn.execute(
            sa.text(
                "INSERT INTO strategy_slots (strategy_id, group_id, cap, in_flight, failed) "
                "VALUES (:s, :g, :c, :f, :x)"
            ),
            rows,
        )


def downgrade() -> None:
    op.drop_table("strategy_slots")
