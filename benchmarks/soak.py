"""Soak under load (security round 3): three tenants on the real stack — their own Postgres and
Redis, two API replicas, a GPU worker, a CPU worker, the beat (with the notifier) and
engine-serve — first the legitimate tenant alone (the quiet phase), then all three with faults on
a timer:

    legit    a gate of int8 against fp16 every --gate-every seconds (time to verdict), and an API
             read every second (latency)
    noisy    floods runs until the queue cap answers 429, uploads large suites, and has an alert
             channel whose receiver drips one byte every 5 s
    hostile  trickles request bodies without a key into every API replica, sends bogus keys, and
             abandons streaming engine-serve requests
    faults   kill -9 of the GPU worker, a Redis restart (empty: no persistence) and a Postgres
             restart, in turn every --fault-every seconds

It prints (and writes to --out) the legitimate tenant's gate time to verdict and API p50/p99 in
both phases, every run's lost and duplicated per-sample results (after the queues drain), and
the peak RSS of every service process. Targets (issue): gate within 2x its quiet time, API p99
below 300 ms during the attack, 0 lost, 0 duplicated, no process above 1.5 GB.

    python benchmarks/soak.py --minutes 20 --quiet-minutes 3
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.faults.conftest import PgServer, RedisServer, _pg_bindir  # noqa: E402
from tests.loopback import free_port, wait_http  # noqa: E402

TENANTS = ("legit", "noisy", "hostile")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class Stack:
    """The service's processes, each in its own process group, with their logs under `dir`."""

    def __init__(self, env: dict[str, str], workdir: str):
        self.env, self.dir = env, workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.peak_rss: dict[str, int] = {}

    def start(self, name: str, cmd: list[str], ready: str | None = None) -> subprocess.Popen:
        logfile = os.path.join(self.dir, f"{name}.log")
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**self.env, "PGAPPNAME": name}, stdout=open(logfile, "a"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        if ready is not None:
            deadline = time.monotonic() + 180
            while ready not in pathlib.Path(logfile).read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start; see {logfile}")
                time.sleep(0.3)
        return proc

    def worker(self, name: str, queues: str, *extra: str) -> subprocess.Popen:
        return self.start(name, [sys.executable, "-m", "app.cli", "worker", "--queues", queues, "--name",
                                 f"{name}-{uuid.uuid4().hex[:4]}@%h", *extra], ready="ready.")

    def kill(self, name: str, sig: int = 9) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def sample_rss(self) -> None:
        """Each service's largest single process, by its process group."""
        groups = {proc.pid: name for name, proc in self.procs.items()}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
                pgid = int(stat.rsplit(")", 1)[1].split()[2])
                if pgid not in groups:
                    continue
                rss_kb = next(int(line.split()[1]) for line in pathlib.Path(f"/proc/{pid}/status").read_text()
                              .splitlines() if line.startswith("VmRSS:"))
            except (OSError, StopIteration, ValueError, IndexError):
                continue
            name = groups[pgid]
            self.peak_rss[name] = max(self.peak_rss.get(name, 0), rss_kb * 1024)

    def stop_all(self) -> None:
        for name in list(self.procs):
            try:
                self.kill(name, 15)
            except Exception:  # noqa: BLE001 - best effort at the end
                try:
                    self.kill(name, 9)
                except Exception:  # noqa: BLE001
                    pass


def drip_receiver() -> int:
    """A webhook receiver that sends its headers, then one byte every 5 s, for ever."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)

    def handle(conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n")
            while True:
                conn.sendall(b".")
                time.sleep(5)
        except OSError:
            conn.close()

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


class Phase:
    """What the legitimate tenant measured in one phase."""

    def __init__(self, name: str):
        self.name = name
        self.gates: list[float] = []
        self.gate_verdicts: list[str] = []
        self.gate_errors: list[str] = []
        self.api_ms: list[float] = []
        self.api_errors = 0

    def summary(self) -> dict:
        return {"gates": len(self.gates), "gate_s_median": pct(self.gates, 50), "gate_s_max": max(self.gates, default=None),
                "gate_s_all": [round(g, 1) for g in self.gates], "gate_verdicts": self.gate_verdicts,
                "gate_errors": self.gate_errors[:5], "api_requests": len(self.api_ms),
                "api_ms_p50": pct(self.api_ms, 50), "api_ms_p99": pct(self.api_ms, 99), "api_errors": self.api_errors}


def legit_loops(apis: list[str], key: str, phase_of, stop: threading.Event, gate_every: float) -> list[threading.Thread]:
    headers = {"Authorization": f"Bearer {key}"}

    def reads() -> None:
        with httpx.Client(headers=headers, timeout=30) as http:
            i = 0
            while not stop.is_set():
                base = apis[i % len(apis)]
                i += 1
                t = time.perf_counter()
                try:
                    ok = http.get(f"{base}/api/v1/projects/legit/runs", params={"limit": 5}).status_code == 200
                except httpx.HTTPError:
                    ok = False
                ms = (time.perf_counter() - t) * 1000
                phase = phase_of()
                phase.api_ms.append(ms)
                phase.api_errors += not ok
                stop.wait(1.0)

    def gates() -> None:
        with httpx.Client(headers=headers, timeout=30) as http:
            while not stop.is_set():
                phase, t0 = phase_of(), time.monotonic()
                base = random.choice(apis)
                try:
                    r = http.post(f"{base}/api/v1/projects/legit/gates", json={"candidate": "int8", "suite": "smoke"},
                                  headers={"Idempotency-Key": f"soak-{uuid.uuid4().hex}"})
                    r.raise_for_status()
                    gate = r.json()
                    while gate["verdict"] is None and not stop.is_set():
                        time.sleep(1)
                        try:
                            r = http.get(f"{random.choice(apis)}/api/v1/projects/legit/gates/{gate['gate_id']}")
                        except httpx.HTTPError:
                            continue  # a restart in progress: ask again
                        if r.status_code == 200:
                            gate = r.json()
                        # else a 503 while Postgres restarts: ask again
                    if gate["verdict"] is not None:
                        phase.gates.append(time.monotonic() - t0)
                        phase.gate_verdicts.append(gate["verdict"])
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    phase.gate_errors.append(f"{type(e).__name__}: {str(e)[:120]}")
                stop.wait(max(0.0, gate_every - (time.monotonic() - t0)))

    return [threading.Thread(target=f, daemon=True) for f in (reads, gates)]


def noisy_loops(apis: list[str], key: str, stop: threading.Event, counts: dict) -> list[threading.Thread]:
    headers = {"Authorization": f"Bearer {key}"}

    def flood() -> None:
        with httpx.Client(headers=headers, timeout=60) as http:
            while not stop.is_set():
                try:
                    r = http.post(f"{random.choice(apis)}/api/v1/projects/noisy/runs", json={"suite": "smoke"})
                    counts[f"noisy_runs_{r.status_code}"] = counts.get(f"noisy_runs_{r.status_code}", 0) + 1
                    stop.wait(2.0 if r.status_code == 429 else 0.2)
                except httpx.HTTPError:
                    stop.wait(1.0)

    def uploads() -> None:
        docs = [{"id": f"d{i}", "text": ("def f(): return os.path.join(a, b)  # " * 200)[:8000]} for i in range(2500)]
        with httpx.Client(headers=headers, timeout=120) as http:
            while not stop.is_set():
                try:
                    r = http.post(f"{random.choice(apis)}/api/v1/projects/noisy/suites",
                                  json={"name": "big", "documents": docs, "samples": 8, "scorers": ["perplexity"]})
                    counts[f"noisy_upload_{r.status_code}"] = counts.get(f"noisy_upload_{r.status_code}", 0) + 1
                except httpx.HTTPError:
                    pass
                stop.wait(20)

    return [threading.Thread(target=f, daemon=True) for f in (flood, uploads, uploads)]


def hostile_loops(apis: list[str], engine: str, stop: threading.Event, counts: dict) -> list[threading.Thread]:
    def slow_body(base: str) -> None:
        host, port = base.removeprefix("http://").split(":")
        while not stop.is_set():
            try:
                s = socket.create_connection((host, int(port)), timeout=30)
                s.sendall(b"POST /api/v1/projects/legit/models HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n")
                for _ in range(400):
                    if stop.is_set():
                        break
                    s.sendall(b"{")
                    time.sleep(5)
                s.close()
            except OSError:
                counts["hostile_slow_closed"] = counts.get("hostile_slow_closed", 0) + 1
                stop.wait(1)

    def bogus() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                try:
                    r = http.get(f"{random.choice(apis)}/api/v1/projects/legit/runs",
                                 headers={"Authorization": f"Bearer cnry_{uuid.uuid4().hex}"})
                    counts[f"hostile_bogus_{r.status_code}"] = counts.get(f"hostile_bogus_{r.status_code}", 0) + 1
                except httpx.HTTPError:
                    pass
                stop.wait(0.2)

    def abandon() -> None:
        while not stop.is_set():
            try:
                with httpx.stream("POST", f"{engine}/v1/completions", timeout=10,
                                  json={"model": "pydoc-target", "prompt": ["def f("] * 8, "max_tokens": 400,
                                        "stream": True}) as r:
                    for _ in r.iter_bytes():
                        break  # first bytes, then gone
                counts["hostile_abandoned"] = counts.get("hostile_abandoned", 0) + 1
            except httpx.HTTPError:
                counts["hostile_abandon_errors"] = counts.get("hostile_abandon_errors", 0) + 1
            stop.wait(5)

    threads = [threading.Thread(target=slow_body, args=(base,), daemon=True) for base in apis for _ in range(10)]
    return threads + [threading.Thread(target=f, daemon=True) for f in (bogus, abandon)]


def results_check(db_url: str) -> dict:
    """Per finished run and succeeded config-run: the per-document nll rows against the samples
    drawn (lost) and rows beyond one per key (duplicated)."""
    import psycopg

    with psycopg.connect(db_url) as conn:
        runs = conn.execute("SELECT r.id, p.name, r.status, json_array_length(r.sample_keys::json) FROM runs r "
                            "JOIN projects p ON p.id = r.project_id").fetchall()
        counts = {(run_id, config_id): (rows, distinct) for run_id, config_id, rows, distinct in conn.execute(
            "SELECT run_id, config_id, count(*), count(DISTINCT sample_key) FROM sample_results WHERE metric = 'nll' "
            "GROUP BY 1, 2").fetchall()}
        succeeded = conn.execute("SELECT run_id, config_id FROM config_runs WHERE status = 'succeeded'").fetchall()
        statuses = dict(conn.execute("SELECT status, count(*) FROM runs GROUP BY 1").fetchall())
    drawn = {run_id: n for run_id, _, _, n in runs}
    lost = dup = 0
    for run_id, config_id in succeeded:
        rows, distinct = counts.get((run_id, config_id), (0, 0))
        lost += max(0, drawn[run_id] - distinct)
        dup += rows - distinct
    return {"runs_by_status": statuses, "config_runs_succeeded": len(succeeded), "lost": lost, "duplicated": dup}


def service_stores(db: str, **settings: str) -> tuple[PgServer, RedisServer, dict[str, str]]:
    """A Postgres and a Redis of the benchmark's own, database `db` made and migrated, and the
    environment that points the service's processes at them (Celery execution, loopback URLs
    allowed, no escalation), `settings` on top."""
    import psycopg

    pg = PgServer(_pg_bindir())
    pg.start()
    redis = RedisServer(shutil.which("redis-server") or "redis-server")
    redis.start()
    with psycopg.connect(pg.url(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db}"')
    env = {**os.environ, "CANARY_DATABASE_URL": pg.url(db), "CANARY_BROKER_URL": redis.url, "CANARY_EXECUTION": "celery",
           "CANARY_ESCALATION": "false", "CANARY_URL_ALLOWLIST": "127.0.0.1:*", "PYTHONUNBUFFERED": "1", **settings}
    subprocess.run([sys.executable, "-m", "app.cli", "db", "upgrade"], cwd=ROOT, env=env, check=True, capture_output=True)
    return pg, redis, env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="the attack phase")
    ap.add_argument("--quiet-minutes", type=float, default=3.0, help="the legitimate tenant alone, first")
    ap.add_argument("--gate-every", type=float, default=60.0)
    ap.add_argument("--fault-every", type=float, default=240.0)
    ap.add_argument("--drain-minutes", type=float, default=10.0, help="at most, for the queues to empty at the end")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/soak.json"))
    args = ap.parse_args()

    import psycopg

    workdir = __import__("tempfile").mkdtemp(prefix="canary-soak-")
    pg, redis, env = service_stores("soak", CANARY_REQUIRE_API_KEYS="true", CANARY_LEASE_SECONDS="30",
                                    CANARY_REQUEUE_AFTER_SECONDS="5", CANARY_RECONCILE_SECONDS="5",
                                    CANARY_DB_RETRY_SECONDS="60", CANARY_BODY_TIMEOUT_SECONDS="10",
                                    CANARY_NOTIFY_TIMEOUT_SECONDS="5", CANARY_MAX_QUEUED_CONFIG_RUNS_PER_PROJECT="20")
    stack = Stack(env, workdir)
    stop, attack_stop = threading.Event(), threading.Event()
    counts: dict[str, int] = {}
    report: dict = {"args": vars(args), "workdir": "(temporary)"}
    try:
        apis = []
        for i in (1, 2):
            port = free_port()
            stack.start(f"api-{i}", [sys.executable, "-m", "uvicorn", "app.api.main:app", "--host", "127.0.0.1",
                                     "--port", str(port)])
            apis.append(f"http://127.0.0.1:{port}")
            wait_http(f"{apis[-1]}/healthz", stack.procs[f"api-{i}"], os.path.join(workdir, f"api-{i}.log"))
        stack.worker("gpu", "gpu", "--concurrency", "1")
        stack.worker("cpu", "cpu,default", "--concurrency", "1")
        stack.worker("beat", "default,notify", "--concurrency", "2", "--beat")
        engine_port = free_port()
        stack.start("engine-serve", [sys.executable, "-m", "app.cli", "engine-serve", "--port", str(engine_port),
                                     "--served-model-name", "pydoc-target"])
        engine = f"http://127.0.0.1:{engine_port}"
        wait_http(f"{engine}/health", stack.procs["engine-serve"], os.path.join(workdir, "engine-serve.log"))
        keys = {}
        for tenant in TENANTS:
            out = subprocess.run([sys.executable, "-m", "app.cli", "keys", "create", "--project", tenant], cwd=ROOT,
                                 env=env, check=True, capture_output=True, text=True).stdout
            keys[tenant] = out.strip().splitlines()[-1]
        drip = drip_receiver()
        for tenant in TENANTS:
            http = httpx.Client(base_url=f"{apis[0]}/api/v1/projects/{tenant}", timeout=60,
                                headers={"Authorization": f"Bearer {keys[tenant]}"})
            assert http.post("/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
            for body in ({"name": "fp16", "model": "tiny", "baseline": True},
                         {"name": "int8", "model": "tiny", "weights": "int8"},
                         *([{"name": "int2", "model": "tiny", "weights": "rtn-int2"}] if tenant == "noisy" else [])):
                assert http.post("/configs", json=body).status_code == 201, body
            assert http.post("/suites", json={"name": "smoke", "corpus": "builtin:pydoc-heldout", "samples": 16,
                                              "scorers": ["perplexity"], "perplexity": {"window": 64}}).status_code == 201
            if tenant == "noisy":  # int2 fires an alert at once, to a receiver that drips
                assert http.put("/alert-rules", json={"metric": "ppl_ratio", "warn": 1.001}).status_code == 200
                assert http.put("/channels", json={"name": "slow", "kind": "webhook",
                                                   "url": f"http://127.0.0.1:{drip}/hook"}).status_code == 200
        phases = {"quiet": Phase("quiet"), "attack": Phase("attack")}
        current = ["quiet"]

        def phase_of() -> Phase:
            return phases[current[0]]

        def rss() -> None:
            while not stop.is_set():
                stack.sample_rss()
                stop.wait(2)

        threading.Thread(target=rss, daemon=True).start()
        for t in legit_loops(apis, keys["legit"], phase_of, stop, args.gate_every):
            t.start()
        log(f"quiet phase: {args.quiet_minutes} min, the legitimate tenant alone")
        time.sleep(args.quiet_minutes * 60)
        current[0] = "attack"
        log(f"attack phase: {args.minutes} min, three tenants, a fault every {args.fault_every:.0f} s")
        for t in noisy_loops(apis, keys["noisy"], attack_stop, counts) + hostile_loops(apis, engine, attack_stop, counts):
            t.start()
        faults: list[str] = []
        end = time.monotonic() + args.minutes * 60
        kinds = ["kill -9 gpu worker", "restart redis", "restart postgres"]
        next_fault = time.monotonic() + args.fault_every / 2
        while time.monotonic() < end:
            if time.monotonic() >= next_fault:
                kind = kinds[len(faults) % len(kinds)]
                log(f"fault: {kind}")
                if kind.startswith("kill"):
                    stack.kill("gpu", 9)
                    time.sleep(3)
                    stack.worker("gpu", "gpu", "--concurrency", "1")
                elif kind == "restart redis":
                    redis.stop()
                    time.sleep(3)
                    redis.start()
                else:
                    pg.stop()
                    time.sleep(3)
                    pg.start()
                faults.append(kind)
                next_fault += args.fault_every
            time.sleep(1)
        attack_stop.set()
        stop.set()
        log("attack over: waiting for the queues to drain")
        busy = -1
        deadline = time.monotonic() + args.drain_minutes * 60
        while time.monotonic() < deadline:
            with psycopg.connect(pg.url("soak")) as conn:
                busy = conn.execute("SELECT count(*) FROM runs WHERE status IN ('queued', 'running', 'aggregating')"
                                    ).fetchone()[0]
            if not busy:
                break
            log(f"{busy} runs still queued or running")
            time.sleep(5)
        stack.sample_rss()
        quiet, attack = phases["quiet"].summary(), phases["attack"].summary()
        ratio = (attack["gate_s_median"] / quiet["gate_s_median"]
                 if attack["gate_s_median"] and quiet["gate_s_median"] else None)
        report.update({
            "quiet": quiet, "attack": attack, "gate_time_ratio_median": ratio, "faults": faults,
            "attackers": counts, "results": results_check(pg.url("soak")), "runs_unfinished_after_drain": busy,
            "peak_rss_mb": {name: round(v / 2**20) for name, v in sorted(stack.peak_rss.items())},
            "targets": {"gate_within_2x_quiet": ratio is not None and ratio <= 2,
                        "api_p99_below_300ms": attack["api_ms_p99"] is not None and attack["api_ms_p99"] < 300,
                        "no_process_above_1_5_GB": max(stack.peak_rss.values(), default=0) < 1.5 * 2**30}})
    finally:
        stop.set()
        attack_stop.set()
        stack.stop_all()
        redis.close()
        pg.close()
        shutil.rmtree(workdir, ignore_errors=True)
    report["targets"]["no_lost_or_duplicated"] = report["results"]["lost"] == 0 and report["results"]["duplicated"] == 0
    text = json.dumps(report, indent=2)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
