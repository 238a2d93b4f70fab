"""What default top-ups (workers/top_up.py) add to a demo run (issue goal: at most 20 %), measured
as `make demo` runs it: the whole demo (15 configs, 100 samples, through a pipe) with top-ups at
the deployment's default budget (CANARY_TOP_UP_BUDGET_S=1800; `canary demo`'s own default is 120 s), and
with CANARY_TOP_UP_BUDGET_S=0 (no default top-up), alternating, in one warm HOME
(a first cold run fills the AWQ search's cache and is not counted). Printed: each side's seconds
(every repeat, median, min, max), the growth of the medians, how far each run with top-ups drew,
the configs it topped up and what they were decided to, and a check that every comparison of a
config that was not topped up is the same on both sides (the timing metrics aside). One JSON object.

    python benchmarks/top_up_cost.py [--repeats 2] [--samples 100]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import TIMING, one, spread  # the demo benchmark's runner, beside this file

OFF = {"CANARY_TOP_UP_BUDGET_S": "0"}
ON = {"CANARY_TOP_UP_BUDGET_S": "1800"}  # the deployment default (app/settings.py), not the demo's 120 s


def verdicts(run: dict) -> dict[str, str]:
    """Each config's worst gated verdict, from the run's comparisons."""
    order = ["ok", "inconclusive", "warn", "critical", "measurement_error"]
    worst: dict[str, str] = {}
    for c in run["comparisons"]:
        if c.get("gated", True) and c["verdict"] in order:
            worst[c["config"]] = max(worst.get(c["config"], "ok"), c["verdict"], key=order.index)
    return worst


def topped_up(on: dict, off: dict) -> list[str]:
    """The configs whose comparisons rest on more samples with top-ups than without."""
    n_off = {(c["config"], c["metric"]): c["n"] for c in off["comparisons"]}
    return sorted({c["config"] for c in on["comparisons"] if c["n"] > n_off.get((c["config"], c["metric"]), c["n"])})


def untouched_agree(on: dict, off: dict, topped: list[str]) -> dict:
    """Every comparison of a config not topped up, the same on both sides (timing metrics aside)."""
    def rows(run: dict) -> dict:
        return {(c["config"], c["metric"]): (c["estimate"], c["ci_low"], c["ci_high"], c["n"], c["verdict"])
                for c in run["comparisons"] if c["config"] not in topped and c["metric"] not in TIMING}
    a, b = rows(on), rows(off)
    differ = sorted(f"{k[0]} {k[1]}: {a[k]} vs {b.get(k)}" for k in a if a[k] != b.get(k))
    return {"compared": len(a), "equal": not differ and set(a) == set(b), "differ": differ}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs, top-ups on then off (default 2)")
    p.add_argument("--samples", type=int, default=100, help="documents per config, as `make demo` (default 100)")
    args = p.parse_args()
    default = {k: v for k, v in os.environ.items() if k != "CANARY_TOP_UP_BUDGET_S"}
    os.environ.clear()
    os.environ.update(default)  # the deployment default for the "on" side, whatever this shell sets
    on: list[dict] = []
    off: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="canary-top-up-bench-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        cold = one(home, Path(tmp), args.samples, **OFF)  # fills the AWQ cache
        for _ in range(args.repeats):
            on.append(one(home, Path(tmp), args.samples, **ON))
            off.append(one(home, Path(tmp), args.samples, **OFF))
    on_s, off_s = [r["seconds"] for r in on], [r["seconds"] for r in off]
    topped = topped_up(on[0], off[0])
    out = {"benchmark": "top_up_cost", "samples": args.samples, "repeats": args.repeats, "configs": on[0]["configs"],
           "cold_s_not_counted": cold["seconds"], "top_ups_on_s": spread(on_s), "top_ups_off_s": spread(off_s),
           "growth_of_medians": round(spread(on_s)["median"] / spread(off_s)["median"] - 1, 3), "goal_growth": 0.20,
           "samples_drawn_on": [r["samples_drawn"] for r in on], "samples_drawn_off": [r["samples_drawn"] for r in off],
           "topped_up": {name: {"off": verdicts(off[0]).get(name), "on": verdicts(on[0]).get(name)} for name in topped},
           "untouched_configs_agree": untouched_agree(on[0], off[0], topped),
           "undecided_lines_on": [line for line in (on[0]["summary"] or {}).get("lines", [])
                                  if "inconclusive" in line],
           "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
