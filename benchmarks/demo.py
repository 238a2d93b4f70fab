"""How long `canary demo` takes (README quick start; the goal, docs/benchmarks.md: at most 2 minutes on an idle
2-core machine), through a pipe as `make demo` runs it: every config of the demo (15) on the
embedded default. Cold: a fresh HOME, so the AWQ search's on-disk cache is empty and the search
runs; warm: the same HOME again, the cache filled by the cold run (what every run after a user's
first one sees). Each run writes a fresh database. Also printed: each config-run's seconds from
the database (the slowest first), the thread count and the load average. One JSON object.

    python benchmarks/demo.py [--repeats 1] [--samples 100]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOAL_S = 120


def config_run_seconds(db: Path) -> dict[str, float]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT c.name, r.started_at, r.finished_at FROM config_runs r JOIN optimization_configs c "
                            "ON c.id = r.config_id").fetchall()
    took = {name: (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds() for name, a, b in rows
            if a and b}
    return {name: round(s, 1) for name, s in sorted(took.items(), key=lambda kv: -kv[1])}


def one(home: Path, work: Path, samples: int) -> dict:
    db = work / f"demo-{time.monotonic_ns()}.db"
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    env.pop("CANARY_AWQ_CACHE", None)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "app.cli", "demo", "--json", "--samples", str(samples),
                        "--database-url", f"sqlite:///{db}"], cwd=ROOT, env=env, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=3600, check=False)
    took = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"canary demo failed (exit {r.returncode}): {r.stderr[-2000:]}")
    summary = json.loads(r.stdout)
    return {"seconds": round(took, 1), "configs": len(summary["configs"]), "status": summary["status"],
            "config_run_s": config_run_seconds(db)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1, help="cold + warm pairs, each in a fresh HOME (default 1)")
    p.add_argument("--samples", type=int, default=100, help="documents per config, as `make demo` (default 100)")
    args = p.parse_args()
    cold, warm = [], []
    with tempfile.TemporaryDirectory(prefix="canary-demo-bench-") as tmp:
        for i in range(args.repeats):
            home = Path(tmp) / f"home-{i}"
            home.mkdir()
            cold.append(one(home, Path(tmp), args.samples))
            warm.append(one(home, Path(tmp), args.samples))
    load = os.getloadavg()
    print(json.dumps({"benchmark": "demo", "samples": args.samples, "repeats": args.repeats,
                      "configs": cold[0]["configs"], "cold_s": [r["seconds"] for r in cold],
                      "warm_s": [r["seconds"] for r in warm], "status": warm[0]["status"],
                      "cold_config_run_s": cold[0]["config_run_s"], "warm_config_run_s": warm[0]["config_run_s"],
                      "cpu_count": os.cpu_count(), "load_avg_1m": round(load[0], 2), "goal_s": GOAL_S}, indent=1))


if __name__ == "__main__":
    main()
