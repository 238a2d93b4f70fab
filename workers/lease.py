"""A worker's hold on a config-run: the claim, the attempt it wins, and the lease a heartbeat
thread renews while the attempt works. Every write of an attempt is fenced by its number: once a
newer attempt holds the config-run (this worker froze past its lease and another took over),
nothing this one writes lands (`LostLease`)."""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timezone
from typing import Any

from sqlalchemy.orm import Session

from app import repo
from app.db import is_transient, session_scope
from app.models import ConfigRun, aware
from app.settings import Settings

log = logging.getLogger(__name__)
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"
INTERRUPTED = "attempt {attempt} interrupted: "  # how an attempt that let go of its lease says why (in `error`)


class LostLease(RuntimeError):
    """A newer attempt holds the config-run: this one stops, having written nothing more."""

    def __init__(self, attempt: Attempt):
        super().__init__(f"config-run {attempt.config_run_id}: attempt {attempt.number} lost its lease to a newer "
                         "attempt")


@dataclass(frozen=True)
class Attempt:
    """One claim of a config-run (its id and the attempt number the claim won): the handle every
    fenced write of the attempt goes through, each in the caller's transaction."""

    config_run_id: int
    number: int

    def __str__(self) -> str:
        return f"config-run {self.config_run_id} attempt {self.number}"

    def heartbeat(self, session: Session, lease_seconds: float, done: int | None = None,
                  total: int | None = None) -> bool:
        """Renew the lease (and record progress); False once a newer attempt holds the config-run."""
        return repo.heartbeat(session, self.config_run_id, self.number, lease_seconds, done, total)

    def heartbeat_or_stop(self, session: Session, lease_seconds: float, done: int | None = None,
                          total: int | None = None) -> None:
        if not self.heartbeat(session, lease_seconds, done, total):
            raise LostLease(self)

    def finish(self, session: Session, status: str, **kw: Any) -> bool:
        """Fenced by the attempt; True also when this attempt already finished it with that status
        (a retry after a commit whose acknowledgement was lost with the connection)."""
        if repo.finish_config_run(session, self.config_run_id, self.number, status, **kw):
            return True
        config_run = session.get(ConfigRun, self.config_run_id)
        return config_run is not None and config_run.attempt == self.number and config_run.status == status

    def finish_or_stop(self, session: Session, status: str, **kw: Any) -> None:
        if not self.finish(session, status, **kw):
            raise LostLease(self)

    def release(self, session: Session, why: str) -> bool:
        """Let go of the lease, saying why (the reconciler re-sends the config-run at once)."""
        return repo.release_lease(session, self.config_run_id, self.number,
                                  INTERRUPTED.format(attempt=self.number) + why)


def claim(session: Session, config_run_id: int, settings: Settings) -> tuple[Attempt | None, int | None, bool]:
    """(the attempt this worker now holds, the run, whether the config-run was given up)."""
    number = repo.claim_config_run(session, config_run_id, WORKER_ID, settings.lease_seconds, settings.max_attempts)
    config_run = session.get(ConfigRun, config_run_id)
    if config_run is None or number is not None:
        return ((Attempt(config_run_id, number) if number is not None else None),
                config_run.run_id if config_run is not None else None, False)
    if config_run.status == "running" and config_run.worker == WORKER_ID:
        # our own claim, whose commit was in doubt when the connection dropped (this
        # process runs one task at a time, so a running row in its name is this task's)
        return Attempt(config_run_id, config_run.attempt), config_run.run_id, False
    return None, config_run.run_id, repo.give_up_config_run(session, config_run_id, settings.max_attempts,
                                                             give_up_reason(config_run))


def give_up_reason(config_run: ConfigRun) -> str:
    """Why a config-run is abandoned once its attempts are spent. Its last attempt either said why
    it let go (an interruption it recorded, e.g. the database was unreachable for longer than the
    retry window), or it stopped renewing its lease without a word: the heartbeat thread renews
    it for as long as the worker process lives, however slow the work, so a silent lease means
    the process died (killed, out of memory, a crash in native code) or was frozen."""
    worker = config_run.worker or "an unknown worker"
    spent = config_run.attempt - config_run.attempt_base  # this pass's attempts (a top-up starts a pass)
    note = INTERRUPTED.format(attempt=config_run.attempt)
    if config_run.error and config_run.error.startswith(note):
        return (f"gave up after {spent} attempts, all spent; the last, attempt {config_run.attempt} on "
                f"{worker}, was interrupted: {config_run.error[len(note):]} — the worker was alive; fix that cause, "
                f"then start a new run")
    when = (aware(config_run.lease_expires_at).astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            if config_run.lease_expires_at else "an unknown time")
    where = (f"after {config_run.progress_done}/{config_run.progress_total} results" if config_run.progress_done
             else "before its first results were written (model load or calibration)")
    return (f"gave up after {spent} attempts: the last, attempt {config_run.attempt} on {worker}, "
            f"stopped renewing its lease without reporting an error (process killed, out of memory, or hung) {where}, "
            f"its lease expiring at {when}; a live worker's heartbeat renews it however slow the work, so see that "
            f"worker's log; raise CANARY_MAX_ATTEMPTS only once the cause is fixed")


class LeaseKeeper:
    """The heartbeat of one attempt: a daemon thread with its own database sessions renews the
    config-run's lease every lease/3 seconds, fenced by the attempt number, from the claim until
    the attempt ends — through the model load, calibration and every batch, however long they
    take. It dies with its process, so only a worker that is gone or frozen (SIGSTOP, a stalled
    VM: every thread stops) lets its lease run out and is taken over. A transient database error
    is retried at the next beat (within the lease, two more tries); once another attempt holds
    the config-run, `lost` is set and the thread ends — the task stops at its next check or its
    next fenced write. A main thread hung inside a live process keeps its lease until Celery's
    hard time limit kills the process."""

    def __init__(self, attempt: Attempt, lease_seconds: float, period: float | None = None):
        self.attempt, self.lease_seconds = attempt, lease_seconds
        self.period = period if period is not None else max(lease_seconds / 3, 0.05)
        self.lost = threading.Event()
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{attempt.config_run_id}-{attempt.number}",
                                        daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self.period, 1.0))

    def check(self) -> None:
        """Raise LostLease once a newer attempt holds the config-run (before more GPU work)."""
        if self.lost.is_set():
            raise LostLease(self.attempt)

    def renew(self) -> bool:
        with session_scope() as session:
            return self.attempt.heartbeat(session, self.lease_seconds)

    def _run(self) -> None:
        wait = self.period
        while not self._stop.wait(wait):
            wait = self.period
            try:
                held = self.renew()
            except Exception as e:
                wait = min(self.period, 1.0)
                if is_transient(e):
                    log.warning("lease of %s: database unavailable (%s); retrying in %.1f s", self.attempt,
                                type(e).__name__, wait)
                else:
                    log.exception("lease of %s: renewal failed", self.attempt)
                continue
            if self._stop.is_set():
                return  # the attempt ended while the renewal was in flight (a finished row matches no lease)
            if not held:
                self.lost.set()
                log.warning("config-run %s: attempt %s lost its lease to a newer attempt (heartbeat)",
                            self.attempt.config_run_id, self.attempt.number)
                return
            self.beats += 1
