"""How long `canary demo` takes (README quick start; the goal, docs/benchmarks.md: at most 2 minutes on an idle
2-core machine), through a pipe as `make demo` runs it: every config of the demo (15) on the
embedded default. Cold: a fresh HOME, so the AWQ search's on-disk cache is empty and the search
runs; warm: the same HOME again, the cache filled by the cold run (what every run after a user's
first one sees). Each run writes a fresh database. Also printed: each config-run's seconds from
the database (the slowest first), where they went (the engines' loads and each producer, summed
over the configs), the demo's wall time in phases (start, config-runs, aggregation), the thread
count and the load average. One JSON object.

With --peer DIR (a checkout of another commit: `git worktree add DIR COMMIT`), that checkout's
demo is timed in the same run, alternating with this one's (ours cold, peer cold, ours warm, peer
warm, each side in its own HOME), and the two runs' quality comparisons are compared: the
perplexity ratios must agree to 1e-4 (thread counts move float sums by about 1e-6), and every
other comparison they share that differs is listed (a greedy answer can flip at a near-tie when
the thread count changes). Both sides run under the same CANARY_TOP_UP_BUDGET_S (--top-up-budget,
default 120 s, the demo's own default since it has one), so a peer from before the demo's budget
tops up by the same rule.

    python benchmarks/demo.py [--repeats 1] [--samples 100] [--peer DIR] [--top-up-budget 120]
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
from datetime import datetime, timezone
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


def seconds_by_part(db: Path) -> dict[str, float]:
    """Where the config-runs' time went (RunFigures.seconds), summed over the configs: the engines'
    loads ("engine", the AWQ search included) and each producer by its scorer, the largest first."""
    parts: dict[str, float] = {}
    with sqlite3.connect(db) as conn:
        for (figures,) in conn.execute("SELECT figures FROM config_runs WHERE figures IS NOT NULL"):
            for part, s in (json.loads(figures).get("seconds") or {}).items():
                parts[part] = parts.get(part, 0.0) + s
    return {part: round(s, 1) for part, s in sorted(parts.items(), key=lambda kv: -kv[1])}


def phases(db: Path, began: float, ended: float) -> dict[str, float]:
    """The demo's wall time in phases, from the database's timestamps (UTC): until the run exists
    (imports, the database's migrations, the config), until the first config-run starts (the
    worker processes' start), the config-runs, the aggregation, and what follows (the summary)."""
    def at(stamp: str) -> float:
        return datetime.fromisoformat(stamp).replace(tzinfo=timezone.utc).timestamp()

    with sqlite3.connect(db) as conn:
        created, finished = conn.execute("SELECT created_at, finished_at FROM runs ORDER BY id LIMIT 1").fetchone()
        first, last = conn.execute("SELECT min(started_at), max(finished_at) FROM config_runs").fetchone()
    marks = [began, at(created), at(first), at(last), at(finished), ended]
    names = ("to_run", "to_first_config_run", "config_runs", "aggregation", "after")
    return {name: round(b - a, 1) for name, a, b in zip(names, marks, marks[1:], strict=False)}


def one(home: Path, work: Path, samples: int, root: Path = ROOT, **extra_env: str) -> dict:
    db = work / f"demo-{time.monotonic_ns()}.db"
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "PYTHONPATH": str(root),
           **extra_env}
    env.pop("CANARY_AWQ_CACHE", None)
    t, began = time.perf_counter(), time.time()
    r = subprocess.run([sys.executable, "-m", "app.cli", "demo", "--json", "--samples", str(samples),
                        "--database-url", f"sqlite:///{db}"], cwd=root, env=env, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=3600, check=False)
    took, ended = time.perf_counter() - t, time.time()
    if r.returncode != 0:
        raise SystemExit(f"canary demo failed (exit {r.returncode}): {r.stderr[-2000:]}")
    summary = json.loads(r.stdout)
    return {"seconds": round(took, 1), "configs": len(summary["configs"]), "status": summary["status"],
            "config_run_s": config_run_seconds(db),
            "seconds_by_part": seconds_by_part(db), "phases": phases(db, began, ended), "comparisons": summary["comparisons"],
            "samples_drawn": summary.get("samples_drawn"), "summary": summary.get("summary")}


TIMING = {"ttft_ratio", "tpot_ratio", "ttft_ms", "kv_cache_usage"}


def agreement(ours: dict, peer: dict) -> dict:
    """The quality comparisons both runs made: perplexity ratios within 1e-4, the others listed where they differ."""
    a = {(c["config"], c["metric"]): c for c in ours["comparisons"] if c["metric"] not in TIMING}
    b = {(c["config"], c["metric"]): c for c in peer["comparisons"] if c["metric"] not in TIMING}
    shared = sorted(set(a) & set(b))
    ppl = [k for k in shared if k[1] == "ppl_ratio"]
    worst = max((abs(a[k]["estimate"] - b[k]["estimate"]) / abs(b[k]["estimate"]) for k in ppl), default=0.0)
    differ = [f"{k[0]} {k[1]}: {a[k]['estimate']:.6g} ({a[k]['verdict']}) vs {b[k]['estimate']:.6g} ({b[k]['verdict']})"
              for k in shared if (a[k]["estimate"], a[k]["verdict"]) != (b[k]["estimate"], b[k]["verdict"])]
    return {"shared": len(shared), "ppl_ratio_max_rel_diff": worst, "ppl_ratio_equal": worst <= 1e-4,
            "only_ours": sorted(f"{c} {m}" for c, m in set(a) - set(b)), "differ": differ}


def spread(xs: list[float]) -> dict:
    return {"runs": xs, "median": sorted(xs)[len(xs) // 2], "min": min(xs), "max": max(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1, help="cold + warm pairs, each in a fresh HOME (default 1)")
    p.add_argument("--samples", type=int, default=100, help="documents per config, as `make demo` (default 100)")
    p.add_argument("--peer", type=Path, help="a checkout of another commit, timed in the same run")
    p.add_argument("--top-up-budget", type=float, default=120.0,
                   help="CANARY_TOP_UP_BUDGET_S for both sides (default 120, the demo's own)")
    args = p.parse_args()
    budget = {"CANARY_TOP_UP_BUDGET_S": str(args.top_up_budget)}
    sides = {"ours": ROOT, **({"peer": args.peer.resolve()} if args.peer else {})}
    cold: dict[str, list] = {side: [] for side in sides}
    warm: dict[str, list] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="canary-demo-bench-") as tmp:
        for i in range(args.repeats):
            homes = {side: Path(tmp) / f"home-{side}-{i}" for side in sides}
            for home in homes.values():
                home.mkdir()
            for side, root in sides.items():
                cold[side].append(one(homes[side], Path(tmp), args.samples, root, **budget))
            for side, root in sides.items():
                warm[side].append(one(homes[side], Path(tmp), args.samples, root, **budget))
    load = os.getloadavg()
    out = {"benchmark": "demo", "samples": args.samples, "repeats": args.repeats, "configs": cold["ours"][0]["configs"],
           "cold_s": [r["seconds"] for r in cold["ours"]], "warm_s": [r["seconds"] for r in warm["ours"]],
           "status": warm["ours"][0]["status"], "cold_config_run_s": cold["ours"][0]["config_run_s"],
           "warm_config_run_s": warm["ours"][0]["config_run_s"],
           "cold_seconds_by_part": cold["ours"][0]["seconds_by_part"],
           "warm_seconds_by_part": warm["ours"][0]["seconds_by_part"],
           "cold_phases": cold["ours"][0]["phases"], "warm_phases": warm["ours"][0]["phases"], "cpu_count": os.cpu_count(),
           "load_avg_1m": round(load[0], 2), "goal_s": GOAL_S, "top_up_budget_s": args.top_up_budget,
           "samples_drawn": warm["ours"][0]["samples_drawn"]}
    if args.peer:
        commit = subprocess.run(["git", "-C", str(args.peer), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip() or "unknown"
        out["peer"] = {"commit": commit, "cold_s": spread([r["seconds"] for r in cold["peer"]]),
                       "warm_s": spread([r["seconds"] for r in warm["peer"]]),
                       "warm_config_run_s": warm["peer"][0]["config_run_s"]}
        out["ours"] = {"cold_s": spread(out["cold_s"]), "warm_s": spread(out["warm_s"])}
        out["agreement"] = agreement(warm["ours"][0], warm["peer"][0])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
