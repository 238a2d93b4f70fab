"""Tasks take IDs, never payloads. Each task is one BaseTask instance (workers/base.py: sessions,
retries, metrics, time in queue), run in-process by the embedded default through INLINE and
registered by name as a Celery task for the workers."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from app import repo
from app.broker import held_args
from app.db import is_transient
from app.dispatch import (
    AGGREGATE_RUN,
    ENQUEUED_AT_HEADER,
    EXECUTE_CONFIG_RUN,
    NOTIFY,
    RECONCILE,
    REFRESH_ALERTS,
    TICK_SCHEDULES,
    WARM_UP,
    Dispatcher,
    priority_of,
    stored_priority,
)
from app.models import utcnow
from app.settings import get_settings
from workers.aggregate import after_commit, aggregate_pass, finish_run
from workers.base import BaseTask
from workers.execute import execute_config_run

log = logging.getLogger(__name__)


class AggregateRun(BaseTask):
    name = AGGREGATE_RUN
    failure_results = frozenset({"interrupted"})

    def run_impl(self, run_id: int, *, dispatcher: Dispatcher | None = None) -> str:
        # Idempotent (comparisons are upserted, the run's status gates a second pass), so a pass cut
        # off by a database restart simply runs again. Delivery and escalation come after, outside
        # the retry and the error path: neither may run twice or overwrite the verdict.
        try:
            verdict, alerts = self.retry(lambda: aggregate_pass(run_id), f"aggregate run {run_id}")
        except Exception as e:
            if is_transient(e):  # still unreachable: the run stays 'aggregating' and the reconciler re-sends it
                log.error("aggregation of run %s interrupted, the database is unreachable: %s", run_id,
                          type(e).__name__)
                return "interrupted"
            log.exception("aggregation of run %s failed", run_id)
            with self.session() as session:
                finish_run(session, run_id, "failed", "error", f"aggregation failed: {type(e).__name__}: {e}",
                           only_if=("aggregating",))
            raise
        if alerts is not None:
            after_commit(run_id, alerts, dispatcher)
        return verdict


class Reconcile(BaseTask):
    """Re-enqueue what the broker lost (the broker is not a database): config-runs queued or
    lease-expired for longer than requeue_after_seconds whose message the broker no longer holds
    (app/broker.py: a backlog waiting its turn is not lost, and is never sent twice), each at the
    priority it was first sent with, and runs whose config-runs all finished but whose aggregation
    never completed. Every re-send is idempotent. Not retried: the beat runs it again within
    reconcile_seconds."""

    name = RECONCILE

    def run_impl(self, *, dispatcher: Dispatcher) -> int:
        settings = get_settings()
        cutoff = utcnow() - timedelta(seconds=settings.requeue_after_seconds)
        held = held_args(settings.broker_url, EXECUTE_CONFIG_RUN) if settings.execution_mode == "celery" else None
        with self.session() as session:
            # a queued one whose message waits in the broker is not lost; a running one whose
            # lease expired is re-sent whatever the broker holds (its worker died)
            rows = [config_run for config_run in repo.stale_config_runs(session, cutoff)
                    if not (held is not None and config_run.status == "queued" and config_run.id in held.all)]
            stale = {config_run.id: stored_priority(config_run.priority, config_run.run.trigger) for config_run in rows}
            if held is not None and stale:
                # a waiting message whose config-run is no longer queued is a turn for another one
                # (repo.fair_pick ran that one in another's place): as many of the unheld are not lost
                spare = len(held.waiting - set(repo.queued_ids(session, held.waiting)))
                for config_run_id in sorted(cr.id for cr in rows if cr.status == "queued")[:spare]:
                    del stale[config_run_id]
            config_run_ids = list(stale)
            repo.mark_enqueued(session, config_run_ids)
            run_ids = repo.stalled_runs(session, cutoff)
            stalled = {run_id: repo.run_trigger(session, run_id) for run_id in run_ids}
            for run_id in run_ids:
                repo.reopen_aggregation(session, run_id)
        for config_run_id, priority in stale.items():
            dispatcher.send(EXECUTE_CONFIG_RUN, config_run_id, priority=priority)
        for run_id, run_trigger in stalled.items():
            dispatcher.send(AGGREGATE_RUN, run_id, priority=priority_of(run_trigger))
        with self.session() as session:  # the canary itself: schedules whose runs stopped succeeding
            from app.staleness import notify_stale

            notify_stale(session)
        with self.session() as session:  # the outbox: retries that have come due, and rows a crash left behind
            from app.notify import next_due

            due = next_due(session)
        if due is not None and due <= utcnow():
            dispatcher.send(NOTIFY)
        if config_run_ids or run_ids:
            log.warning("reconciler re-enqueued config-runs %s and aggregation of runs %s", config_run_ids, run_ids)
        return len(config_run_ids) + len(run_ids)


class Notify(BaseTask):
    """Deliver the due notifications of the outbox (app/notify.py)."""

    name = NOTIFY

    def run_impl(self, *, dispatcher: Dispatcher | None = None) -> dict:
        from app.notify import deliver_due

        with self.session() as session:
            return deliver_due(session)


class TickSchedules(BaseTask):
    """Start the runs of schedules whose latest cron slot has not run (app/schedules.py)."""

    name = TICK_SCHEDULES

    def run_impl(self, *, dispatcher: Dispatcher) -> list[int]:
        from app.schedules import tick

        return tick(self.session, dispatcher)


class RefreshAlerts(BaseTask):
    """Re-send firing alerts to Alertmanager channels with endsAt moved ahead, then deliver them
    (app/alert_evaluation.py refresh_alertmanager): Alertmanager keeps them active while the canary fires."""

    name = REFRESH_ALERTS

    def run_impl(self, *, dispatcher: Dispatcher | None = None) -> dict:
        from app.alert_evaluation import refresh_alertmanager
        from app.notify import deliver_due

        with self.session() as session:
            queued = refresh_alertmanager(session)
        if not queued:
            return {"queued": 0}
        with self.session() as session:
            return {"queued": len(queued), **deliver_due(session)}


class WarmUp(BaseTask):
    """Import the engine stack (torch, transformers, the reference engine, the tokenizer classes)
    before the first config-run needs it: the embedded server sends this at start, so its first
    gate does not wait ~3 s for imports on top of its own work."""

    name = WARM_UP

    def run_impl(self, *, dispatcher: Dispatcher | None = None) -> str:
        from transformers import AutoTokenizer

        import engines.reference.engine
        import engines.registry  # noqa: F401
        from engines.zoo import resolve_model_path

        AutoTokenizer.from_pretrained(str(resolve_model_path("builtin:pydoc-target")))  # loads the tokenizer code
        return "warm"


aggregate_run = AggregateRun()
reconcile = Reconcile()
notify = Notify()
tick_schedules = TickSchedules()
refresh_alerts = RefreshAlerts()
warm_up = WarmUp()

INLINE: dict[str, BaseTask] = {task.name: task for task in (execute_config_run, aggregate_run, reconcile, notify,
                                                            tick_schedules, refresh_alerts, warm_up)}


def _register() -> None:
    """Each task of INLINE as a Celery task of the same name; the sender's enqueue time comes in a
    message header (app/dispatch.py CeleryDispatcher)."""
    from app.dispatch import get_dispatcher
    from workers.celery_app import celery_app

    def register(task: BaseTask) -> None:
        def run(celery_task: Any, *args: Any) -> Any:  # celery_task: the bound celery.Task (celery is untyped)
            request = celery_task.request
            enqueued_at = getattr(request, ENQUEUED_AT_HEADER, None) or (request.headers or {}).get(ENQUEUED_AT_HEADER)
            return task(*args, dispatcher=get_dispatcher(), enqueued_at=enqueued_at)

        celery_app.task(name=task.name, bind=True)(run)

    for task in INLINE.values():
        register(task)


try:  # Celery is a hard dependency, but the embedded default must not need a broker to import
    _register()
except ImportError:  # pragma: no cover
    pass
