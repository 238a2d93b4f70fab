"""Enqueue tasks by name, after the caller's commit.

Production (`execution = celery`): Celery's send_task by name to the task's queue; the API
process never imports the task code. Embedded default (`inline`): the same task functions, found
through the package's "inference_canary.tasks" entry point (app/ never names workers/), run
in-process — synchronously, or on one background thread for the API server.

Both stamp the enqueue time (a message header, ENQUEUED_AT_HEADER, under Celery; the keyword
argument `enqueued_at` in-process) for the workers' time-in-queue histogram (workers/base.py).

Priorities: a CI gate's tasks go before scheduled and manual runs, and an alert's escalation run
goes last, so a gate never waits behind an escalation's full suite. Under Celery this is the Redis
transport's message priority (one list per step of PRIORITY_STEPS, 0 served first; the worker
sets the same steps); in-process, the queue is ordered by priority, then by arrival.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from functools import lru_cache
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from app.settings import Settings, get_settings

if TYPE_CHECKING:
    from concurrent.futures import Future

log = logging.getLogger(__name__)

EXECUTE_CONFIG_RUN = "canary.execute_config_run"
AGGREGATE_RUN = "canary.aggregate_run"
RECONCILE = "canary.reconcile"
NOTIFY = "canary.notify"
TICK_SCHEDULES = "canary.tick_schedules"
REFRESH_ALERTS = "canary.refresh_alerts"
WARM_UP = "canary.warm_up"  # the embedded server imports the engine stack at start (workers/tasks.py)
# GPU work on its own queue (one process per GPU, prefetch 1); judges and bookkeeping on CPU queues.
TASK_QUEUES = {EXECUTE_CONFIG_RUN: "gpu", AGGREGATE_RUN: "cpu", RECONCILE: "default", NOTIFY: "notify",
               TICK_SCHEDULES: "default", REFRESH_ALERTS: "notify", WARM_UP: "gpu"}
# `notify` is a queue of its own: a receiver that answers slowly holds only the notifier, never the
# worker that aggregates runs and decides gates
TASKS_ENTRY_POINT = "inference_canary.tasks"  # group; entry "inline" → {task name: function}
ENQUEUED_AT_HEADER = "canary_enqueued_at"  # wall-clock seconds (time.time()) when the task was sent
PRIORITY_STEPS = [0, 3, 6, 9]  # kombu's Redis default, set explicitly on the worker (workers/celery_app.py)
GATE_PRIORITY, DEFAULT_PRIORITY, ESCALATION_PRIORITY = 0, 3, 9  # lower is served first
TRIGGER_PRIORITY = {"gate": GATE_PRIORITY, "alert": ESCALATION_PRIORITY}


def priority_of(trigger: str | None) -> int:
    """The queue priority of a run's tasks, from how the run was started (Run.trigger)."""
    return TRIGGER_PRIORITY.get(trigger or "", DEFAULT_PRIORITY)


def fair_priorities(trigger: str | None, queued_before: int, n: int, fair_share: int) -> list[int]:
    """The priority of each of a run's n new config-runs: its trigger's, and one step behind for
    each config-run that takes its project past `fair_share` queued (counting the project's
    config-runs already queued, then this run's in order), so a project's first large run is held
    back as much as a backlog of small ones. A gate's are never held back."""
    base = priority_of(trigger)
    if trigger == "gate":
        return [base] * n
    behind = min(base + PRIORITY_STEPS[1] - PRIORITY_STEPS[0], PRIORITY_STEPS[-1])
    return [base if queued_before + i < fair_share else behind for i in range(n)]


def stored_priority(priority: int | None, trigger: str | None) -> int:
    """A config-run's priority for a re-send: the one it was first sent with, else its trigger's."""
    return priority if priority is not None else priority_of(trigger)


class Dispatcher(Protocol):
    def send(self, task: str, *args: Any, priority: int = DEFAULT_PRIORITY) -> None: ...


class CeleryDispatcher:
    def __init__(self, settings: Settings):
        from celery import Celery

        self.client = Celery("canary-client", broker=settings.broker_url, backend=settings.result_backend)
        self.client.conf.update(task_serializer="json", accept_content=["json"],
                                broker_connection_retry_on_startup=True)

    def send(self, task: str, *args: Any, priority: int = DEFAULT_PRIORITY) -> None:
        self.client.send_task(task, args=list(args), queue=TASK_QUEUES.get(task, "default"), priority=priority,
                              headers={ENQUEUED_AT_HEADER: time.time()})


@lru_cache
def _inline_tasks() -> dict:
    found = entry_points(group=TASKS_ENTRY_POINT, name="inline")
    if not found:
        raise RuntimeError(
            f"no '{TASKS_ENTRY_POINT}' entry point: install the project (pip install -e .) to run tasks in-process, "
            "or set CANARY_BROKER_URL to send them to Celery workers"
        )
    return next(iter(found)).load()


class InlineDispatcher:
    """Runs tasks in this process. Tasks sent while a task runs are queued, not nested, so
    the order matches a broker's: every config-run, then the aggregation it triggers; among
    waiting tasks, the lowest priority number goes first (a gate before an escalation), then the
    earliest sent. background=True runs them on one daemon thread (the API server's embedded mode)."""

    def __init__(self, background: bool = False):
        self.background = background
        # (priority, sequence number, task, args, enqueued at)
        self._queue: queue.PriorityQueue[tuple[int, int, str, tuple, float]] = queue.PriorityQueue()
        self._sent = itertools.count()
        self._lock = threading.Lock()
        self._running = False
        self._thread: threading.Thread | None = None

    def send(self, task: str, *args: Any, priority: int = DEFAULT_PRIORITY) -> None:
        self._queue.put((priority, next(self._sent), task, args, time.time()))
        if self.background:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, name="canary-inline", daemon=True)
                    self._thread.start()
            return
        with self._lock:
            if self._running:  # called from inside a task: the outer drain picks it up
                return
            self._running = True
        try:
            while not self._queue.empty():
                self._run_one(*self._queue.get())
        finally:
            self._running = False

    def _run_then_drain(self, task: str, args: tuple, enqueued_at: float) -> None:
        """Run one task now, then every task it sent (and they sent), in the queue's order."""
        with self._lock:
            self._running = True
        try:
            self._queue.put((DEFAULT_PRIORITY, next(self._sent), task, args, enqueued_at))
            while not self._queue.empty():
                self._run_one(*self._queue.get())
        finally:
            self._running = False

    def _run_one(self, _priority: int, _sequence: int, task: str, args: tuple, enqueued_at: float) -> None:
        try:
            _inline_tasks()[task](*args, dispatcher=self, enqueued_at=enqueued_at)
        except Exception:  # a task records its own failure; keep going with the rest
            log.exception("inline task %s%s failed", task, args)
        finally:
            self._queue.task_done()

    def _serve(self) -> None:
        while True:
            self._run_one(*self._queue.get())

    def drain(self, timeout: float) -> bool:
        """Wait up to timeout seconds for every task sent so far; True when none is left."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.1)
        return not self._queue.unfinished_tasks

    def join(self) -> None:
        """Wait until every task sent so far (and those they sent) has run."""
        self._queue.join()


def _pool_init(threads: int) -> None:
    """A pool process's start: its share of the cores as OpenMP threads, before torch loads (an
    operator's OMP_NUM_THREADS is kept)."""
    import os

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    logging.basicConfig(level=logging.WARNING)


class _HandBack(InlineDispatcher):
    """A pool process's dispatcher: what a task sends runs after it in the same process, in order,
    except config-runs (a top-up's, a step back's), which go back to the pool to run side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.handed_back: list[tuple[str, tuple]] = []

    def send(self, task: str, *args: Any, priority: int = DEFAULT_PRIORITY) -> None:
        if task == EXECUTE_CONFIG_RUN:
            self.handed_back.append((task, args))
            return
        super().send(task, *args, priority=priority)


def _pool_run(task: str, args: tuple, enqueued_at: float) -> list[tuple[str, tuple]]:
    """One task in a pool process, with what it sends (its run's aggregation, a notification) run
    after it in the same process, in order; returns the config-runs it sent, for the pool."""
    dispatcher = _HandBack()
    dispatcher._run_then_drain(task, args, enqueued_at)
    return dispatcher.handed_back


class LocalPoolDispatcher:
    """Runs config-runs in `processes` processes of this machine at once (spawned, each with its
    own engine cache and its share of the cores as torch threads); what a config-run sends runs
    after it in its process, but for config-runs (a top-up's), which come back to the pool. For a
    one-shot run on the embedded default (`canary demo`): on the demo's tiny model a config-run is
    bound more by Python than by its matrix products, so two at once on two cores, one thread each,
    take less time than one after the other with two threads (benchmarks/demo.py: 123 s against
    162 s warm). The results are a config-run's own whichever
    process runs it; the database (SQLite in WAL mode) takes each process's writes in turn."""

    def __init__(self, processes: int, cores: int | None = None):
        import multiprocessing
        import os
        from concurrent.futures import ProcessPoolExecutor

        threads = max(1, (cores or os.cpu_count() or 1) // processes)
        self._pool = ProcessPoolExecutor(max_workers=processes, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_pool_init, initargs=(threads,))
        self._futures: list = []
        self._done = 0  # tasks finished with what they handed back sent
        self._settled = threading.Condition()

    def send(self, task: str, *args: Any, priority: int = DEFAULT_PRIORITY) -> None:
        future = self._pool.submit(_pool_run, task, args, time.time())
        with self._settled:
            self._futures.append(future)
        future.add_done_callback(self._hand_back)

    def _hand_back(self, future: Future[list[tuple[str, tuple]]]) -> None:
        """The config-runs a finished task sent (a top-up's, a step back's) go to the pool in turn, so
        two run side by side as the first pass's did; sent from a thread of its own (the callback
        runs on the pool's manager thread), then the task counts as settled."""
        sent = [] if future.cancelled() or future.exception() is not None else future.result()

        def settle() -> None:
            try:
                for task, args in sent:
                    self.send(task, *args)
            except RuntimeError as e:  # the pool was let go (a drain that timed out): they stay queued
                log.error("config-runs %s not sent: %s", [args for _, args in sent], e)
            finally:
                with self._settled:
                    self._done += 1
                    self._settled.notify_all()

        threading.Thread(target=settle, name="canary-pool-hand-back", daemon=True).start()

    def drain(self, timeout: float) -> bool:
        """Wait up to timeout seconds for every task sent so far (and what they sent), then let the
        processes go; True when none is left."""
        deadline = time.monotonic() + timeout
        with self._settled:
            while self._done < len(self._futures) and time.monotonic() < deadline:
                self._settled.wait(max(0.0, deadline - time.monotonic()))
            futures, pending = list(self._futures), self._done < len(self._futures)
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                log.error("pool task failed: %s", future.exception())
        self._pool.shutdown(wait=not pending, cancel_futures=pending)
        return not pending


@lru_cache
def get_dispatcher(background: bool = False) -> Dispatcher:
    settings = get_settings()
    if settings.execution_mode == "celery":
        return CeleryDispatcher(settings)
    return InlineDispatcher(background=background)
