"""Time to a gate verdict on the embedded default: `canary serve` (SQLite, in-process tasks) on a
fresh database, the docs' smoke suite (12 documents of the held-out corpus, perplexity, window
128), then `canary gate --candidate int8` against the fp16 baseline, as a CI job calls it.

Cold: from starting the server to the verdict (server start, model loads, both config-runs,
aggregation). Warm: a second gate with a new Idempotency-Key on the same server; its baseline
takes the cold gate's results (nothing that decides them changed: CANARY_GATE_REUSE_BASELINE,
on by default; `warm_baseline_reused` says whether it did, and `warm_config_run_s` what each
config-run of the warm gate took). Each repeat
starts a fresh server on a fresh database. Also printed: where the cold gate's time went (server
start, each config-run from the database's timestamps, the rest), the server's peak RSS, and the
thread count and load average. One JSON object. Goal (docs/benchmarks.md): cold <= 8 s, warm <= 3 s on an
idle 2-core machine.

    python benchmarks/gate.py [--repeats 3] [--samples 12]
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from benchmarks._common import parser, spread

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def seconds_between(a: str, b: str) -> float:
    return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()


def config_run_seconds(db: Path, run_id: int) -> dict[str, float]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT c.name, r.started_at, r.finished_at FROM config_runs r JOIN optimization_configs c "
                            "ON c.id = r.config_id WHERE r.run_id = ?", (run_id,)).fetchall()
    return {name: round(seconds_between(a, b), 2) for name, a, b in rows if a and b}


def gate(api: str, key: str, env: dict) -> tuple[float, dict]:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "app.cli", "gate", "--api", api, "--project", "bench", "--candidate", "int8",
                        "--suite", "smoke", "--idempotency-key", key, "--json", "--heartbeat", "60"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    took = time.perf_counter() - t
    if r.returncode not in (0, 1):
        raise SystemExit(f"gate failed (exit {r.returncode}): {r.stderr[-2000:]}")
    return took, json.loads(r.stdout)


def one_round(samples: int, work: Path, threads: int | None) -> dict:
    db = work / "canary.db"
    env = {**os.environ, "CANARY_DATABASE_URL": f"sqlite:///{db}", "CANARY_EXECUTION": "inline"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op threads in the server
    env.pop("CANARY_BROKER_URL", None)
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port)], cwd=ROOT, env=env,
                              stdout=open(work / "serve.log", "w"), stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=api, timeout=30) as http:
            while True:
                try:
                    if http.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if server.poll() is not None:
                    raise SystemExit(f"canary serve exited: {(work / 'serve.log').read_text()[-2000:]}")
                time.sleep(0.05)
            up = time.perf_counter() - start
            p = "/api/v1/projects/bench"
            setup = [("/api/v1/projects", {"name": "bench"}), (f"{p}/models", {"name": "tiny", "path": "builtin:pydoc-target"}),
                     (f"{p}/configs", {"name": "fp16", "model": "tiny", "baseline": True, "engine": "reference",
                                       "weights": "fp16"}),
                     (f"{p}/configs", {"name": "int8", "model": "tiny", "engine": "reference", "weights": "int8"}),
                     (f"{p}/suites", {"name": "smoke", "corpus": "builtin:pydoc-heldout", "samples": samples, "seed": 0,
                                      "scorers": ["perplexity"], "perplexity": {"window": 128}})]
            for path, body in setup:
                r = http.post(path, json=body)
                if r.status_code != 201:
                    raise SystemExit(f"POST {path}: {r.status_code} {r.text}")
        gate_cold, first = gate(api, "cold", env)
        cold = time.perf_counter() - start
        warm, second = gate(api, "warm", env)
        if first["verdict"] != second["verdict"]:
            raise SystemExit(f"the two gates disagree: {first['verdict']} vs {second['verdict']}")
        parts = config_run_seconds(db, first["run_id"])
        warm_parts = config_run_seconds(db, second["run_id"])
        with sqlite3.connect(db) as conn:  # the warm gate's baseline: reused from the cold gate's run, or computed
            reused = conn.execute("SELECT json_extract(r.figures, '$.reused_from_run') FROM config_runs r "
                                  "JOIN optimization_configs c ON c.id = r.config_id WHERE r.run_id = ? "
                                  "AND c.is_baseline", (second["run_id"],)).fetchone()[0]
        return {"cold": cold, "warm": warm, "server_up": up, "gate_call_cold": gate_cold, "config_runs": parts,
                "warm_config_runs": warm_parts, "warm_baseline_reused_from": reused,
                "verdict": first["verdict"], "ppl_ratio": next(c["estimate"] for c in first["comparisons"]
                                                               if c["metric"] == "ppl_ratio"),
                "peak_rss_mb": peak_rss_mb(server.pid)}
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--samples", type=int, default=12, help="documents in the smoke suite (default 12)")
    args = p.parse_args()
    if args.repeats < 3:
        raise SystemExit("--repeats must be at least 3 (a median and a spread need three)")
    rounds = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            rounds.append(one_round(args.samples, Path(tmp), args.threads))
    ratios = {r["ppl_ratio"] for r in rounds}
    if max(ratios) - min(ratios) > 1e-9:
        print(f"ppl_ratio differs between repeats: {sorted(ratios)}", file=sys.stderr)
        sys.exit(1)
    load = os.getloadavg()
    print(json.dumps({
        "benchmark": "gate time-to-verdict (embedded default, smoke suite, int8 vs fp16)",
        "samples": args.samples, "repeats": args.repeats, "cpu_count": os.cpu_count(), "load_avg_1m": round(load[0], 2),
        "cold_s": spread([r["cold"] for r in rounds], digits=2), "warm_s": spread([r["warm"] for r in rounds], digits=2),
        "server_up_s": spread([r["server_up"] for r in rounds], digits=2),
        "config_run_s": {name: spread([r["config_runs"][name] for r in rounds], digits=2) for name in rounds[0]["config_runs"]},
        "warm_config_run_s": {name: spread([r["warm_config_runs"][name] for r in rounds], digits=2)
                              for name in rounds[0]["warm_config_runs"]},
        # CANARY_GATE_REUSE_BASELINE: the warm gate's baseline takes the cold gate's rows (workers/baseline_reuse.py)
        "warm_baseline_reused": all(r["warm_baseline_reused_from"] is not None for r in rounds),
        "peak_rss_mb": max((r["peak_rss_mb"] or 0) for r in rounds), "verdict": rounds[0]["verdict"],
        "ppl_ratio": rounds[0]["ppl_ratio"], "goal": {"cold_s": 8, "warm_s": 3},
    }, indent=1))


if __name__ == "__main__":
    main()
