"""Tasks take IDs, never payloads. Each task is a plain function (run in-process by the
embedded default through INLINE) wrapped as a Celery task by name (run by workers)."""

from __future__ import annotations

import logging
from datetime import timedelta

from app import repo
from app.db import is_transient, retry_transient, session_scope
from app.dispatch import AGGREGATE_RUN, EXECUTE_CONFIG_RUN, NOTIFY, RECONCILE, TICK_SCHEDULES, Dispatcher
from app.models import utcnow
from app.settings import get_settings
from workers.aggregate import after_commit, aggregate_pass, finish_run
from workers.execute import execute_config_run as _execute

log = logging.getLogger(__name__)


def execute_config_run(config_run_id: int, dispatcher: Dispatcher) -> str:
    return _execute(config_run_id, dispatcher)


def aggregate_run(run_id: int, dispatcher: Dispatcher | None = None) -> str:
    # Idempotent (comparisons are upserted, the run's status gates a second pass), so a pass cut
    # off by a database restart simply runs again. Delivery and escalation come after, outside
    # the retry and the error path: neither may run twice or overwrite the verdict.
    try:
        verdict, alerts = retry_transient(lambda: aggregate_pass(run_id), f"aggregate run {run_id}")
    except Exception as e:
        if is_transient(e):  # still unreachable: the run stays 'aggregating' and the reconciler re-sends it
            log.error("aggregation of run %s interrupted, the database is unreachable: %s", run_id, type(e).__name__)
            return "interrupted"
        log.exception("aggregation of run %s failed", run_id)
        with session_scope() as s:
            finish_run(s, run_id, "failed", "error", f"aggregation failed: {type(e).__name__}: {e}", only_if=("aggregating",))
        raise
    if alerts is not None:
        after_commit(run_id, alerts, dispatcher)
    return verdict


def reconcile(dispatcher: Dispatcher) -> int:
    """Re-enqueue what the broker may have lost (the broker is not a database): config-runs
    queued or lease-expired for longer than requeue_after_seconds, and runs whose config-runs
    all finished but whose aggregation never completed. Every re-send is idempotent."""
    settings = get_settings()
    cutoff = utcnow() - timedelta(seconds=settings.requeue_after_seconds)
    with session_scope() as s:
        config_runs = [cr.id for cr in repo.stale_config_runs(s, cutoff)]
        repo.mark_enqueued(s, config_runs)
        runs = repo.stalled_runs(s, cutoff)
        for run_id in runs:
            repo.reopen_aggregation(s, run_id)
    for i in config_runs:
        dispatcher.send(EXECUTE_CONFIG_RUN, i)
    for run_id in runs:
        dispatcher.send(AGGREGATE_RUN, run_id)
    with session_scope() as s:  # the outbox: retries that have come due, and rows a crash left behind
        from app.notify import next_due

        due = next_due(s)
    if due is not None and due <= utcnow():
        dispatcher.send(NOTIFY)
    if config_runs or runs:
        log.warning("reconciler re-enqueued config-runs %s and aggregation of runs %s", config_runs, runs)
    return len(config_runs) + len(runs)


def notify(dispatcher: Dispatcher | None = None) -> dict:
    """Deliver the due notifications of the outbox (app/notify.py)."""
    from app.notify import deliver_due

    with session_scope() as s:
        return deliver_due(s)


def tick_schedules(dispatcher: Dispatcher) -> list[int]:
    """Start the runs of schedules whose latest cron slot has not run (app/schedules.py)."""
    from app.schedules import tick

    return tick(session_scope, dispatcher)


INLINE = {EXECUTE_CONFIG_RUN: execute_config_run, AGGREGATE_RUN: aggregate_run, RECONCILE: reconcile, NOTIFY: notify,
          TICK_SCHEDULES: tick_schedules}


def _register() -> None:
    from app.dispatch import get_dispatcher
    from workers.celery_app import celery_app

    @celery_app.task(name=EXECUTE_CONFIG_RUN)
    def execute_task(config_run_id: int) -> str:
        return execute_config_run(config_run_id, get_dispatcher())

    @celery_app.task(name=AGGREGATE_RUN)
    def aggregate_task(run_id: int) -> str:
        return aggregate_run(run_id, get_dispatcher())

    @celery_app.task(name=TICK_SCHEDULES)
    def tick_task() -> list[int]:
        return tick_schedules(get_dispatcher())

    @celery_app.task(name=NOTIFY)
    def notify_task() -> dict:
        return notify()

    @celery_app.task(name=RECONCILE)
    def reconcile_task() -> int:
        return reconcile(get_dispatcher())


try:  # Celery is a hard dependency, but the embedded default must not need a broker to import
    _register()
except ImportError:  # pragma: no cover
    pass
