"""A comparison says whether it has a say in a verdict as a column of its own: comparisons.gated
(vocabulary.comparison.Comparison.gated), where it had been a key of its details JSON
(details.informational = true). Existing rows: gated is false where that key was true, and the key
is dropped from details; downgrade puts it back.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# the details column is JSONB on PostgreSQL and JSON on SQLite (app/models.py JSONType): read and
# written through SQLAlchemy's JSON type, which both accept
comparisons = sa.table("comparisons", sa.column("id", sa.BigInteger), sa.column("details", sa.JSON),
                       sa.column("gated", sa.Boolean))


def upgrade() -> None:
    with op.batch_alter_table("comparisons") as batch:
        batch.add_column(sa.Column("gated", sa.Boolean(), nullable=False, server_default=sa.true()))
    conn = op.get_bind()
    for row_id, details in conn.execute(sa.select(comparisons.c.id, comparisons.c.details)).all():
        if isinstance(details, dict) and "informational" in details:
            gated = not details.pop("informational")
            conn.execute(sa.update(comparisons).where(comparisons.c.id == row_id)
                         .values(gated=gated, details=details or None))


def downgrade() -> None:
    conn = op.get_bind()
    for row_id, details in conn.execute(sa.select(comparisons.c.id, comparisons.c.details)
                                        .where(comparisons.c.gated == sa.false())).all():
        conn.execute(sa.update(comparisons).where(comparisons.c.id == row_id)
                     .values(details={**(details or {}), "informational": True}))
    with op.batch_alter_table("comparisons") as batch:
        batch.drop_column("gated")
