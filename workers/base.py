"""The base of every task (codecov/worker's BaseCodecovTask): it owns the database sessions, the
retry of a transaction cut off by a transient database error, the worker's Prometheus series and
the time-in-queue log line. A task implements `run_impl(id, dispatcher=…)` and reaches the
database only through `self.transaction` (retried as a unit) or `self.session` (not retried).

The same instance runs under Celery (workers/tasks.py registers it by name) and in-process (the
INLINE table that app/dispatch.py's InlineDispatcher finds through the package's entry point).
Both senders stamp the enqueue time (app.dispatch.ENQUEUED_AT_HEADER, wall-clock seconds), so
time in queue is measured the same way: the broker's wait under Celery, the wait behind earlier
tasks in-process (about 0 when nothing else is queued).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

from prometheus_client import Counter, Histogram
from sqlalchemy.orm import Session

from app.db import retry_transient, session_scope
from app.dispatch import Dispatcher

T = TypeVar("T")
log = logging.getLogger(__name__)

# One series per task name, in this process's default registry (a Celery worker serves it when
# CANARY_WORKER_METRICS_PORT is set: workers/celery_app.py).
TASKS_STARTED = Counter("canary_worker_tasks_started", "Tasks started", ["task"])
TASKS_SUCCEEDED = Counter("canary_worker_tasks_succeeded", "Tasks that ended with a successful result", ["task"])
TASKS_FAILED = Counter("canary_worker_tasks_failed",
                       "Tasks that raised, or ended with a failure they recorded (a failed or interrupted config-run)",
                       ["task"])
TASKS_RETRIED = Counter("canary_worker_tasks_retried",
                        "Transactions of a task run again after a transient database error (app.db.retry_transient)",
                        ["task"])
TIME_IN_QUEUE = Histogram("canary_worker_task_time_in_queue_seconds",
                          "Seconds from enqueue (the sender's clock) to the start of the task", ["task"],
                          buckets=(0.01, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600))


class BaseTask:
    """Subclasses set `name` (a task name of app.dispatch) and implement run_impl. A result in
    `failure_results` counts as a failure: the task recorded it (a failed config-run) instead of
    raising, so that the broker does not redeliver it."""

    name: ClassVar[str]
    failure_results: ClassVar[frozenset[str]] = frozenset()

    # each task's own: run_impl(self, <ids>, *, dispatcher) -> its result. Declared as an attribute,
    # not a method, because every task takes different ids (a method here would be overridden
    # with an incompatible signature).
    run_impl: Callable[..., Any]

    def __call__(self, *args: Any, dispatcher: Dispatcher | None = None, enqueued_at: float | None = None) -> Any:
        # the sender's clock against this one: clamp a small skew between hosts to 0
        waited_s = max(0.0, time.time() - enqueued_at) if enqueued_at is not None else 0.0
        TIME_IN_QUEUE.labels(self.name).observe(waited_s)
        TASKS_STARTED.labels(self.name).inc()
        log.info("%s%s started after %.3f s in queue", self.name, list(args), waited_s)
        try:
            result = self.run_impl(*args, dispatcher=dispatcher)
        except Exception:
            TASKS_FAILED.labels(self.name).inc()
            raise
        failed = isinstance(result, str) and result in self.failure_results
        (TASKS_FAILED if failed else TASKS_SUCCEEDED).labels(self.name).inc()
        return result

    def transaction(self, work: Callable[[Session], T], what: str, deadline_s: float | None = None) -> T:
        """work(session) as one transaction (committed when it returns, rolled back when it
        raises), run again as a whole while the database is unreachable, for up to deadline_s
        (default settings.db_retry_seconds; app.db.retry_transient). `what` names it in the log."""
        return self.retry(lambda: self._in_session(work), what, deadline_s)

    def retry(self, work: Callable[[], T], what: str, deadline_s: float | None = None) -> T:
        """Like transaction, for work that opens its own transactions (each one whole, so that
        running work again is safe)."""
        tries = 0

        def once() -> T:
            nonlocal tries
            tries += 1
            if tries > 1:
                TASKS_RETRIED.labels(self.name).inc()
            return work()

        return retry_transient(once, what, deadline_s)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One transaction that is not retried: the caller runs again later anyway (a beat)."""
        with session_scope() as session:
            yield session

    @staticmethod
    def _in_session(work: Callable[[Session], T]) -> T:
        with session_scope() as session:
            return work(session)
