"""The Celery app. Reliability settings follow docs/reference.md §8: late acks, reject on worker
loss, prefetch 1 for long GPU tasks, JSON only, and visibility_timeout > time limits > job.

CANARY_WORKER_METRICS_PORT=<port>: each worker process serves its task series (workers/base.py)
at http://<host>:<port>/metrics, or on the next free port of the 32 that follow when another
process of the node holds it (one process per GPU)."""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import Celery
from celery.signals import worker_process_init

from app.dispatch import DEFAULT_PRIORITY, PRIORITY_STEPS, TASK_QUEUES
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
    # message priorities (app/dispatch.py): a gate's tasks before the rest, escalations last
    broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT, "priority_steps": PRIORITY_STEPS},
    task_default_priority=DEFAULT_PRIORITY,
    result_backend_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
    visibility_timeout=VISIBILITY_TIMEOUT,
    broker_connection_retry_on_startup=True,
    task_routes={name: {"queue": queue} for name, queue in TASK_QUEUES.items()},
    task_default_queue="default",
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    # exactly one beat (`canary worker --beat` on one worker); schedules are exactly-once per slot anyway
    beat_schedule={"reconcile": {"task": "canary.reconcile", "schedule": settings.reconcile_seconds},
                   "tick-schedules": {"task": "canary.tick_schedules", "schedule": 60.0},
                   "refresh-alerts": {"task": "canary.refresh_alerts",
                                      "schedule": settings.alertmanager_resend_seconds}},
)


@worker_process_init.connect
def serve_metrics(**_kwargs: Any) -> None:
    port = get_settings().worker_metrics_port
    if not port:
        return
    from prometheus_client import start_http_server

    for candidate in range(int(port), int(port) + 32):
        try:
            start_http_server(candidate)
        except OSError:  # taken by a sibling process
            continue
        logging.getLogger(__name__).info("task metrics of process %s on :%s/metrics", os.getpid(), candidate)
        return
    logging.getLogger(__name__).warning("CANARY_WORKER_METRICS_PORT=%s: ports %s-%s are all taken; no task metrics",
                                        port, port, int(port) + 31)
