"""Scheduled evals (daily ≈ 100 samples, weekly ≥ 500): one beat sends `canary.tick_schedules`
every minute; each tick starts the run of every schedule whose latest cron slot has not run.

Exactly once per slot, even with two beats or a retried tick: the slot is claimed by a
compare-and-set on `last_slot_at` and the run carries the idempotency key
`schedule:<id>:<slot>`. After beat was down, only the latest missed slot runs — once — not one
run per missed tick. A new schedule starts at its next slot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import cast

from croniter import croniter
from sqlalchemy import select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from app import repo
from app.dispatch import Dispatcher
from app.models import Schedule, Suite, aware, utcnow

log = logging.getLogger(__name__)


def latest_slot(cron: str, now: datetime) -> datetime:
    """The most recent slot at or before now (UTC)."""
    now = aware(now)
    # get_prev is strictly before its start: start a second later so a slot equal to now counts
    return croniter(cron, now + timedelta(seconds=1)).get_prev(datetime).replace(fold=0)


def claim_due(session: Session, now: datetime | None = None) -> list[tuple]:
    """Claim every due slot; returns (schedule id, project, suite, configs, samples, slot iso,
    previous slot, claimed slot) to start."""
    now = now or utcnow()
    due = []
    for schedule in session.scalars(select(Schedule).where(Schedule.enabled.is_(True))):
        slot = latest_slot(schedule.cron, now)
        last = aware(schedule.last_slot_at)
        if last is not None and slot <= last:
            continue
        # compare-and-set: a second beat (or a retried tick) that read the same row loses here
        unchanged = (Schedule.last_slot_at.is_(None) if schedule.last_slot_at is None
                     else Schedule.last_slot_at == schedule.last_slot_at)
        claim = update(Schedule).where(Schedule.id == schedule.id, unchanged).values(last_slot_at=slot)
        won = cast(CursorResult, session.execute(claim)).rowcount == 1  # an UPDATE's result counts its rows
        if not won or last is None:  # lost the race, or first sight of a new schedule: wait for the next slot
            continue
        suite = session.get_one(Suite, schedule.suite_id)
        due.append((schedule.id, repo.project_name(session, schedule.project_id), suite.name,
                    list(schedule.config_names), schedule.samples, slot.isoformat(), schedule.last_slot_at, slot))
    session.commit()
    return due


def tick(session_factory: Callable[[], AbstractContextManager[Session]], dispatcher: Dispatcher,
         now: datetime | None = None) -> list[int]:
    from app.services import start_run

    with session_factory() as session:
        due = claim_due(session, now)
    started = []
    for schedule_id, project, suite, configs, samples, slot, previous, claimed in due:
        try:
            run_id, _ = start_run(project, suite, configs or None, dispatcher, samples=samples, trigger="schedule",
                                  idempotency_key=f"schedule:{schedule_id}:{slot}")
            started.append(run_id)
        except Exception:  # one broken schedule must not stop the others
            log.exception("schedule %s could not start its run for slot %s; the next tick retries it", schedule_id,
                          slot)
            with session_factory() as session:  # give the slot back (compare-and-set: only if still ours)
                session.execute(update(Schedule).where(Schedule.id == schedule_id, Schedule.last_slot_at == claimed)
                                .values(last_slot_at=previous))
    return started
