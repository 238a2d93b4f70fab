"""The base task (workers/base.py): what it counts, the time in queue it measures from the
sender's stamp, and the transaction it runs again, whole, after a transient database error."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import exc, text
from workers.base import BaseTask


def sample(name: str, task: str) -> float:
    return REGISTRY.get_sample_value(name, {"task": task}) or 0.0


class Echo(BaseTask):
    name = "test.echo"
    failure_results = frozenset({"failed"})

    def run_impl(self, outcome: str, *, dispatcher=None) -> str:
        if outcome == "raise":
            raise RuntimeError("boom")
        return outcome


def test_outcomes_are_counted_by_task_name_and_time_in_queue_is_from_the_senders_stamp():
    echo, name = Echo(), Echo.name
    before = {k: sample(f"canary_worker_tasks_{k}_total", name) for k in ("started", "succeeded", "failed")}
    waited_before = sample("canary_worker_task_time_in_queue_seconds_sum", name)
    assert echo("done", enqueued_at=time.time() - 5) == "done"
    assert echo("failed") == "failed"  # a failure the task recorded itself
    with pytest.raises(RuntimeError):
        echo("raise")
    after = {k: sample(f"canary_worker_tasks_{k}_total", name) for k in ("started", "succeeded", "failed")}
    assert {k: after[k] - before[k] for k in after} == {"started": 3, "succeeded": 1, "failed": 2}
    # 5 s for the stamped one; 0 for the two with no stamp
    assert sample("canary_worker_task_time_in_queue_seconds_sum", name) - waited_before == pytest.approx(5, abs=0.5)
    assert sample("canary_worker_task_time_in_queue_seconds_count", name) == 3


def test_a_transaction_cut_off_by_a_transient_error_runs_again_whole(sqlite_env):
    echo, name = Echo(), Echo.name
    retried_before = sample("canary_worker_tasks_retried_total", name)
    calls = []

    def work(session) -> int:
        calls.append(session)
        value = session.execute(text("SELECT 41")).scalar() + 1
        if len(calls) == 1:  # the connection drops before the commit
            raise exc.OperationalError("SELECT 41", {}, ConnectionError("server closed the connection"))
        return value

    assert echo.transaction(work, "test work") == 42
    assert len(calls) == 2 and calls[0] is not calls[1]  # a fresh session for the second try
    assert sample("canary_worker_tasks_retried_total", name) - retried_before == 1


def test_a_permanent_error_is_not_retried(sqlite_env):
    echo = Echo()
    calls = []

    def work(session):
        calls.append(session)
        raise exc.IntegrityError("INSERT", {}, ValueError("duplicate key"))

    with pytest.raises(exc.IntegrityError):
        echo.transaction(work, "test work")
    assert len(calls) == 1
