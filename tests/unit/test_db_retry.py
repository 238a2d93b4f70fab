"""Which database errors a worker retries (a restart, a lost connection, a lock conflict) and
which it does not (a missing table, a timeout, a constraint), and the retry loop's bounds."""

from __future__ import annotations

import sqlite3

import psycopg
import pytest
from app.db import is_transient, retry_transient
from sqlalchemy import exc


def wrapped(cls, orig):
    return cls("SELECT 1", {}, orig)


@pytest.mark.parametrize("error,transient", [
    (wrapped(exc.OperationalError, psycopg.OperationalError("connection refused")), True),  # no SQLSTATE: could not connect
    (wrapped(exc.OperationalError, psycopg.errors.AdminShutdown()), True),  # 57P01: the server restarts
    (wrapped(exc.OperationalError, psycopg.errors.ConnectionFailure()), True),  # class 08
    (wrapped(exc.OperationalError, psycopg.errors.DeadlockDetected()), True),  # 40P01
    (wrapped(exc.OperationalError, psycopg.errors.QueryCanceled()), False),  # 57014: a statement timeout
    (wrapped(exc.OperationalError, sqlite3.OperationalError("database is locked")), True),
    (wrapped(exc.OperationalError, sqlite3.OperationalError("no such table: runs")), False),
    (wrapped(exc.IntegrityError, psycopg.errors.UniqueViolation()), False),
    (wrapped(exc.ProgrammingError, psycopg.errors.UndefinedTable()), False),
    (ValueError("bad"), False),
])
def test_is_transient(error, transient):
    assert is_transient(error) is transient


def test_retry_transient_retries_with_backoff_then_gives_up():
    calls, sleeps = [], []
    down = wrapped(exc.OperationalError, psycopg.OperationalError("connection refused"))

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise down
        return "written"

    assert retry_transient(flaky, "write", deadline_s=60, sleep=sleeps.append) == "written"
    assert sleeps == [0.5, 1.0, 2.0]

    def always_down():
        raise down

    sleeps.clear()
    with pytest.raises(exc.OperationalError):
        retry_transient(always_down, "write", deadline_s=0.1, sleep=sleeps.append)
    assert sleeps == []  # the next wait would pass the deadline: re-raised at once

    def broken():
        calls.append(1)
        raise wrapped(exc.IntegrityError, psycopg.errors.UniqueViolation())

    calls.clear()
    with pytest.raises(exc.IntegrityError):
        retry_transient(broken, "write", deadline_s=60, sleep=sleeps.append)
    assert len(calls) == 1  # not transient: never retried
