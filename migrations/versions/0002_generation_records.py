"""Generation records get their own kind: sample_results rows that stood for a generation under
metric 'ttft_ms' (their value is the TTFT, their extra the generation) become kind 'generation'
(evals/records.py GenerationRecord). The row layout is otherwise the one GenerationRecord reads.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # (run, config, sample, metric) is unique and no row had metric 'generation' before: no clash
    op.execute(sa.text("UPDATE sample_results SET metric = 'generation' WHERE metric = 'ttft_ms'"))


def downgrade() -> None:
    op.execute(sa.text("UPDATE sample_results SET metric = 'ttft_ms' WHERE metric = 'generation'"))
