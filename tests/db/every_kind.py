"""Rows of every kind for the migration tests: a row in every table of app.models, every column
set (nullable ones too), and the columns later revisions added set away from their defaults, so
that a downgrade that drops or narrows one and the upgrade that adds it back are seen to keep it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from app.db import Base
from sqlalchemy.engine import Connection

# per table, one dict per row: values over the generated ones; a callable gets the ids so far
OVERRIDES: dict[str, list[dict[str, Any]]] = {
    "optimization_configs": [
        {"name": "stacked", "is_baseline": True, "ablation_of_id": None, "ablation_axis": None},
        # 0004: an ablation of the stacked config
        {"name": "stacked-kv", "is_baseline": False, "ablation_of_id": lambda ids: ids["optimization_configs"][0],
         "ablation_axis": "kv_cache"},
    ],
    "comparisons": [
        {"metric": "ppl_ratio", "verdict": "measurement_error", "gated": True},  # 0003: 17 characters
        {"metric": "exact_match", "verdict": "ok", "gated": False, "details": {"kept": [1, "x"]}},  # 0006
    ],
    "config_runs": [{"attempt": 5, "attempt_base": 3, "priority": 7}],  # 0005, 0007
    "sample_results": [{"metric": "generation"}],  # 0002's name for a generation row
}


def _value(column: sa.Column, ids: dict[str, list[int]]) -> Any:
    """A value of the column's type: the first row of a referenced table; a non-null value everywhere."""
    for fk in column.foreign_keys:
        return (ids.get(fk.column.table.name) or [None])[0]
    kind = column.type
    if isinstance(kind, sa.Boolean):
        return True
    if isinstance(kind, sa.Integer):
        return 2
    if isinstance(kind, sa.Float):
        return 1.25
    if isinstance(kind, sa.DateTime):
        return datetime(2026, 11, 20, 10, 30, tzinfo=UTC)
    if isinstance(kind, sa.JSON) or "JSON" in type(kind).__name__:
        return {"seeded": column.name, "list": [1, 2.5, None]}
    if isinstance(kind, sa.String):
        return f"{column.table.name[:3]}-{column.name}"[: kind.length or 64]
    raise TypeError(f"no seed value for {column.table.name}.{column.name} ({kind!r})")


def seed_every_table(conn: Connection) -> dict[str, int]:
    """Insert the rows, parents first; returns the rows per table."""
    ids: dict[str, list[int]] = {}
    for table in Base.metadata.sorted_tables:
        for extra in OVERRIDES.get(table.name, [{}]):
            row = {c.name: _value(c, ids) for c in table.columns if not c.primary_key}
            row |= {k: v(ids) if callable(v) else v for k, v in extra.items()}
            key = conn.execute(sa.insert(table).values(**row).returning(*table.primary_key.columns)).scalar()
            ids.setdefault(table.name, []).append(key)
    return {name: len(rows) for name, rows in ids.items()}


def dump(conn: Connection) -> dict[str, list[dict[str, Any]]]:
    """Every table's rows, in key order, as the database gives them back."""
    out = {}
    for table in Base.metadata.sorted_tables:
        live = sa.Table(table.name, sa.MetaData(), autoload_with=conn)
        order = list(live.primary_key.columns) or list(live.columns)
        out[table.name] = [dict(row._mapping) for row in conn.execute(sa.select(live).order_by(*order))]
    return out
