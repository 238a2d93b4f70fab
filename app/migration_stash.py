"""What a downgrade would drop, kept for the upgrade that adds it back: a round trip loses nothing.

A downgrade that drops a column (or narrows one) first copies each row's values that the old
schema cannot hold into the table `migration_stash` (revision, table, row id, values as JSON); the
upgrade of the same revision writes them back into the rows that still exist, then forgets them.
The old code never reads the stash table, and it goes with the last revision's rows: the table
exists only while some revision is downgraded.

A row the old code deleted in between is not restored, and a row it added gets the column's
default: a value goes back only to the row with the same id and the same natural key (a new row
may take a deleted row's id on SQLite). A value the old code changed since stays its (`still`);
a stashed reference to a row that is gone is left out (`keep`). Only for the migrations
(migrations/versions), inside their transaction."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

STASH = "migration_stash"
_stash = sa.table(STASH, sa.column("revision", sa.String), sa.column("table_name", sa.String),
                  sa.column("row_id", sa.BigInteger), sa.column("stashed", sa.JSON))


_DATETIME = "__stashed_datetime__"  # a timestamp's mark in the JSON (PostgreSQL gives datetimes; SQLite, text)


def _to_json(value: Any) -> Any:
    return {_DATETIME: value.isoformat()} if isinstance(value, datetime) else value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {_DATETIME}:
        return datetime.fromisoformat(value[_DATETIME])
    return value


def stash(revision: str, table: str, columns: list[str], where: Callable[[Any], Any], key: list[str]) -> int:
    """Copy `columns` of the rows of `table` that `where(table)` selects (those whose values the
    downgrade loses) into the stash under `revision`, each with its natural `key` (columns that name
    the row whatever its id: a new row may take a deleted row's id on SQLite); returns how many rows
    it kept. What an earlier downgrade of the same revision stashed, never restored, is replaced."""
    conn = op.get_bind()
    if not sa.inspect(conn).has_table(STASH):
        op.create_table(STASH, sa.Column("revision", sa.String(32), nullable=False),
                        sa.Column("table_name", sa.String(64), nullable=False),
                        sa.Column("row_id", sa.BigInteger(), nullable=False),
                        sa.Column("stashed", sa.JSON(), nullable=False))
    conn.execute(sa.delete(_stash).where(_stash.c.revision == revision, _stash.c.table_name == table))
    source = sa.table(table, sa.column("id"), *(sa.column(name) for name in {*columns, *key}))
    rows = [{"revision": revision, "table_name": table, "row_id": row.id,
             "stashed": {"values": {name: _to_json(getattr(row, name)) for name in columns},
                         "key": {name: getattr(row, name) for name in key}}}
            for row in conn.execute(sa.select(source).where(where(source)))]
    if rows:
        conn.execute(sa.insert(_stash), rows)
    return len(rows)


def restore(revision: str, table: str,
            keep: Callable[[Any, dict[str, Any]], dict[str, Any]] = lambda conn, values: values,
            still: Callable[[Any], Any] | None = None) -> int:
    """Write the values stashed under `revision` back into the rows of `table` that still exist
    with the same id and natural key (and, with `still`, still as the downgrade left them: a value
    the old code wrote since is kept); `keep(conn, values)` may leave some out. Then forget them,
    and drop the stash once it is empty; returns how many rows it wrote."""
    conn = op.get_bind()
    if not sa.inspect(conn).has_table(STASH):
        return 0
    mine = sa.and_(_stash.c.revision == revision, _stash.c.table_name == table)
    written = 0
    for row_id, stashed in conn.execute(sa.select(_stash.c.row_id, _stash.c.stashed).where(mine)).all():
        values = keep(conn, {name: _from_json(value) for name, value in stashed["values"].items()})
        if not values:
            continue
        names = {*values, *stashed["key"]}
        target = sa.table(table, sa.column("id"), *(sa.column(name) for name in names))
        match = [target.c.id == row_id, *(target.c[name] == value for name, value in stashed["key"].items())]
        if still is not None:
            match.append(still(target))
        written += conn.execute(sa.update(target).where(*match).values(**values)).rowcount
    conn.execute(sa.delete(_stash).where(mine))
    if conn.execute(sa.select(sa.func.count()).select_from(_stash)).scalar() == 0:
        op.drop_table(STASH)
    return written


def drop() -> None:
    """The stash with the schema itself (the first revision's downgrade)."""
    if sa.inspect(op.get_bind()).has_table(STASH):
        op.drop_table(STASH)
