"""A config-run may run more than once: a run that tops up (workers/top_up.py) queues its
baseline and undecided configs again on more samples, in the same row. config_runs.attempt_base
is the attempt number at which the current pass began: the attempt stays the fencing token
(it only ever grows, so no earlier attempt can write into a later pass), while the attempt budget
(CANARY_MAX_ATTEMPTS) counts the current pass's attempts only. Existing rows: 0.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from app import migration_stash

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("config_runs") as batch:
        batch.add_column(sa.Column("attempt_base", sa.Integer(), nullable=False, server_default="0"))
    migration_stash.restore(revision, "config_runs")


def downgrade() -> None:
    # a pass's first attempt, kept for the upgrade (app/migration_stash.py): a round trip keeps each
    # config-run's attempt budget where it was
    migration_stash.stash(revision, "config_runs", ["attempt_base"], lambda t: t.c.attempt_base != 0,
                          key=["run_id", "config_id"])
    with op.batch_alter_table("config_runs") as batch:
        batch.drop_column("attempt_base")
