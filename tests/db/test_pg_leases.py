"""ConfigRun claims and fencing (REFERENCE.md §8): SELECT … FOR UPDATE SKIP LOCKED hands a
queued row to one worker only, and `attempt` fences off a worker whose lease was taken over.
These need committed rows seen from two connections, so each test gets a database of its own."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, select, text, update
from sqlalchemy.orm import Session

from app.models import ConfigRun

CLAIM = (
    select(ConfigRun.id)
    .where(ConfigRun.status == "queued")
    .order_by(ConfigRun.id)
    .limit(1)
    .with_for_update(skip_locked=True)
)
FINISH = text("UPDATE config_runs SET status = 'succeeded' WHERE id = :id AND attempt = :attempt")


@pytest.fixture
def engine(make_database):
    engine = create_engine(make_database())
    yield engine
    engine.dispose()


@pytest.fixture
def queued_id(engine, make_graph) -> int:
    """A committed queued ConfigRun, the only one in this test's database."""
    with Session(engine) as session:
        graph = make_graph(session)
        session.commit()
        return graph.config_run.id


def test_claim_skips_a_row_locked_by_another_worker(engine, queued_id):
    with Session(engine) as a, Session(engine) as b:  # one connection each
        # Without SKIP LOCKED, B would wait for A: make that an error, not a hang.
        b.execute(text("SET lock_timeout = '2s'"))
        assert a.scalar(CLAIM) == queued_id
        assert b.scalar(CLAIM) is None
        a.rollback()  # A gives the row up…
        assert b.scalar(CLAIM) == queued_id  # …and B gets it: it was the lock, not the filter


def test_stale_attempt_cannot_finish(engine, queued_id):
    def claim(worker: str) -> int:
        with Session(engine) as session, session.begin():
            attempt = session.scalar(select(ConfigRun.attempt).where(ConfigRun.id == queued_id)) + 1
            session.execute(
                update(ConfigRun)
                .where(ConfigRun.id == queued_id)
                .values(attempt=attempt, status="running", worker=worker)
            )
            return attempt

    first = claim("worker-1")
    second = claim("worker-2")  # worker-1's lease expired and the row was handed on

    with engine.begin() as conn:
        assert conn.execute(FINISH, {"id": queued_id, "attempt": first}).rowcount == 0
        assert conn.execute(FINISH, {"id": queued_id, "attempt": second}).rowcount == 1
    with Session(engine) as session:
        row = session.get(ConfigRun, queued_id)
        assert (row.status, row.worker) == ("succeeded", "worker-2")
