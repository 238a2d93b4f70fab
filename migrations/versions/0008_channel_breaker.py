"""A channel's circuit breaker lives on the channel: channels.breaker_strikes (the failed or slow
answers in a row) and channels.breaker_until (no post before then). Before, the breaker was the
due times of the channel's rows, so a row created after a trip was posted at once and a slow
receiver rested one pass only (app/notify.py). Existing channels: closed (0, null).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from app import migration_stash

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("channels") as batch:
        batch.add_column(sa.Column("breaker_strikes", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("breaker_until", sa.DateTime(timezone=True), nullable=True))
    migration_stash.restore(revision, "channels")


def downgrade() -> None:
    # an open breaker, kept for the upgrade (app/migration_stash.py): a round trip does not post to
    # a receiver that was cooling down
    migration_stash.stash(revision, "channels", ["breaker_strikes", "breaker_until"],
                          lambda t: (t.c.breaker_strikes != 0) | t.c.breaker_until.is_not(None),
                          key=["project_id", "name"])
    with op.batch_alter_table("channels") as batch:
        batch.drop_column("breaker_until")
        batch.drop_column("breaker_strikes")
