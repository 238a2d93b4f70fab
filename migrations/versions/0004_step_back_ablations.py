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


def downgrade() -> None:
    with op.batch_alter_table("optimization_configs") as batch:
        batch.drop_constraint(op.f("fk_optimization_configs_ablation_of_id_optimization_configs"), type_="foreignkey")
        batch.drop_column("ablation_axis")
        batch.drop_column("ablation_of_id")
