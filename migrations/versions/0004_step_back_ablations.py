"""Step back one layer: a config may be a single-optimization ablation of a stacked config
(optimization_configs.ablation_of_id, ablation_axis), which the service creates when the stacked
config breaches a quality threshold. Existing configs are no ablation (both null).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from app import migration_stash

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("optimization_configs") as batch:
        batch.add_column(sa.Column("ablation_of_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("ablation_axis", sa.String(16), nullable=True))
        batch.create_foreign_key(op.f("fk_optimization_configs_ablation_of_id_optimization_configs"),
                                 "optimization_configs", ["ablation_of_id"], ["id"], ondelete="CASCADE")
    migration_stash.restore(revision, "optimization_configs", _stacked_config_left)


def _stacked_config_left(conn, values: dict) -> dict:
    """An ablation whose stacked config was deleted while downgraded goes back as an ordinary config."""
    configs = sa.table("optimization_configs", sa.column("id"))
    there = conn.execute(sa.select(configs.c.id).where(configs.c.id == values["ablation_of_id"])).first()
    return values if there else {}


def downgrade() -> None:
    # which config is an ablation of which, kept for the upgrade (app/migration_stash.py)
    migration_stash.stash(revision, "optimization_configs", ["ablation_of_id", "ablation_axis"],
                          lambda t: t.c.ablation_of_id.is_not(None), key=["project_id", "name"])
    with op.batch_alter_table("optimization_configs") as batch:
        batch.drop_constraint(op.f("fk_optimization_configs_ablation_of_id_optimization_configs"), type_="foreignkey")
        batch.drop_column("ablation_axis")
        batch.drop_column("ablation_of_id")
