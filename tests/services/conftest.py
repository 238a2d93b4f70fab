"""The production shape on this machine: real Postgres, real Redis, a real `celery worker`
process and the API under uvicorn on loopback. URLs from the environment, local defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from tests.conftest import ROOT, service_unavailable, throwaway_pg_database
from tests.loopback import free_port, wait_http

PG_URL = os.environ.get("CANARY_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")


def worker_redis_dbs(url: str, worker: str) -> tuple[str, str]:
    """Each pytest-xdist worker (gw0, gw1, …; one process without xdist is gw0) takes its own pair
    of Redis databases below the URL's: its stack's (15, 13, …) and a spare one no stack's Celery
    worker consumes (14, 12, …), so one worker's flush or queues never reach another's."""
    n = int(worker.removeprefix("gw") or 0)
    parts = urlsplit(url)
    db = int(parts.path.strip("/") or 0)
    stack, spare = db - 2 * n, db - 2 * n - 1
    if spare < 1:  # database 0 is the default one: a developer's own broker, never flushed here
        raise RuntimeError(f"CANARY_TEST_REDIS_URL {url}: test worker {worker} needs Redis databases {stack} and "
                           f"{spare}; give a database number of at least {2 * n + 2}, or run fewer workers")
    return urlunsplit(parts._replace(path=f"/{stack}")), urlunsplit(parts._replace(path=f"/{spare}"))


REDIS_URL, SPARE_REDIS_URL = worker_redis_dbs(os.environ.get("CANARY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15"),
                                              os.environ.get("PYTEST_XDIST_WORKER", "gw0"))


@pytest.fixture(scope="session")
def pg_database():
    with throwaway_pg_database(PG_URL, "canary_svc") as url:
        yield url


@pytest.fixture(scope="session")
def redis_url():
    import redis

    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
        client.ping()
    except Exception as e:  # noqa: BLE001
        service_unavailable("Redis", REDIS_URL, e)
    client.flushdb()
    yield REDIS_URL
    client.flushdb()


class Stack:
    def __init__(self, env: dict[str, str], api: str, logs: dict[str, str]):
        self.env, self.api, self.logs = env, api, logs
        self.http = httpx.Client(base_url=api, timeout=30)

    def wait_run(self, project: str, run_id: int, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            body = self.http.get(f"/api/v1/projects/{project}/runs/{run_id}").json()
            if body["status"] in ("done", "failed"):
                return body
            time.sleep(0.5)
        raise AssertionError(f"run {run_id} did not finish in {timeout}s: {body}\n{self.tail('worker')}")

    def tail(self, name: str, n: int = 60) -> str:
        with open(self.logs[name], encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])


def _wait_log(proc: subprocess.Popen, log: str, marker: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{open(log).read()[-3000:]}")
        if marker in open(log, encoding="utf-8", errors="replace").read():
            return
        time.sleep(0.3)
    raise RuntimeError(f"'{marker}' not logged after {timeout}s:\n{open(log).read()[-3000:]}")


def start_worker(env: dict[str, str], log: str, queues: str = "gpu,cpu,default,notify", beat: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "app.cli", "worker", "--queues", queues, "--concurrency", "1",
           "--name", f"w{uuid.uuid4().hex[:6]}@%h"]
    if beat:  # beat's schedule file beside the log, not in the checkout
        cmd += ["--beat", "--beat-schedule", os.path.join(os.path.dirname(log), "celerybeat-schedule")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT)
    _wait_log(proc, log, "ready.")
    return proc


@pytest.fixture(scope="module")
def stack(pg_database, redis_url, tmp_path_factory):
    logs_dir = tmp_path_factory.mktemp("logs")
    env = {
        **os.environ,
        "CANARY_DATABASE_URL": pg_database,
        "CANARY_BROKER_URL": redis_url,
        "CANARY_EXECUTION": "celery",
        "CANARY_ESCALATION": "false",
        "CANARY_URL_ALLOWLIST": "127.0.0.1:*,localhost:*",  # escalation runs (full suites) are tested on the embedded default
        "PYTHONUNBUFFERED": "1",
    }
    subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], cwd=ROOT, env=env, check=True, capture_output=True)
    logs = {"worker": str(logs_dir / "worker.log"), "api": str(logs_dir / "api.log")}
    procs = []
    try:
        procs.append(start_worker(env, logs["worker"]))
        port = free_port()
        api = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app.api.main:app", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env=env, stdout=open(logs["api"], "a"), stderr=subprocess.STDOUT,
        )
        procs.append(api)
        wait_http(f"http://127.0.0.1:{port}/healthz", api, logs["api"])
        st = Stack(env, f"http://127.0.0.1:{port}", logs)
        st.procs = procs  # [worker, api]: tests may restart the worker
        yield st
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
