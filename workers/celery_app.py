"""The Celery app. Reliability settings follow REFERENCE.md §8: late acks, reject on worker
loss, prefetch 1 for long GPU tasks, JSON only, and visibility_timeout > time limits > job."""

from __future__ import annotations

from celery import Celery

from app.dispatch import TASK_QUEUES
from app.settings import get_settings
from app.ssrf import hide_url_logs

settings = get_settings()
hide_url_logs()
TIME_LIMIT = 4 * 3600  # hard limit for one config-run
SOFT_TIME_LIMIT = TIME_LIMIT - 300
VISIBILITY_TIMEOUT = TIME_LIMIT + 1800  # > time limit, or Redis redelivers running tasks

celery_app = Celery("canary", broker=settings.broker_url or "redis://127.0.0.1:6379/0",
                    backend=settings.result_backend, include=["workers.tasks"])
celery_app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_time_limit=TIME_LIMIT,
    task_soft_time_limit=SOFT_TIME_LIMIT,
    broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
    result_backend_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
    visibility_timeout=VISIBILITY_TIMEOUT,
    broker_connection_retry_on_startup=True,
    task_routes={name: {"queue": queue} for name, queue in TASK_QUEUES.items()},
    task_default_queue="default",
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    # exactly one beat (`canary worker --beat` on one worker); schedules are exactly-once per slot anyway
    beat_schedule={"reconcile": {"task": "canary.reconcile", "schedule": settings.reconcile_seconds},
                   "tick-schedules": {"task": "canary.tick_schedules", "schedule": 60.0}},
)
