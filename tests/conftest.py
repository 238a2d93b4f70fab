"""Shared test helpers. Service URLs come from the environment with this machine's defaults;
outside CI a missing service skips loudly, under CI=true it fails."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import tempfile
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def service_unavailable(what: str, url: str, err: Exception) -> None:
    msg = f"{what} at {url} is unreachable ({err}); start it or set the URL in the environment"
    if os.environ.get("CI"):
        pytest.fail(f"CI=true: {msg}", pytrace=False)
    pytest.skip(f"SKIPPED LOUDLY: {msg}")


@contextlib.contextmanager
def throwaway_pg_database(server_url: str, prefix: str):
    """A new database on the PostgreSQL server of server_url (…/any_db); yields its URL and drops
    it (WITH FORCE) at exit. An unreachable server skips loudly, or fails under CI."""
    import psycopg

    base, _, _ = server_url.rpartition("/")
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"

    def admin():  # a connection per statement: the server may restart in between (tests/faults)
        return psycopg.connect(f"{base}/postgres", autocommit=True, connect_timeout=5)

    try:
        with admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as e:
        service_unavailable("PostgreSQL", server_url, e)
    try:
        yield f"{base}/{name}"
    finally:
        with admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_env(tmp_path, monkeypatch):
    """A fresh embedded-default database (SQLite file, inline tasks), migrated."""
    from app.db import upgrade
    from app.settings import get_settings

    url = f"sqlite:///{tmp_path / 'canary.db'}"
    monkeypatch.setenv("CANARY_DATABASE_URL", url)
    monkeypatch.setenv("CANARY_EXECUTION", "inline")
    # a firing alert would start a full-suite run (526 documents) inside the test: only the
    # escalation tests turn it back on
    monkeypatch.setenv("CANARY_ESCALATION", "false")
    monkeypatch.setenv("CANARY_URL_ALLOWLIST", "127.0.0.1:*,localhost:*")  # the loopback receivers and judges of the tests
    monkeypatch.delenv("CANARY_BROKER_URL", raising=False)
    get_settings.cache_clear()
    upgrade(url)
    yield url
    get_settings.cache_clear()


# -- test tiers ------------------------------------------------------------------------------------
# `make test` runs everything (what CI and the README run). `make test-fast` runs the tests not
# marked `integration`: those need PostgreSQL, Redis, a server or worker process, a browser, or
# more than about 2 s of model work. Whole folders are integration by where they live; elsewhere a
# test (or a module, with `pytestmark`) says so itself with @pytest.mark.integration.
INTEGRATION_FOLDERS = {"db", "deploy", "e2e", "faults", "http", "interop", "services"}


def pytest_collection_modifyitems(config, items):
    tests = ROOT / "tests"
    for item in items:
        try:
            folder = pathlib.Path(str(item.fspath)).resolve().relative_to(tests).parts[0]
        except ValueError:
            continue
        if folder in INTEGRATION_FOLDERS:
            item.add_marker(pytest.mark.integration)


# -- the fault-injection table -------------------------------------------------------------------
# tests/faults records one row per fault (tests/faults/conftest.py `record`) into a file named here,
# so that the table is whole when pytest-xdist runs those tests in worker processes; the controller
# (or a run without xdist) prints it at the end.
FAULT_REPORT_ENV = "CANARY_FAULT_REPORT"


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller: its workers inherit the variable
        fd, path = tempfile.mkstemp(prefix="canary-fault-report-", suffix=".jsonl")
        os.close(fd)
        os.environ[FAULT_REPORT_ENV] = path
    # An undecided run tops itself up by default (workers/top_up.py): each test judges the samples it
    # draws, so here the default's time budget is none (every process a test starts inherits it). A
    # suite's own max_samples still tops up; the tests of the default set a budget of their own.
    os.environ.setdefault("CANARY_TOP_UP_BUDGET_S", "0")
    share_cores(config)


# -- cores shared between xdist workers ---------------------------------------------------------------
# Each torch process spins up an OpenMP thread per core. Two xdist workers on two cores, each with
# two threads (and their CLI, worker and server subprocesses with two more), oversubscribe the
# cores and OpenMP's spin-waits take the rest: two `canary demo --samples 12` side by side took
# 489 s with the default threads and 85 s with one thread each (this machine, 2 cores). So every
# worker, and through the environment every process it starts, gets cores // workers threads,
# unless OMP_NUM_THREADS is set already.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def share_cores(config) -> None:
    workers = config.workerinput.get("workercount") if hasattr(config, "workerinput") else None
    if workers is None:
        workers = config.getoption("numprocesses", None) if config.pluginmanager.hasplugin("xdist") else None
    if not isinstance(workers, int) or workers < 2:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = str(max(1, cores // workers))
    for variable in THREAD_VARIABLES:
        os.environ.setdefault(variable, threads)
    if "torch" in sys.modules:  # imported before this hook: the variable came too late for it
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_terminal_summary(terminalreporter, config):
    path = os.environ.get(FAULT_REPORT_ENV)
    if hasattr(config, "workerinput") or not path or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    os.unlink(path)
    if not rows:
        return
    tr = terminalreporter
    tr.section("fault injection")
    tr.write_line(f"{'fault':<44} {'attempted':>9} {'completed':>9} {'lost':>5} {'dups':>5}  note")
    for r in rows:
        tr.write_line(f"{r['fault']:<44} {r['attempted']:>9} {r['completed']:>9} {r['lost']:>5} {r['duplicates']:>5}  {r['note']}")
