"""A comparison's verdict may be `measurement_error` (evals/sanity.py: a figure that cannot be
right), 17 characters: comparisons.verdict widens from 16 to 32. Existing rows are unchanged.
The downgrade reads a measurement_error as inconclusive, keeping the verdict in the migration
stash (app/migration_stash.py) for the upgrade to put back.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from app import migration_stash

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("comparisons") as batch:
        batch.alter_column("verdict", type_=sa.String(32), existing_type=sa.String(16), existing_nullable=False)
    # where the old code has not judged the row again since (it could only say inconclusive there)
    migration_stash.restore(revision, "comparisons", still=lambda t: t.c.verdict == "inconclusive")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # deferred foreign-key checks queued earlier in the same transaction (a longer downgrade runs
        # every step in one) would make the ALTER below fail with "pending trigger events": run them now
        op.execute(sa.text("SET CONSTRAINTS ALL IMMEDIATE"))
    # a measurement_error does not fit the old width: it reads as inconclusive there (no data), and
    # comes back with the upgrade
    migration_stash.stash(revision, "comparisons", ["verdict"], lambda t: t.c.verdict == "measurement_error",
                          key=["run_id", "config_id", "metric"])
    op.execute(sa.text("UPDATE comparisons SET verdict = 'inconclusive' WHERE verdict = 'measurement_error'"))
    with op.batch_alter_table("comparisons") as batch:
        batch.alter_column("verdict", type_=sa.String(16), existing_type=sa.String(32), existing_nullable=False)
