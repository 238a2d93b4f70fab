"""Fault injection on real processes (docs/reference.md §8). The tests here own their Postgres cluster
and their Redis server (started from the local binaries on free ports) so they can stop and
restart them; the API runs under uvicorn and every Celery worker is its own process group, so a
test can kill -9 or SIGSTOP a whole worker (main process and pool child) as a node failure would.

Settings are shortened so faults resolve in seconds: an 8 s lease, the reconciler every 2 s,
re-enqueue after 2 s. Each test records a row (fault, runs attempted, completed, results lost,
duplicates) that the session prints as a table at the end (tests/conftest.py)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import httpx
import pytest

from tests.conftest import FAULT_REPORT_ENV, ROOT, throwaway_pg_database
from tests.loopback import free_port, wait_http

LEASE_SECONDS = 8


def _missing(what: str) -> None:
    msg = f"{what}; install it (Debian: postgresql, redis-server) or set CANARY_PG_BINDIR / CANARY_REDIS_SERVER"
    if os.environ.get("CI"):
        pytest.fail(f"CI=true: {msg}", pytrace=False)
    pytest.skip(f"SKIPPED LOUDLY: {msg}")


def _pg_bindir() -> str | None:
    if os.environ.get("CANARY_PG_BINDIR"):
        return os.environ["CANARY_PG_BINDIR"]
    if shutil.which("pg_ctl"):
        return os.path.dirname(shutil.which("pg_ctl"))
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[-3]))
    return os.path.dirname(found[-1]) if found else None


class PgServer:
    """A throwaway Postgres cluster: initdb into a temp dir, pg_ctl start/stop/restart. Postgres
    refuses to run as root, so as root it runs as the `postgres` user."""

    def __init__(self, bindir: str):
        self.bindir, self.port = bindir, free_port()
        self.dir = tempfile.mkdtemp(prefix="canary-pg-")
        self.data, self.log = os.path.join(self.dir, "data"), os.path.join(self.dir, "pg.log")
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
            os.chmod(self.dir, 0o755)
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._pg("initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")

    def _pg(self, tool: str, *args: str) -> None:
        subprocess.run([*self.as_user, os.path.join(self.bindir, tool), *args], check=True, capture_output=True,
                       cwd=self.dir, timeout=120)

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._pg("pg_ctl", "-D", self.data, "-l", self.log, "-o", opts, "-w", "start")

    def stop(self) -> None:
        self._pg("pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")  # terminates every connection

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def close(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer:
    """redis-server on a free port, no persistence: a restart loses every queued message (the
    worst case; the reconciler must recover from Postgres alone)."""

    def __init__(self, binary: str):
        self.binary, self.port = binary, free_port()
        self.dir = tempfile.mkdtemp(prefix="canary-redis-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory-policy", "noeviction", "--dir", self.dir],
            stdout=open(os.path.join(self.dir, "redis.log"), "a"), stderr=subprocess.STDOUT)
        import redis

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=1).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.1)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server():
    bindir = _pg_bindir()
    if not bindir or not os.path.exists(os.path.join(bindir, "initdb")):
        _missing("PostgreSQL server binaries (initdb, pg_ctl) not found")
    server = PgServer(bindir)
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_server():
    binary = os.environ.get("CANARY_REDIS_SERVER") or shutil.which("redis-server")
    if not binary:
        _missing("redis-server not found")
    server = RedisServer(binary)
    server.start()
    yield server
    server.close()


@dataclass
class FaultStack:
    env: dict[str, str]
    api: str
    dir: str
    pg: PgServer
    redis: RedisServer
    db_url: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    responses: list[str] | None = None  # set to a list to keep every API response (headers and body)
    suite_size: tuple[int, int] = (64, 4)  # (documents, prompts) of the suite seed_project made

    @property
    def http(self) -> httpx.Client:
        def keep(r: httpx.Response) -> None:
            if self.responses is not None:
                r.read()
                self.responses.append(f"{dict(r.headers)}\n{r.text}")

        return httpx.Client(base_url=self.api, timeout=30, headers=self.headers, event_hooks={"response": [keep]})

    def start_worker(self, name: str, queues: str = "gpu", beat: bool = False) -> subprocess.Popen:
        """A `canary worker` in its own process group (main process + one pool child)."""
        log = self.logs.setdefault(name, os.path.join(self.dir, f"{name}.log"))
        cmd = [sys.executable, "-m", "app.cli", "worker", "--queues", queues, "--concurrency", "1",
               "--name", f"{name}-{uuid.uuid4().hex[:4]}@%h"] + (["--beat"] if beat else [])
        proc = subprocess.Popen(cmd, cwd=self.dir, env={**self.env, "PGAPPNAME": name}, stdout=open(log, "a"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        deadline = time.monotonic() + 120
        while "ready." not in self.tail(name, 400):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not start:\n{self.tail(name)}")
            time.sleep(0.3)
        return proc

    def signal_worker(self, name: str, sig: int) -> None:
        os.killpg(self.procs[name].pid, sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait(timeout=10)

    def tail(self, name: str, n: int = 80) -> str:
        try:
            with open(self.logs[name], encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except FileNotFoundError:
            return ""

    def sql(self, query: str, *args) -> list[tuple]:
        import psycopg

        with psycopg.connect(self.db_url, connect_timeout=5) as conn:
            return conn.execute(query, args).fetchall()

    def config_runs(self, run_id: int) -> list[dict]:
        rows = self.sql("SELECT cr.id, c.name, cr.status, cr.attempt, cr.worker, cr.progress_done, cr.progress_total, cr.error, "
                        "cr.started_at, cr.lease_expires_at "
                        "FROM config_runs cr JOIN optimization_configs c ON c.id = cr.config_id WHERE cr.run_id = %s ORDER BY cr.id", run_id)
        keys = ("id", "config", "status", "attempt", "worker", "done", "total", "error", "started_at", "lease_expires_at")
        return [dict(zip(keys, r, strict=False)) for r in rows]

    def wait_for(self, what: str, predicate, timeout: float = 180, interval: float = 0.2):
        deadline, error = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                value = predicate()
            except Exception as e:  # noqa: BLE001 - a service may be down on purpose
                value, error = None, e
            if value:
                return value
            time.sleep(interval)
        logs = "\n".join(f"--- {k}\n{self.tail(k, 40)}" for k in self.logs)
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {error!r})\n{logs}")

    def wait_run(self, run_id: int, timeout: float = 240) -> dict:
        def finished():
            body = self.http.get(f"/api/v1/projects/faults/runs/{run_id}").json()
            return body if body["status"] in ("done", "failed") else None

        return self.wait_for(f"run {run_id} to finish", finished, timeout, interval=0.5)

    def result_counts(self, run_id: int) -> dict[tuple[str, str], tuple[int, int]]:
        """(config, metric) → (rows, distinct sample keys)."""
        rows = self.sql("SELECT c.name, sr.metric, count(*), count(DISTINCT sr.sample_key) FROM sample_results sr "
                        "JOIN optimization_configs c ON c.id = sr.config_id WHERE sr.run_id = %s GROUP BY 1, 2", run_id)
        return {(c, m): (n, d) for c, m, n, d in rows}


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGCONT)  # a stopped worker cannot act on SIGTERM
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, PermissionError):
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.fixture
def fault_stack(pg_server, redis_server, request):
    """A fresh database and an empty broker; the API and one bookkeeping worker (queues cpu and
    default, and the single beat: reconciler, notifications). Tests start their GPU workers."""
    import redis

    with throwaway_pg_database(pg_server.url(), "faults") as db_url:
        redis.Redis.from_url(redis_server.url).flushall()
        yield from _fault_stack(pg_server, redis_server, db_url, getattr(request, "param", {}))


def _fault_stack(pg_server, redis_server, db_url, overrides):
    workdir = tempfile.mkdtemp(prefix="canary-faults-")
    env = {
        **os.environ,
        "CANARY_DATABASE_URL": db_url,
        "CANARY_BROKER_URL": redis_server.url,
        "CANARY_EXECUTION": "celery",
        "CANARY_ESCALATION": "false",
        "CANARY_URL_ALLOWLIST": "127.0.0.1:*,localhost:*",
        "CANARY_LEASE_SECONDS": str(LEASE_SECONDS),
        "CANARY_REQUEUE_AFTER_SECONDS": "2",
        "CANARY_RECONCILE_SECONDS": "2",
        "CANARY_DB_RETRY_SECONDS": "60",
        "PYTHONUNBUFFERED": "1",
        **overrides,
    }
    subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], cwd=ROOT, env=env, check=True, capture_output=True)
    port = free_port()
    st = FaultStack(env=env, api=f"http://127.0.0.1:{port}", dir=workdir, pg=pg_server, redis=redis_server,
                    db_url=db_url)
    st.logs["api"] = os.path.join(workdir, "api.log")
    try:
        st.procs["api"] = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app.api.main:app", "--host", "127.0.0.1", "--port", str(port)],
            cwd=workdir, env=env, stdout=open(st.logs["api"], "a"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(f"{st.api}/healthz", st.procs["api"], st.logs["api"])
        st.start_worker("bookkeeper", queues="cpu,default,notify", beat=True)
        yield st
    finally:
        for proc in st.procs.values():
            _stop(proc)
        shutil.rmtree(workdir, ignore_errors=True)


SAMPLES, PROMPTS = 40, 4


def seed_project(st: FaultStack, candidates: tuple[str, ...] = ("int8",), samples: int = SAMPLES,
                 prompts: int = PROMPTS) -> None:
    """Project 'faults': the tiny model, an fp16 baseline and candidates (named after their
    weights), and a suite of 40 documents (5 engine calls of 8 documents: a config-run takes
    several seconds, so faults land in the middle of it) plus 4 generations."""
    http = st.http
    st.suite_size = (samples, prompts)
    if not st.headers:  # with keys required, `canary keys create` made the project
        assert http.post("/api/v1/projects", json={"name": "faults"}).status_code == 201
    P = "/api/v1/projects/faults"
    assert http.post(f"{P}/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
    for body in ({"name": "fp16", "model": "tiny", "baseline": True, "weights": "fp16"},
                 *({"name": w, "model": "tiny", "weights": w} for w in candidates)):
        r = http.post(f"{P}/configs", json=body)
        assert r.status_code == 201, r.text
    r = http.post(f"{P}/suites", json={
        "name": "daily", "corpus": "builtin:pydoc-heldout", "samples": samples, "seed": 7,
        "perplexity": {"window": 128}, "generation": {"prompts": prompts, "prompt_words": 8, "max_new_tokens": 4}})
    assert r.status_code == 201, r.text


def start_run(st: FaultStack) -> int:
    r = st.http.post("/api/v1/projects/faults/runs", json={"suite": "daily"})
    assert r.status_code == 202, r.text
    return r.json()["run_id"]


def check_results(st: FaultStack, run_id: int, configs: tuple[str, ...] = ("fp16", "int8")) -> tuple[int, int]:
    """(lost, duplicated) per-sample results of a run against what the suite asks for: missing
    (config, sample, metric) rows, and rows beyond one per key (which the unique key and the
    upsert rule out)."""
    counts = st.result_counts(run_id)
    lost = dup = 0
    for c in configs:
        for metric, want in zip(("nll", "generation"), st.suite_size, strict=True):
            rows, distinct = counts.get((c, metric), (0, 0))
            lost += max(0, want - distinct)
            dup += rows - distinct
    return lost, dup


def double_finishes(st: FaultStack, succeeded: int) -> int:
    """Config-runs executed to success more than once: all worker logs together must show exactly
    one successful execution per succeeded config-run (a redelivered or re-sent task must be
    skipped or fenced, never run again to the end)."""
    finishes = sum(st.tail(name, 100_000).count(": 'succeeded'") for name in st.logs if name != "api")
    return finishes - succeeded


def record(fault: str, attempted: int, completed: int, lost: int, duplicates: int, note: str = "") -> None:
    """One row of the session's fault table. Under pytest-xdist (`make test` runs this folder two
    at a time) each worker appends to the file tests/conftest.py named for the session, and the
    controller prints the table from it."""
    row = {"fault": fault, "attempted": attempted, "completed": completed, "lost": lost,
           "duplicates": duplicates, "note": note}
    path = os.environ.get(FAULT_REPORT_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
