"""Workers die, hang, and lose their broker or database in the middle of a config-run; every run
still completes with exactly the results its suite asks for — none missing, none twice — and a
worker that comes back after its lease expired cannot write over its successor's work."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.faults.conftest import check_results, double_finishes, record, seed_project, start_run


def half_done(st, run_id):
    """The first config-run that has written some, but not all, of its results."""
    return st.wait_for("a config-run in the middle of its work", lambda: next(
        (c for c in st.config_runs(run_id) if c["status"] == "running" and 0 < (c["done"] or 0) <= (c["total"] or 0) / 2), None),
        interval=0.1)


def worker_group(cr: dict) -> int:
    """The process group of the worker that holds a config-run (its id is host:pid of the pool child)."""
    return os.getpgid(int(cr["worker"].rsplit(":", 1)[1]))


def assert_complete(st, run_ids, fault, note=""):
    """Every run finished with every config-run succeeded exactly once and every result present
    once; records the fault's row for the table. Returns the config-runs of each run."""
    runs, all_crs, lost, dup = [], [], 0, 0
    for run_id in run_ids:
        runs.append(st.wait_run(run_id))
        crs = st.config_runs(run_id)
        all_crs.append(crs)
        l, d = check_results(st, run_id, tuple(c["config"] for c in crs))
        lost, dup = lost + l, dup + d
    dup += double_finishes(st, sum(c["status"] == "succeeded" for crs in all_crs for c in crs))
    completed = sum(run["status"] == "done" and all(c["status"] == "succeeded" for c in crs) for run, crs in zip(runs, all_crs, strict=False))
    record(fault, len(run_ids), completed, lost, dup, note)
    for run, crs in zip(runs, all_crs, strict=False):
        assert run["status"] == "done", run
        assert [c["status"] for c in crs] == ["succeeded"] * len(crs), crs
        assert run["verdict"] in ("pass", "warn", "fail", "inconclusive")
    assert (lost, dup) == (0, 0)
    return [c for crs in all_crs for c in crs]


def start_runs(st):
    """Two runs: the first is in flight when the fault strikes, the second waits in the queue."""
    return [start_run(st), start_run(st)]


def test_kill_9_a_worker_mid_config_run(fault_stack):
    st = fault_stack
    seed_project(st)
    a = st.start_worker("gpu-a")
    run_ids = start_runs(st)
    victim = half_done(st, run_ids[0])
    assert worker_group(victim) == a.pid
    st.signal_worker("gpu-a", signal.SIGKILL)  # main process and pool child: a node lost
    b = st.start_worker("gpu-b")
    crs = assert_complete(st, run_ids, "kill -9 worker mid config-run",
                             f"killed at {victim['done']}/{victim['total']}; attempt 2 on the new worker")
    taken = next(c for c in crs if c["id"] == victim["id"])
    # the lease ran out, the reconciler re-sent it, and the new worker's attempt 2 finished it
    assert taken["attempt"] == 2 and worker_group(taken) == b.pid


def test_sigstop_past_the_lease_then_sigcont_is_fenced(fault_stack):
    st = fault_stack
    seed_project(st)
    a = st.start_worker("gpu-a")
    run_ids = start_runs(st)
    run_id = run_ids[0]
    victim = half_done(st, run_id)
    # Stop it between transactions: stopped inside one, it would hold the row lock and nobody
    # could take over (safe, but not the fault under test). Its connections carry its name.
    for _ in range(50):
        st.signal_worker("gpu-a", signal.SIGSTOP)
        time.sleep(0.2)
        if not st.sql("SELECT 1 FROM pg_stat_activity WHERE application_name = 'gpu-a' AND xact_start IS NOT NULL"):
            break
        st.signal_worker("gpu-a", signal.SIGCONT)
        time.sleep(0.05)
    else:
        pytest.fail("could not stop the worker between two transactions in 50 tries")
    victim = next(c for c in st.config_runs(run_id) if c["id"] == victim["id"])
    assert victim["status"] == "running" and victim["done"] < victim["total"]
    b = st.start_worker("gpu-b")
    crs = assert_complete(st, run_ids, "SIGSTOP worker past its lease, then SIGCONT",
                               f"stopped at {victim['done']}/{victim['total']}; the stale attempt's write refused")
    taken = next(c for c in crs if c["id"] == victim["id"])
    assert taken["attempt"] == victim["attempt"] + 1 and worker_group(taken) == b.pid
    assert taken["started_at"] >= victim["lease_expires_at"]  # taken over only once the stopped worker's lease expired
    before = st.sql("SELECT config_id, sample_key, metric, value, extra::text FROM sample_results WHERE run_id = %s "
                    "ORDER BY 1, 2, 3", run_id)
    state = [(c["status"], c["attempt"], c["worker"]) for c in st.config_runs(run_id)]
    st.signal_worker("gpu-a", signal.SIGCONT)
    # the old attempt wakes up, finishes the batch it was computing, and its fenced write is refused
    st.wait_for("the stale worker to be fenced", lambda: f"attempt {victim['attempt']} lost its lease" in st.tail("gpu-a", 400),
                timeout=60)
    after = st.sql("SELECT config_id, sample_key, metric, value, extra::text FROM sample_results WHERE run_id = %s "
                   "ORDER BY 1, 2, 3", run_id)
    assert after == before
    assert [(c["status"], c["attempt"], c["worker"]) for c in st.config_runs(run_id)] == state
    assert a.poll() is None  # the stale worker lives on and takes new work


def restart_mid_run(st, server):
    """Two runs on one worker; when the first is half done, the server is down for 3 s."""
    seed_project(st)
    st.start_worker("gpu-a")
    run_ids = start_runs(st)
    victim = half_done(st, run_ids[0])
    server.stop()
    time.sleep(3)
    server.start()
    return run_ids, victim


def test_redis_restart_with_a_run_in_flight(fault_stack):
    st = fault_stack
    run_ids, victim = restart_mid_run(st, st.redis)  # no persistence: every queued message is gone
    assert_complete(st, run_ids, "restart Redis (no persistence) mid-run",
                    f"down 3 s at {victim['done']}/{victim['total']}; lost messages re-sent by the reconciler")
    # the other config-run's message was lost with Redis: only the reconciler can have re-sent it
    assert "reconciler re-enqueued config-runs" in st.tail("bookkeeper", 100_000)


def test_postgres_restart_mid_run(fault_stack):
    st = fault_stack
    run_ids, victim = restart_mid_run(st, st.pg)  # fast shutdown: every connection is terminated
    crs = assert_complete(st, run_ids, "restart Postgres mid-run",
                             f"down 3 s at {victim['done']}/{victim['total']}; writes retried")
    assert next(c for c in crs if c["id"] == victim["id"])["attempt"] == 1  # retried in place, nothing redone
    assert "database unavailable" in st.tail("gpu-a", 100_000)  # the outage was met, not slept through


@pytest.mark.parametrize("fault_stack", [{"CANARY_MAX_ATTEMPTS": "2"}], indirect=True)
def test_a_poison_config_run_stops_after_max_attempts_and_says_why(fault_stack):
    st = fault_stack
    seed_project(st)
    st.start_worker("gpu-1")
    run_id = start_run(st)
    victim = half_done(st, run_id)
    st.signal_worker("gpu-1", signal.SIGKILL)
    second = st.start_worker("gpu-2")
    st.wait_for("the second attempt to be under way", lambda: next(
        (c for c in st.config_runs(run_id) if c["id"] == victim["id"] and c["attempt"] == 2 and (c["done"] or 0) > 0
         and worker_group(c) == second.pid), None))
    st.signal_worker("gpu-2", signal.SIGKILL)  # the job kills every worker that takes it
    st.start_worker("gpu-3")
    run = st.wait_run(run_id)
    crs = {c["id"]: c for c in st.config_runs(run_id)}
    poisoned = crs[victim["id"]]
    assert poisoned["status"] == "failed" and poisoned["attempt"] == 2
    assert "gave up after 2 attempts" in poisoned["error"] and "stopped renewing its lease" in poisoned["error"]
    assert poisoned["worker"] in poisoned["error"]  # names the last worker, whose log holds the cause
    # the run ends with a verdict that says why, instead of looping
    if poisoned["config"] == "fp16":
        assert run["status"] == "failed" and "baseline 'fp16' failed: gave up after 2 attempts" in run["verdict_reason"]
    else:
        assert run["verdict"] == "incomplete" and poisoned["config"] in run["verdict_reason"]
    others = [c for c in crs.values() if c["id"] != victim["id"]]
    lost, dup = check_results(st, run_id, tuple(c["config"] for c in others))
    dup += double_finishes(st, len(others))
    record("poison job (worker killed on every attempt)", 1, 1, lost, dup,
           "stopped after CANARY_MAX_ATTEMPTS=2 with the reason; the other config complete")
    assert all(c["status"] == "succeeded" for c in others) and (lost, dup) == (0, 0)


SLOW_GPU = {"CANARY_LEASE_SECONDS": "3", "CANARY_TEST_LOAD_DELAY_S": "5", "CANARY_TEST_BATCH_DELAY_S": "4",
            "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(os.path.dirname(__file__), "slow_gpu"),
                                                        os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize("fault_stack", [SLOW_GPU], indirect=True)
def test_two_live_workers_with_batches_longer_than_the_lease(fault_stack):
    """A slow GPU is not a dead one: with a 3 s lease, a 5 s model load and 4 s per batch (the
    test-only tests/faults/slow_gpu), the heartbeat keeps each attempt's lease while its process
    lives, so the other live worker never takes over and no config-run is given up. A small suite
    (8 documents, one engine call, and 1 prompt: every call still outlasts the lease) keeps it to
    about a minute."""
    st = fault_stack
    seed_project(st, samples=8, prompts=1)
    st.start_worker("gpu-a")
    st.start_worker("gpu-b")
    run_ids = start_runs(st)
    for run_id in run_ids:
        st.wait_run(run_id, timeout=400)
    crs = [c for run_id in run_ids for c in st.config_runs(run_id)]
    logs = "".join(st.tail(name, 100_000) for name in ("gpu-a", "gpu-b"))
    taken_over = sum(c["attempt"] - 1 for c in crs)
    given_up = sum("gave up" in (c["error"] or "") for c in crs)
    note = (f"3 s lease, 5 s load, 4 s batches: {len(crs)} config-runs, {taken_over} taken over, {given_up} given up, "
            f"{logs.count('lost its lease')} attempts fenced")
    for c in crs:
        print(c["config"], c["status"], "attempt", c["attempt"], f"{c['done']}/{c['total']}", c["error"])
    assert_complete(st, run_ids, "2 live workers, batches longer than lease", note)
    assert (taken_over, given_up) == (0, 0), crs
    assert "lost its lease" not in logs
    assert len({worker_group(c) for c in crs}) == 2  # both workers took work
