"""A run can be cancelled (security round 3, M4): a queued or running run ends `cancelled` with
verdict error, its unfinished config-runs end `cancelled`, a worker still on one is fenced out at
its next write, what they had written is deleted, and a gate on the run decides error. An ended
run is a 409 (API) or a one-line error with exit 2 (CLI). The dispatcher records what it would
enqueue, so the config-runs stay queued until this test plays the worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.models import ConfigRun, Gate, Run, SampleResult
from app.services import apply_config_file, cancel_run, start_run
from sqlalchemy import func, select

from tests.conftest import ROOT
from tests.unit.test_queue_fairness import Recorder, project


def _queued_run() -> int:
    with session_scope() as s:
        apply_config_file(s, parse_config(project("p")))
    run_id, _ = start_run("p", "s", None, Recorder())
    return run_id


def test_cancel_stops_the_run_fences_its_worker_and_keeps_nothing_half_written(sqlite_env):
    run_id = _queued_run()
    with session_scope() as s:
        fp16, int8 = s.scalars(select(ConfigRun).where(ConfigRun.run_id == run_id).order_by(ConfigRun.id)).all()
        attempt = repo.claim_config_run(s, int8.id, "gpu-a", 60, 3)  # a worker is half-way through int8
        repo.write_sample_results(s, run_id, int8.config_id, [
            {"sample_key": "d0", "metric": "nll", "value": 1.0, "extra": None}])
        s.add(Gate(project_id=s.get(Run, run_id).project_id, run_id=run_id, candidate="int8", baseline="fp16",
                   idempotency_key="k"))
    with session_scope() as s:
        run = cancel_run(s, repo.get_project(s, "p"), run_id, "ana")  # app/services: the gate decides too
        assert (run.status, run.verdict) == ("cancelled", "error") and run.verdict_reason.startswith("cancelled by ana")
    with session_scope() as s:
        assert [cr.status for cr in s.scalars(select(ConfigRun).where(ConfigRun.run_id == run_id))] == ["cancelled"] * 2
        assert s.scalar(select(func.count()).select_from(SampleResult).where(SampleResult.run_id == run_id)) == 0
        assert not repo.heartbeat(s, int8.id, attempt, 60, 2, 8)  # the worker's next write is refused
        assert repo.claim_config_run(s, fp16.id, "gpu-b", 60, 3) is None  # and nobody takes the other
        assert s.scalar(select(Gate.verdict).where(Gate.run_id == run_id)) == "error"
    with session_scope() as s, pytest.raises(repo.Conflict, match=f"run {run_id} is cancelled: only a queued or running"):
        cancel_run(s, repo.get_project(s, "p"), run_id, "ana")


def test_the_cli_cancels_through_a_pipe_and_refuses_an_ended_run_in_one_line(sqlite_env):
    run_id = _queued_run()
    env = {**os.environ, "CANARY_DATABASE_URL": sqlite_env}
    cmd = [sys.executable, "-m", "app.cli", "runs", "cancel", str(run_id), "--project", "p"]
    first = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and first.stderr.strip() == f"run {run_id} cancelled: fp16, int8 stopped", first
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stderr.strip().count("\n") == 0, again
    assert f"run {run_id} is cancelled: only a queued or running run can be cancelled" in again.stderr


def test_the_api_cancels_a_run_once_then_answers_409_and_404_for_an_unknown_one(server):  # noqa: F811
    http, _ = server
    assert http.post("/projects", json={"name": "a"}).status_code == 201
    assert http.post("/projects/a/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
    assert http.post("/projects/a/configs", json={"name": "fp16", "model": "tiny", "baseline": True}).status_code == 201
    docs = [{"id": f"d{i}", "text": f"os.path.join() joins {i} path components. " * 3} for i in range(4)]
    assert http.post("/projects/a/suites", json={"name": "s", "documents": docs, "samples": 4,
                                                 "scorers": ["perplexity"]}).status_code == 201
    run = http.post("/projects/a/runs", json={"suite": "s"}).json()  # executed in the background
    first = http.post(f"/projects/a/runs/{run['run_id']}/cancel")
    # cancelled while queued or running, or (a fast machine) already done: a 409 either way after
    assert first.status_code in (200, 409), first.text
    if first.status_code == 200:
        assert first.json()["status"] == "cancelled" and first.json()["verdict"] == "error", first.text
    r = http.post(f"/projects/a/runs/{run['run_id']}/cancel")
    assert r.status_code == 409 and "only a queued or running run can be cancelled" in r.json()["detail"], r.text
    assert http.post("/projects/a/runs/999999/cancel").status_code == 404


from tests.unit.test_api_embedded import server  # noqa: E402, F401 - the uvicorn fixture
