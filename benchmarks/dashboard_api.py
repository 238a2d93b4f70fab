"""p50 / p95 / p99 latency of the API calls behind the dashboard's pages under 16 concurrent
clients, with about 1 million sample results in Postgres (goal: p99 < 300 ms). Seeds a scratch
database (COPY), serves the API as its image does (`canary serve`, one process) on loopback, and
has each client (a process of its own, or a thread with --client-mode thread) send its share of
the requests over the views in a shuffled order over real HTTP; then drops the database. Percentiles interpolate between order statistics. One JSON object.

    python benchmarks/dashboard_api.py [--runs 400] [--samples 420] [--clients 16] [--requests 2016]
    (CANARY_BENCH_PG = admin URL of the server, default postgresql://postgres@127.0.0.1:5432/postgres)
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import psycopg  # noqa: E402

CONFIGS = ["fp16", "int8", "awq-int4", "kv-fp8", "kivi-2", "turbo-3"]
NOW = "2026-01-01 00:00:00+00"
METRICS = ("ppl_ratio", "ttft_ms", "exact_match", "top1_agreement")


def copy(cur, table: str, cols: list[str], rows) -> None:
    buf = io.StringIO()
    for r in rows:
        buf.write("\t".join("\\N" if v is None else str(v) for v in r) + "\n")
    buf.seek(0)
    with cur.copy(f"COPY {table} ({', '.join(cols)}) FROM STDIN") as cp:
        cp.write(buf.read())


def seed(url: str, n_runs: int, n_samples: int) -> int:
    rng = random.Random(0)
    with psycopg.connect(url, autocommit=False) as conn, conn.cursor() as cur:
        cur.execute("INSERT INTO projects (name, created_at) VALUES ('bench', now()) RETURNING id")
        pid = cur.fetchone()[0]
        cur.execute("INSERT INTO models (project_id, name, path, created_at) VALUES (%s, 'm', 'builtin:pydoc-target', now()) RETURNING id", (pid,))
        mid = cur.fetchone()[0]
        cids = []
        for i, name in enumerate(CONFIGS):
            cur.execute("INSERT INTO optimization_configs (project_id, model_id, name, spec, is_baseline, created_at) "
                        "VALUES (%s, %s, %s, %s, %s, now()) RETURNING id", (pid, mid, name, json.dumps({"engine": "reference"}), i == 0))
            cids.append(cur.fetchone()[0])
        cur.execute("INSERT INTO suites (project_id, name, spec, version, n_documents, created_at) "
                    "VALUES (%s, 's', %s, 'v1', %s, now()) RETURNING id", (pid, json.dumps({"samples": n_samples}), n_samples))
        sid = cur.fetchone()[0]
        keys = [f"doc-{i}" for i in range(n_samples)]
        copy(cur, "suite_samples", ["suite_id", "version", "key", "position", "kind", "text"],
             ((sid, "v1", k, i, "document", "text of " + k) for i, k in enumerate(keys)))
        run_rows, cr_rows, comp_rows, sr = [], [], [], []
        cur.execute("SELECT nextval('runs_id_seq')")
        first = cur.fetchone()[0]
        for r in range(n_runs):
            rid = first + r
            run_rows.append((rid, pid, sid, "v1", mid, cids[0], "schedule", "done", "pass", n_samples, 0, json.dumps(keys[:3])))
        cur.executemany("INSERT INTO runs (id, project_id, suite_id, suite_version, model_id, baseline_config_id, trigger, status, verdict, "
                        "n_samples, seed, sample_keys, created_at, finished_at) VALUES "
                        "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, now(), now())", [x[:12] for x in run_rows])
        cur.execute("SELECT setval('runs_id_seq', %s)", (first + n_runs,))
        figs = json.dumps({"token_ppl": 110.7, "ttft_ms_p50": 12.0, "ttft_ms_p99": 30.0, "tokens_per_second": 550.0,
                           "kv_bytes_per_token": 1536, "weight_bytes": 11_000_000})
        for r in range(n_runs):
            rid = first + r
            for cid in cids:
                cr_rows.append((rid, cid, "succeeded", 1, figs, "now() - interval '1 hour'"))
                if cid != cids[0]:
                    for m in METRICS:
                        e = 1 + rng.random() * 0.02
                        comp_rows.append((rid, cid, m, e, e - 0.005, e + 0.005, n_samples, "ok", "CI high < warn"))
                for k in keys:
                    v = 2.0 + rng.random()
                    sr.append((rid, cid, k, "nll", v, '{"n_tokens": 200, "n_words": 40, "n_bytes": 900}', NOW))
                    if len(sr) >= 200_000:
                        copy(cur, "sample_results", ["run_id", "config_id", "sample_key", "metric", "value", "extra", "created_at"], sr)
                        sr.clear()
        copy(cur, "sample_results", ["run_id", "config_id", "sample_key", "metric", "value", "extra", "created_at"], sr)
        cur.executemany("INSERT INTO config_runs (run_id, config_id, status, attempt, figures, progress_done, progress_total, "
                        "started_at, finished_at, created_at) VALUES (%s, %s, %s, %s, %s, 0, 0, now(), now(), now())",
                        [x[:5] for x in cr_rows])
        cur.executemany("INSERT INTO comparisons (run_id, config_id, metric, estimate, ci_low, ci_high, n, verdict, rule, created_at) "
                        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, now())", comp_rows)
        cur.execute("SELECT count(*) FROM sample_results")
        n = cur.fetchone()[0]
        conn.commit()
        cur.execute("ANALYZE")
    return n


def percentiles(ms: list[float]) -> dict[str, float]:
    """p50 / p95 / p99 by linear interpolation between order statistics (numpy's default)."""
    xs = sorted(ms)

    def q(p: float) -> float:
        pos = (len(xs) - 1) * p
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 1)

    return {"p50_ms": q(0.50), "p95_ms": q(0.95), "p99_ms": q(0.99), "n": len(xs)}


def client_process(base: str, calls: dict, requests: int, seed: int, ready, go, results) -> None:
    """A client in a process of its own, started before the clock (`go`): its timings and errors
    back through `results`."""
    ready.release()
    go.wait()
    out: dict[str, list[float]] = {label: [] for label in calls}
    errors: list[str] = []
    client(base, calls, requests, seed, out, errors)
    results.put((out, errors))


def client(base: str, calls: dict, requests: int, seed: int, out: dict[str, list[float]], errors: list[str]) -> None:
    """One dashboard user: `requests` calls over the views in a shuffled order, one connection."""
    rng = random.Random(seed)
    labels = list(calls)
    with httpx.Client(base_url=base, timeout=60) as http:
        for i in range(requests):
            if i % len(labels) == 0:
                rng.shuffle(labels)
            label = labels[i % len(labels)]
            path, params = calls[label]
            t = time.perf_counter()
            r = http.get(path, params=params)
            took = (time.perf_counter() - t) * 1000
            if r.status_code != 200:
                errors.append(f"{path}: {r.status_code}")
            out[label].append(took)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--samples", type=int, default=420)
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    ap.add_argument("--requests", type=int, default=2016, help="requests in all, split over the clients (default 2016)")
    ap.add_argument("--server-workers", type=int, default=1, help="API processes (`canary serve --workers`, default 1)")
    ap.add_argument("--client-mode", choices=("process", "thread"), default="process",
                    help="each client a process of its own (default), or a thread of this process: 16 client threads "
                         "share one interpreter lock, so a reply can wait for it before its clock is read")
    args = ap.parse_args()
    admin = os.environ.get("CANARY_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
    name = f"canary_bench_{uuid.uuid4().hex[:8]}"
    base = admin.rpartition("/")[0]
    url = f"{base}/{name}"
    with psycopg.connect(admin, autocommit=True) as a:
        a.execute(f'CREATE DATABASE "{name}"')
    server = None
    try:
        from app.db import upgrade

        upgrade(url)
        t0 = time.perf_counter()
        n = seed(url, args.runs, args.samples)
        seed_s = time.perf_counter() - t0
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # the API as its image runs it: one `canary serve` process (uvicorn), in a process of its own
        env = {**os.environ, "CANARY_DATABASE_URL": url, "CANARY_EXECUTION": "celery",  # only reads are timed
               "CANARY_RATE_LIMIT_PER_MINUTE": "0",  # time the queries, not the limiter
               "CANARY_BROKER_URL": os.environ.get("CANARY_BROKER_URL", "redis://127.0.0.1:6379/14")}
        server = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--no-upgrade-db",
                                   "--workers", str(args.server_workers)],
                                  cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        api = f"http://127.0.0.1:{port}/api/v1/projects/bench"
        deadline = time.time() + 60
        while True:
            try:
                last = httpx.get(f"{api}/runs", params={"limit": 1}, timeout=10).json()[0]["run_id"]
                break
            except (httpx.TransportError, ValueError):
                if time.time() > deadline or server.poll() is not None:
                    raise SystemExit("canary serve did not come up") from None
                time.sleep(0.2)
        calls = {
            "overview": ("/overview", {}),
            "compare: runs list": ("/runs", {"limit": 100}),
            "compare: run summary": (f"/runs/{last}", {}),
            "trends: ppl_ratio": ("/trends", {"metric": "ppl_ratio"}),
            "alerts": ("/alerts", {}),
            "alerts: silences": ("/silences", {}),
            "run detail: worst samples": (f"/runs/{last}/worst", {"config": "kivi-2", "metric": "nll", "limit": 20}),
            "run detail: sample page": (f"/runs/{last}/samples", {"config": "kivi-2", "limit": 100}),
            "gates": ("/gates", {}),
        }
        for path, params in calls.values():  # warm once; every view answers
            assert httpx.get(api + path, params=params, timeout=60).status_code == 200, path
        per_client = -(-args.requests // args.clients)
        times: dict[str, list[float]] = {label: [] for label in calls}
        errors: list[str] = []
        if args.client_mode == "thread":
            clients = [threading.Thread(target=client, args=(api, calls, per_client, i, times, errors))
                       for i in range(args.clients)]
        else:  # each client its own interpreter: no client waits on another's GIL to read its clock
            ctx = multiprocessing.get_context("spawn")
            results, ready, go = ctx.Queue(), ctx.Semaphore(0), ctx.Event()
            clients = [ctx.Process(target=client_process, args=(api, calls, per_client, i, ready, go, results))
                       for i in range(args.clients)]
            for c in clients:
                c.start()
            for _ in clients:
                ready.acquire(timeout=120)
        t0 = time.perf_counter()
        if args.client_mode == "thread":
            for c in clients:
                c.start()
        else:
            go.set()
            for _ in clients:
                out, errs = results.get(timeout=600)
                errors += errs
                for label, xs in out.items():
                    times[label] += xs
        for c in clients:
            c.join()
        wall = time.perf_counter() - t0
        every = [x for xs in times.values() for x in xs]
        overall = percentiles(every)
        load = os.getloadavg()
        print(json.dumps({"benchmark": "dashboard_api", "sample_results": n, "runs": args.runs, "configs": len(CONFIGS),
                          "seed_seconds": round(seed_s, 1), "server_workers": args.server_workers, "clients": args.clients,
                          "client_mode": args.client_mode, "requests": len(every),
                          "errors": len(errors), "requests_per_s": round(len(every) / wall, 1),
                          "cpu_count": os.cpu_count(), "load_avg_1m": round(load[0], 2),
                          "overall": overall, "calls": {label: percentiles(xs) for label, xs in times.items()},
                          "goal_p99_ms": 300, "meets_goal": overall["p99_ms"] < 300 and not errors}, indent=1))
        if errors:
            print(f"{len(errors)} requests failed, e.g. {errors[:3]}", file=sys.stderr)
            sys.exit(1)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        with psycopg.connect(admin, autocommit=True) as a:
            a.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
