"""Fairness under a backlog (security round 4, N5): three tenants on the real stack (their own
Postgres and Redis, the API, one GPU worker, a CPU worker, the beat with the notifier), the
default requeue and reconcile timing.

    alpha   a manual run of one config (its baseline) every --every seconds
    beta    a scheduled run of one config, every minute (cron "* * * * *")
    noisy   after the quiet phase, keeps --backlog config-runs queued (runs of three configs,
            started as fast as its queue cap allows), one of which fires an alert to a receiver
            that drips one byte every 5 s

First alpha and beta alone for --quiet-minutes (their quiet time), then with noisy's backlog for
--minutes. Printed (and written to --out): for each quiet tenant in each phase, each run's wait
(queued until its config-run started) and its time to finish, median and max; one GPU config-run's
time (the yardstick for "starts within one config-run's time"); the broker's messages against the
queued config-runs plus workers, sampled every 5 s (the worst excess); and every finished run's
lost and duplicated per-sample results. A quiet run "starts within one config-run's time" when none
of the noisy tenant's config-runs started between its queuing and its own start: it waited for the
config-run holding the GPU and no more (each run's `noisy_ahead` and `held_s` are in the JSON).

    .venv/bin/python benchmarks/fairness_soak.py --minutes 20 --quiet-minutes 4
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.soak import Stack, drip_receiver, log, pct, results_check, service_stores  # noqa: E402
from tests.loopback import free_port, wait_http  # noqa: E402

QUIET = ("alpha", "beta")
WORKERS = 3  # processes that may each hold one message unacknowledged: gpu, cpu, beat/notify


def run_times(conn, project: str, since: float, until: float) -> list[dict]:
    """The project's runs created in [since, until) (epoch seconds): wait and finish seconds, and
    what it waited behind: `noisy_ahead`, the noisy tenant's config-runs that started after the run
    was queued and before its own started (0: it took the first free turn), and `held_s`, how much
    of the config-run holding the GPU when it was queued was left (the least any fair order makes
    it wait)."""
    rows = conn.execute(
        "WITH q AS (SELECT r.id, r.trigger, r.created_at, min(cr.started_at) AS started, r.finished_at, r.status "
        "FROM runs r JOIN projects p ON p.id = r.project_id JOIN config_runs cr ON cr.run_id = r.id "
        "WHERE p.name = %s AND r.created_at >= to_timestamp(%s) AND r.created_at < to_timestamp(%s) GROUP BY r.id) "
        "SELECT q.id, q.trigger, extract(epoch FROM q.created_at), extract(epoch FROM q.started), "
        "extract(epoch FROM q.finished_at), q.status, "
        "(SELECT count(*) FROM config_runs c JOIN runs r2 ON r2.id = c.run_id JOIN projects p2 ON p2.id = r2.project_id "
        " WHERE p2.name = 'noisy' AND c.started_at > q.created_at AND c.started_at < q.started), "
        "(SELECT max(extract(epoch FROM c.finished_at - q.created_at)) FROM config_runs c "
        " WHERE c.started_at <= q.created_at AND c.finished_at > q.created_at) "
        "FROM q", (project, since, until)).fetchall()
    out = []
    for run_id, trigger, created, started, finished, status, ahead, held in rows:
        out.append({"run": run_id, "trigger": trigger, "status": status,
                    "wait_s": round(float(started) - float(created), 1) if started is not None else None,
                    "finish_s": round(float(finished) - float(created), 1) if finished is not None else None,
                    "noisy_ahead": int(ahead) if started is not None else None,
                    "held_s": round(float(held), 1) if held is not None else 0.0})
    return out


def summarise(runs: list[dict]) -> dict:
    waits = [r["wait_s"] for r in runs if r["wait_s"] is not None]
    done = [r["finish_s"] for r in runs if r["finish_s"] is not None]
    ahead = [r["noisy_ahead"] for r in runs if r["noisy_ahead"] is not None]
    beyond = [round(r["wait_s"] - r["held_s"], 1) for r in runs if r["wait_s"] is not None]
    return {"runs": len(runs), "finished": len(done), "unstarted": len(runs) - len(waits),
            "wait_s_median": pct(waits, 50), "wait_s_max": max(waits, default=None),
            "finish_s_median": pct(done, 50), "finish_s_max": max(done, default=None),
            "noisy_ahead_max": max(ahead, default=None), "noisy_ahead_total": sum(ahead),
            "wait_beyond_held_s_median": pct(beyond, 50), "wait_beyond_held_s_max": max(beyond, default=None),
            "each": runs}


def broker_messages(redis_url: str) -> int:
    import redis
    from app.broker import UNACKED, queue_keys

    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    return sum(client.llen(key) for key in queue_keys("gpu")) + client.hlen(UNACKED)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="the phase with noisy's backlog")
    ap.add_argument("--quiet-minutes", type=float, default=4.0, help="alpha and beta alone, first")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between alpha's manual runs")
    ap.add_argument("--backlog", type=int, default=100, help="config-runs noisy keeps queued")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/fairness_soak.json"))
    args = ap.parse_args()

    import psycopg

    workdir = tempfile.mkdtemp(prefix="canary-fair-")
    pg, redis, env = service_stores("fair", CANARY_REQUIRE_API_KEYS="true", CANARY_NOTIFY_TIMEOUT_SECONDS="15",
                                    CANARY_MAX_QUEUED_CONFIG_RUNS_PER_PROJECT=str(args.backlog + 10))
    stack = Stack(env, workdir)
    stop = threading.Event()
    report: dict = {"args": vars(args)}
    try:
        port = free_port()
        stack.start("api", [sys.executable, "-m", "uvicorn", "app.api.main:app", "--host", "127.0.0.1", "--port",
                            str(port)])
        api = f"http://127.0.0.1:{port}"
        wait_http(f"{api}/healthz", stack.procs["api"], os.path.join(workdir, "api.log"))
        stack.worker("gpu", "gpu", "--concurrency", "1")
        stack.worker("cpu", "cpu", "--concurrency", "1")
        stack.worker("beat", "default,notify", "--concurrency", "1", "--beat")
        keys, clients = {}, {}
        for tenant in (*QUIET, "noisy"):
            out = subprocess.run([sys.executable, "-m", "app.cli", "keys", "create", "--project", tenant], cwd=ROOT,
                                 env=env, check=True, capture_output=True, text=True).stdout
            keys[tenant] = out.strip().splitlines()[-1]
            clients[tenant] = httpx.Client(base_url=f"{api}/api/v1/projects/{tenant}", timeout=60,
                                           headers={"Authorization": f"Bearer {keys[tenant]}"})
        drip = drip_receiver()
        for tenant, http in clients.items():
            assert http.post("/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
            configs = [{"name": "fp16", "model": "tiny", "baseline": True}]
            if tenant == "noisy":
                configs += [{"name": "int8", "model": "tiny", "weights": "int8"},
                            {"name": "int2", "model": "tiny", "weights": "rtn-int2"}]
            for body in configs:
                assert http.post("/configs", json=body).status_code == 201, body
            assert http.post("/suites", json={"name": "smoke", "corpus": "builtin:pydoc-heldout", "samples": 16,
                                              "scorers": ["perplexity"], "perplexity": {"window": 64}}).status_code == 201
        assert clients["noisy"].put("/alert-rules", json={"metric": "ppl_ratio", "warn": 1.001}).status_code == 200
        assert clients["noisy"].put("/channels", json={"name": "slow", "kind": "webhook",
                                                       "url": f"http://127.0.0.1:{drip}/hook"}).status_code == 200

        def alpha() -> None:
            while not stop.is_set():
                clients["alpha"].post("/runs", json={"suite": "smoke", "configs": ["fp16"]})
                stop.wait(args.every)

        noisy_on = threading.Event()
        counts: dict[str, int] = {}

        def noisy() -> None:
            noisy_on.wait()
            while not stop.is_set():
                with psycopg.connect(pg.url("fair")) as conn:
                    queued = conn.execute("SELECT count(*) FROM config_runs cr JOIN runs r ON r.id = cr.run_id JOIN "
                                          "projects p ON p.id = r.project_id WHERE p.name = 'noisy' AND "
                                          "cr.status = 'queued'").fetchone()[0]
                if queued + 3 <= args.backlog:
                    r = clients["noisy"].post("/runs", json={"suite": "smoke"})
                    counts[f"noisy_runs_{r.status_code}"] = counts.get(f"noisy_runs_{r.status_code}", 0) + 1
                    continue
                stop.wait(2)

        excess: list[int] = []

        def broker() -> None:
            while not stop.is_set():
                try:
                    with psycopg.connect(pg.url("fair")) as conn:
                        queued = conn.execute("SELECT count(*) FROM config_runs WHERE status = 'queued'").fetchone()[0]
                    excess.append(broker_messages(redis.url) - queued - WORKERS)
                except Exception:  # noqa: BLE001 - a sample missed
                    pass
                stop.wait(5)

        assert clients["beta"].put("/schedules", json={"name": "minutely", "cron": "* * * * *", "suite": "smoke",
                                                       "configs": ["fp16"]}).status_code == 200
        for fn in (alpha, noisy, broker):
            threading.Thread(target=fn, daemon=True).start()
        t0 = time.time()
        log(f"quiet phase: {args.quiet_minutes} min, alpha and beta alone")
        time.sleep(args.quiet_minutes * 60)
        t1 = time.time()
        noisy_on.set()
        log(f"backlog phase: {args.minutes} min, noisy keeps {args.backlog} config-runs queued")
        time.sleep(args.minutes * 60)
        t2 = time.time()
        stop.set()
        log("over: letting the quiet tenants' last runs finish (at most 5 min)")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            with psycopg.connect(pg.url("fair")) as conn:
                busy = conn.execute("SELECT count(*) FROM runs r JOIN projects p ON p.id = r.project_id WHERE p.name "
                                    "IN ('alpha', 'beta') AND r.status IN ('queued', 'running', 'aggregating')"
                                    ).fetchone()[0]
            if not busy:
                break
            time.sleep(5)
        with psycopg.connect(pg.url("fair")) as conn:
            phases = {}
            for tenant in QUIET:
                phases[tenant] = {"quiet": summarise(run_times(conn, tenant, t0, t1)),
                                  "backlog": summarise(run_times(conn, tenant, t1, t2))}
            gpu_s = conn.execute("SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at "
                                 "- started_at)) FROM config_runs WHERE status = 'succeeded'").fetchone()[0]
            gpu_max = conn.execute("SELECT max(extract(epoch FROM finished_at - started_at)) FROM config_runs "
                                   "WHERE status = 'succeeded'").fetchone()[0]
            queued_end = conn.execute("SELECT count(*) FROM config_runs WHERE status = 'queued'").fetchone()[0]
        yard = float(gpu_s) if gpu_s is not None else None
        report.update({
            "tenants": phases, "config_run_s_median": round(yard, 1) if yard else None,
            "config_run_s_max": round(float(gpu_max), 1) if gpu_max is not None else None,
            "broker_excess_max": max(excess, default=None), "broker_samples": len(excess),
            "noisy_queued_at_end": queued_end, "noisy_requests": counts, "results": results_check(pg.url("fair")),
        })
        targets = {}
        for tenant in QUIET:
            quiet, loaded = phases[tenant]["quiet"], phases[tenant]["backlog"]
            # "starts within one config-run's time": no config-run of the noisy tenant's started
            # between its queuing and its start (it waited for the one holding the GPU, no more)
            targets[f"{tenant}_starts_within_one_config_run"] = (
                loaded["noisy_ahead_max"] is not None and loaded["noisy_ahead_max"] == 0 and not loaded["unstarted"])
            targets[f"{tenant}_finishes_within_2x_quiet"] = (
                loaded["finish_s_median"] is not None and quiet["finish_s_median"] is not None
                and loaded["finish_s_median"] <= 2 * quiet["finish_s_median"])
        targets["broker_messages_within_queued_plus_workers"] = (report["broker_excess_max"] is not None
                                                                 and report["broker_excess_max"] <= 0)
        targets["no_lost_or_duplicated"] = report["results"]["lost"] == 0 and report["results"]["duplicated"] == 0
        report["targets"] = targets
    finally:
        stop.set()
        stack.stop_all()
        redis.close()
        pg.close()
    text = json.dumps(report, indent=2)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
