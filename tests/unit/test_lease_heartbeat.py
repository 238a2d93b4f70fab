"""The heartbeat of an attempt (workers.lease.LeaseKeeper) on the embedded SQLite database: it
keeps the lease of a task that is busy for longer than the lease, so no other worker can claim
it; it stops at the first renewal after another attempt took over; it outlives a transient
database error; and a config-run given up says whether its last worker went silent or said why
it stopped."""

from __future__ import annotations

import time
from datetime import timedelta

import psycopg
import pytest
from app import repo
from app.corpus import SampleIn
from app.db import session_scope
from app.models import ConfigRun, aware, utcnow
from sqlalchemy import exc, update


@pytest.fixture
def config_run(sqlite_env) -> int:
    with session_scope() as s:
        project = repo.get_or_create_project(s, "p")
        model = repo.upsert_model(s, project, "tiny", "builtin:pydoc-target")
        cfg = repo.upsert_config(s, project, model, "fp16", {"weights": "fp16"}, True)
        suite = repo.upsert_suite(s, project, "daily", {"samples": 2}, [SampleIn("a", "one"), SampleIn("b", "two")])
        run, _ = repo.create_run(s, project, suite, [cfg])
        return run.config_runs[0].id


def claim(cr_id: int, worker: str, lease_seconds: float = 1) -> int | None:
    with session_scope() as s:
        return repo.claim_config_run(s, cr_id, worker, lease_seconds, max_attempts=3)


def row(cr_id: int) -> ConfigRun:
    with session_scope() as s:
        cr = s.get(ConfigRun, cr_id)
        s.expunge(cr)
        return cr


def expire(cr_id: int) -> None:
    with session_scope() as s:
        s.execute(update(ConfigRun).where(ConfigRun.id == cr_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))


def take_over(cr_id: int, worker: str) -> int | None:
    """Expire the lease and claim in one transaction (no beat can renew it in between)."""
    with session_scope() as s:
        s.execute(update(ConfigRun).where(ConfigRun.id == cr_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
        return repo.claim_config_run(s, cr_id, worker, 1, max_attempts=3)


@pytest.mark.integration
def test_the_lease_outlives_work_longer_than_it_and_a_takeover_stops_the_heartbeat(config_run):
    from workers.lease import Attempt, LeaseKeeper, LostLease

    first = claim(config_run, "a:1", lease_seconds=2)
    with LeaseKeeper(Attempt(config_run, first), lease_seconds=2, period=0.1) as lease:
        time.sleep(5)  # "a model load": two and a half leases without a fenced write
        assert lease.beats >= 5 and not lease.lost.is_set()
        assert claim(config_run, "b:2") is None  # the live lease holds the other worker off
        lease.check()
        second = take_over(config_run, "b:2")  # as if this worker had been frozen past its lease
        assert second == first + 1
        assert lease.lost.wait(2)  # the next beat finds the newer attempt and stops renewing
        with pytest.raises(LostLease, match=f"attempt {first} lost its lease"):
            lease.check()
    assert row(config_run).attempt == second and row(config_run).worker == "b:2"


def test_a_transient_database_error_does_not_end_the_heartbeat(config_run, caplog):
    from workers.lease import Attempt, LeaseKeeper

    attempt = claim(config_run, "a:1")
    lease = LeaseKeeper(Attempt(config_run, attempt), lease_seconds=1, period=0.1)
    renew, failures = lease.renew, []

    def flaky() -> bool:
        if len(failures) < 3:
            failures.append(1)
            raise exc.OperationalError("UPDATE config_runs", {}, psycopg.OperationalError("connection refused"))
        return renew()

    lease.renew = flaky
    with lease:
        time.sleep(1.5)
    assert len(failures) == 3 and lease.beats >= 3 and not lease.lost.is_set()
    assert "database unavailable" in caplog.text
    assert aware(row(config_run).lease_expires_at) > utcnow() - timedelta(seconds=1)


def test_a_finished_attempt_stops_renewing(config_run):
    from workers.lease import Attempt, LeaseKeeper

    attempt = claim(config_run, "a:1")
    with LeaseKeeper(Attempt(config_run, attempt), lease_seconds=1, period=0.05) as lease:
        time.sleep(0.2)
    beats = lease.beats
    time.sleep(0.3)
    assert lease.beats == beats and not lease._thread.is_alive()


def test_the_give_up_reason_tells_a_silent_worker_from_an_interrupted_one(config_run):
    from workers.lease import INTERRUPTED, give_up_reason

    for _ in range(3):
        attempt = claim(config_run, "a:1")
        expire(config_run)
    silent = give_up_reason(row(config_run))
    assert silent.startswith("gave up after 3 attempts") and "stopped renewing its lease" in silent
    assert "attempt 3 on a:1, stopped renewing" in silent and "before its first results were written" in silent
    with session_scope() as s:
        assert repo.release_lease(s, config_run, attempt, INTERRUPTED.format(attempt=attempt) + "the database was unreachable")
        assert repo.release_lease(s, config_run, attempt - 1, "stale") is False  # fenced
    told = give_up_reason(row(config_run))
    assert told.startswith("gave up after 3 attempts") and "stopped renewing" not in told
    assert "attempt 3 on a:1, was interrupted: the database was unreachable" in told
