"""Tasks take IDs, never payloads. Each task is a plain function (run in-process by the
embedded default through INLINE) wrapped as a Celery task by name (run by workers)."""

from __future__ import annotations

import logging
from datetime import timedelta

from app import repo
from app.db import session_scope
from app.dispatch import AGGREGATE_RUN, EXECUTE_CONFIG_RUN, RECONCILE, Dispatcher
from app.models import utcnow
from app.settings import get_settings
from workers.aggregate import aggregate_run as _aggregate
from workers.execute import execute_config_run as _execute

log = logging.getLogger(__name__)


def execute_config_run(config_run_id: int, dispatcher: Dispatcher) -> str:
    return _execute(config_run_id, dispatcher)


def aggregate_run(run_id: int, dispatcher: Dispatcher | None = None) -> str:
    try:
        return _aggregate(run_id)
    except Exception as e:
        log.exception("aggregation of run %s failed", run_id)
        with session_scope() as s:
            repo.finish_run(s, run_id, "failed", "error", f"aggregation failed: {type(e).__name__}: {e}")
        raise


def reconcile(dispatcher: Dispatcher) -> int:
    """Re-enqueue config-runs whose message may be lost or whose worker died (lease expired)."""
    settings = get_settings()
    with session_scope() as s:
        stale = repo.stale_queued_config_runs(s, utcnow() - timedelta(seconds=settings.requeue_after_seconds))
        ids = [cr.id for cr in stale]
        repo.mark_enqueued(s, ids)
    for i in ids:
        dispatcher.send(EXECUTE_CONFIG_RUN, i)
    return len(ids)


INLINE = {EXECUTE_CONFIG_RUN: execute_config_run, AGGREGATE_RUN: aggregate_run, RECONCILE: reconcile}


def _register() -> None:
    from app.dispatch import get_dispatcher
    from workers.celery_app import celery_app

    @celery_app.task(name=EXECUTE_CONFIG_RUN)
    def execute_task(config_run_id: int) -> str:
        return execute_config_run(config_run_id, get_dispatcher())

    @celery_app.task(name=AGGREGATE_RUN)
    def aggregate_task(run_id: int) -> str:
        return aggregate_run(run_id)

    @celery_app.task(name=RECONCILE)
    def reconcile_task() -> int:
        return reconcile(get_dispatcher())


try:  # Celery is a hard dependency, but the embedded default must not need a broker to import
    _register()
except ImportError:  # pragma: no cover
    pass
