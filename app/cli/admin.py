"""Operating the service: serve, worker, engine-serve, keys, db, schema and alert-rules."""


from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping

import typer

from app.cli.base import app, console, db_app, fail, keys_app
from app.cli.runs import _upgrade_db


@app.command()
def serve(host: str = "127.0.0.1", port: int = 8000,
          upgrade_db: bool = typer.Option(True, help="run migrations first"),
          workers: int = typer.Option(1, min=1, max=64, help="API processes (with Celery only: the embedded "
                                                             "default runs its tasks in the one process)"),
          dashboard: bool = typer.Option(False, "--dashboard", help="also start the Streamlit dashboard on this "
                                                                   "API (stopped with it)"),
          dashboard_port: int = typer.Option(8501, min=1, max=65535, help="with --dashboard: its port"),
          dashboard_host: str = typer.Option("127.0.0.1", help="with --dashboard: the address it listens on (it "
                                                              "reads the API with this process's keys: loopback "
                                                              "unless you mean to share it)")) -> None:
    """Run the API server (OpenAPI docs at /docs); with --dashboard, the dashboard beside it."""
    import uvicorn

    from app.settings import get_settings

    if workers > 1 and get_settings().execution_mode != "celery":
        fail("--workers: more than one API process needs Celery (set CANARY_BROKER_URL); the embedded default "
             "runs tasks inside the one API process")
    if dashboard and dashboard_port == port:
        fail(f"--dashboard-port: {dashboard_port} is the API's own --port; give the dashboard another one")
    if dashboard:
        import importlib.util

        if importlib.util.find_spec("streamlit") is None:
            fail("--dashboard needs Streamlit, which is not installed: pip install 'inference-canary[dashboard]'")
    if upgrade_db:
        _upgrade_db()
    # X-Forwarded-For is taken only from the proxies named (uvicorn would trust loopback by
    # default, so any local client could pick its own address); FORWARDED_ALLOW_IPS, uvicorn's own
    # variable, is still read when the setting is empty
    proxies = get_settings().forwarded_allow_ips.strip() or os.environ.get("FORWARDED_ALLOW_IPS", "").strip()
    ui = _start_dashboard(host, port, dashboard_host, dashboard_port) if dashboard else None
    try:
        uvicorn.run("app.api.main:app", host=host, port=port, log_level="info", workers=workers,
                    proxy_headers=bool(proxies), forwarded_allow_ips=proxies or None)
    finally:
        if ui is not None:
            ui.terminate()
            try:
                ui.wait(20)
            except subprocess.TimeoutExpired:
                ui.kill()


def dashboard_script() -> str:
    """The dashboard's entry point (dashboard/app.py), wherever the package is installed."""
    import importlib.util

    spec = importlib.util.find_spec("dashboard")
    if spec is None or spec.origin is None:
        fail("the dashboard package is not installed beside the canary; reinstall the project")
    return os.path.join(os.path.dirname(spec.origin), "app.py")


def _die_with_parent(parent: int) -> None:
    """In the dashboard's process before it starts (Linux): SIGTERM when the API's process ends, however
    it ends (uvicorn re-raises a SIGTERM it handled, which ends the process before any `finally`); if the
    API ended before this ran, at once."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


def _start_dashboard(host: str, port: int, dashboard_host: str, dashboard_port: int) -> subprocess.Popen:
    """`streamlit run dashboard/app.py` on this API (CANARY_API_URL), in a child process the API's
    exit stops (on Linux whatever ends the API; elsewhere an interrupt, through serve's `finally`); its
    output goes to this terminal."""
    import functools

    api_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    env = {**os.environ, "CANARY_API_URL": f"http://{api_host}:{port}"}
    cmd = [sys.executable, "-m", "streamlit", "run", dashboard_script(), "--server.port", str(dashboard_port),
           "--server.address", dashboard_host, "--server.headless", "true", "--browser.gatherUsageStats", "false"]
    linux = sys.platform.startswith("linux")
    ui = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                          preexec_fn=functools.partial(_die_with_parent, os.getpid()) if linux else None)
    shown = "127.0.0.1" if dashboard_host in ("0.0.0.0", "::", "") else dashboard_host
    console.print(f"dashboard: http://{shown}:{dashboard_port} (on the API at {env['CANARY_API_URL']})",
                  highlight=False, soft_wrap=True)
    return ui


@app.command()
def worker(
    queues: str = typer.Option("gpu,cpu,default,notify",
                               help="queues to consume: a GPU node takes gpu, CPU nodes cpu,default, the "
                                    "notifier (with the beat) default,notify"),
    concurrency: int = typer.Option(1, help="processes; one per GPU on GPU nodes"),
    beat: bool = typer.Option(False, help="also run the (single) beat scheduler in this worker"),
    beat_schedule: str | None = typer.Option(None, help="with --beat: the file where beat keeps its last run times "
                                             "(default: celerybeat-schedule in the working directory)"),
    name: str | None = typer.Option(None, help="node name, e.g. gpu0@%h (default: celery's)"),
) -> None:
    """Run a Celery worker (needs CANARY_BROKER_URL)."""
    if not os.environ.get("CANARY_BROKER_URL"):
        fail("CANARY_BROKER_URL is not set; a worker needs the Redis broker, e.g. redis://127.0.0.1:6379/0")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.update(worker_threads(concurrency, os.environ, cores))
    cmd = [sys.executable, "-m", "celery", "-A", "workers.celery_app:celery_app", "worker", "-Q", queues,
           "-c", str(concurrency), "--prefetch-multiplier", "1", "-l", "INFO"]
    if name:
        cmd += ["-n", name]
    if beat:
        cmd.append("-B")
        if beat_schedule:
            cmd += ["-s", beat_schedule]
    os.execvp(cmd[0], cmd)


def worker_threads(concurrency: int, environ: Mapping[str, str], cpus: int) -> dict[str, str]:
    """The OpenMP thread count each of a worker's processes starts torch with: its share of the
    node's cores. With the default (a thread per core in every process), N processes on a CPU node
    oversubscribe the cores N-fold and OpenMP's spin-waits eat the rest: two scoring processes on 2
    cores ran about 5.7x slower than with one thread each (tests/conftest.py). An OMP_NUM_THREADS
    the operator set is kept."""
    if environ.get("OMP_NUM_THREADS") or concurrency < 2:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, cpus // concurrency))}


@app.command("engine-serve", add_help_option=False,  # --help reaches the server's own parser, which lists its options
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def engine_serve(ctx: typer.Context) -> None:
    """Serve the reference engine behind an OpenAI-compatible API with vLLM metric names
    (options: --model, --served-model-name, --weights, --kv-cache, --speculative, --port; see --help)."""
    cmd = [sys.executable, "-m", "workers.engine_server", *ctx.args]
    os.execvp(cmd[0], cmd)


@keys_app.command("create")
def keys_create(project: str = typer.Option(..., help="the project the key opens (created if missing)"),
                name: str = typer.Option("default", help="a label for the key"),
                read_only: bool = typer.Option(False, "--read-only",
                                               help="GET only (dashboards); the same as --scope read"),
                scope: str | None = typer.Option(None, help="read | write (default) | metrics (GET /metrics, this "
                                                 "project's figures) | metrics-all (GET /metrics, every project's: "
                                                 "an operator's Prometheus)")) -> None:
    """Create a key and print it once (it cannot be shown again)."""
    from app.auth import SCOPES, create_key
    from app.db import session_scope

    if read_only and scope not in (None, "read"):
        fail(f"--read-only and --scope {scope} contradict each other")
    scope = scope or ("read" if read_only else "write")
    if scope not in SCOPES:
        fail(f"--scope must be one of {', '.join(SCOPES)}")
    from app.config_base import name_problem

    if problem := name_problem(project):
        fail(f"--project {problem}")
    _upgrade_db()
    with session_scope() as session:
        row, key = create_key(session, project, name, scope)
        key_id, scope = row.id, row.scope
    what = {"read": "read-only", "write": "read-write", "metrics": "/metrics of this project only",
            "metrics-all": "/metrics of every project"}[scope]
    console.print(f"key {key_id} for project '{project}' ({what}); store it now:", highlight=False)
    sys.stdout.write(key + "\n")


@keys_app.command("revoke")
def keys_revoke(key_id: int = typer.Argument(..., help="the key's id (from `canary keys list`)")) -> None:
    """Revoke a key: it stops working at once."""
    from app.auth import revoke_key
    from app.db import session_scope
    from app.repo import NotFound

    try:
        with session_scope() as session:
            revoke_key(session, key_id)
    except NotFound as e:
        fail(str(e))
    console.print(f"key {key_id} revoked")


@keys_app.command("list")
def keys_list(project: str = typer.Option(..., help="project name")) -> None:
    """List a project's keys (id, name, scope, revoked) — never the keys themselves."""
    from sqlalchemy import select

    from app import repo
    from app.db import session_scope
    from app.models import ApiKey

    with session_scope() as session:
        project_row = repo.get_project(session, project)
        keys = session.scalars(select(ApiKey).where(ApiKey.project_id == project_row.id).order_by(ApiKey.id))
        for api_key in keys:
            state = "revoked " + api_key.revoked_at.isoformat() if api_key.revoked_at else "active"
            sys.stdout.write(f"{api_key.id}\t{api_key.name}\t{api_key.scope}\t{state}\n")


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations up to REVISION."""
    from app.db import upgrade

    _migrate(upgrade, "upgrade", revision)
    console.print(f"database at revision {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Argument(..., help="target revision, e.g. base")) -> None:
    """Revert migrations down to REVISION, with no run in flight: a downgrade past 0005 drops the
    attempt fence of config-runs that are still running. What a downgrade drops is kept in a stash
    table and put back by the next upgrade into the rows that are still there, so a round trip
    loses nothing (app/migration_stash.py)."""
    from app.db import downgrade

    _migrate(downgrade, "downgrade", revision)
    console.print(f"database at revision {revision}")


def _migrate(step: Callable[..., None], verb: str, revision: str) -> None:
    """Run a migration; one that the database refuses (not one it could not reach) is named as a
    failed migration, with the database's first line: the whole step ran in one transaction on
    PostgreSQL, so its revision stays where it was."""
    from sqlalchemy.exc import DBAPIError

    from app.db import is_transient

    try:
        step(revision=revision)
    except DBAPIError as e:
        if is_transient(e):
            raise  # unreachable: main() says so in one line
        first = (str(e.orig or e).strip().splitlines() or [""])[0][:300]
        fail(f"the {verb} to revision {revision} failed in a migration: {first}; on PostgreSQL the whole step runs "
             "in one transaction, so the database stays at the revision it had")


@app.command()
def schema() -> None:
    """Print the JSON Schema of canary.yaml."""
    from app.config_file import json_schema

    sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")


@app.command("alert-rules")
def alert_rules() -> None:
    """Print the Prometheus alerting rules written from the metric table (deploy/prometheus/canary-rules.yml)."""
    from app.prometheus_rules import render

    sys.stdout.write(render())
