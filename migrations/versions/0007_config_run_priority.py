"""A config-run keeps the queue priority it was first sent with: config_runs.priority. A project
past its fair share sends its further config-runs one priority step behind (app/services.py), and
the reconciler and a top-up re-send each at that stored priority rather than at its run's
trigger's. Existing rows: null, read as their run's trigger's priority (app/dispatch.priority_of).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from app import migration_stash

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("config_runs") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=True))
    migration_stash.restore(revision, "config_runs")


def downgrade() -> None:
    # the priority each config-run was sent with, kept for the upgrade (app/migration_stash.py)
    migration_stash.stash(revision, "config_runs", ["priority"], lambda t: t.c.priority.is_not(None),
                          key=["run_id", "config_id"])
    with op.batch_alter_table("config_runs") as batch:
        batch.drop_column("priority")
