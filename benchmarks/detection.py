"""Detection power: seeded faults of known size, fed in only through the public interfaces, and
null configs, through the whole service (a canary.yaml, runs on the embedded default, the
aggregation's verdicts). Prints, per fault class and size, how often it was flagged (warn,
critical or measurement_error on any gated metric) and by which metric, and the false-alarm
rate over the null configs.

Every config is `engine: openai`. Upstream is a real `canary engine-serve` of the tiny target;
every config reaches it through a proxy (the baseline and the nulls through one that changes
nothing), so the hop's latency is on both sides of each timing ratio. Faults:
  logprob-shift s   a perturbing proxy (tests/http/perturb.py) lowers every prompt log-prob by s
                    nats: the perplexity ratio is exactly exp(s) (at or above the seed warn 1.15
                    from s = ln 1.15 = 0.140)
  garble p          the proxy replaces each streamed piece of text with random letters with
                    probability p after the model (a sampler or detokenizer bug)
  delay d           the proxy holds each streamed completion d ms: TTFT + d (at or above the seed
                    warn 1.25 of ttft_ratio when d ≥ 0.25 × the baseline's TTFT p50)
  weight-noise σ    a second engine-serve of the target whose decoder weights carry Gaussian
                    noise of σ × each matrix's standard deviation
  zero-logprobs     the proxy answers every prompt log-prob as 0 (a broken measurement)
Nulls: identity proxies in front of the same upstream (the baseline against itself; only
timing differs), one run per seed, each seed drawing other documents.

    .venv/bin/python benchmarks/detection.py [--seeds 2] [--nulls 10] [--samples 12] [--prompts 12]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FLAGGED = ("warn", "critical", "measurement_error")


def noised_checkpoint(sigma: float, out: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """The tiny target with N(0, (σ·std W)²) added to every decoder linear's weights."""
    import torch
    from safetensors.torch import load_file, save_file

    from engines.zoo import resolve_model_path

    source = resolve_model_path("builtin:pydoc-target")
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    state = load_file(source / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name, w in state.items():
        if ".layers." in name and name.endswith("proj.weight"):
            state[name] = w + sigma * w.std() * torch.randn(w.shape, generator=gen)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--seeds", type=int, default=2, help="runs, each drawing other documents (default 2)")
    ap.add_argument("--nulls", type=int, default=10, help="null configs per run (default 10)")
    ap.add_argument("--samples", type=int, default=12, help="documents per run (default 12; min_n is 10)")
    ap.add_argument("--prompts", type=int, default=12, help="generation prompts per run (default 12)")
    ap.add_argument("--shifts", type=float, nargs="*", default=[0.05, 0.14, 0.3], help="log-prob shifts, nats")
    ap.add_argument("--garbles", type=float, nargs="*", default=[0.05, 0.3], help="garble rates")
    ap.add_argument("--delays", type=float, nargs="*", default=[20, 80], help="TTFT delays, ms")
    ap.add_argument("--noises", type=float, nargs="*", default=[0.05, 0.3], help="weight noise σ (× std)")
    args = ap.parse_args()

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="canary-detection-"))
    # the embedded default in a scratch directory; loopback servers allowed; no escalation runs
    os.environ.update({"CANARY_DATABASE_URL": f"sqlite:///{workdir / 'canary.db'}", "CANARY_EXECUTION": "inline",
                       "CANARY_ESCALATION": "false", "CANARY_URL_ALLOWLIST": "127.0.0.1,localhost"})
    os.environ.pop("CANARY_BROKER_URL", None)
    from app import repo
    from app.config_file import parse_config
    from app.db import session_scope, upgrade
    from app.dispatch import InlineDispatcher
    from app.services import apply_config_file, run_summary, start_run
    from evals.metrics import METRICS
    from tests.http.conftest import start_engine_serve
    from tests.http.perturb import garble, proxy_app, shift_logprobs, zero_logprobs
    from tests.loopback import free_port, serve_in_thread

    upgrade(os.environ["CANARY_DATABASE_URL"])
    model = "builtin:pydoc-target"
    servers, procs = [], []

    def proxy(to: str | None = None, **fault) -> str:
        port = free_port()
        servers.append(serve_in_thread(proxy_app(to or upstream, **fault), port))
        return f"http://127.0.0.1:{port}/v1"

    try:
        proc, upstream = start_engine_serve("--model", model)
        procs.append(proc)
        faults: list[tuple[str, float | None, str]] = []  # (class, size, base_url)
        faults += [("logprob-shift", s, proxy(fault=shift_logprobs(s))) for s in args.shifts]
        faults += [("garble", p, proxy(stream_fault=garble(p, seed=1))) for p in args.garbles]
        faults += [("delay", d, proxy(delay_ms=d)) for d in args.delays]
        faults += [("zero-logprobs", None, proxy(fault=zero_logprobs))]
        for sigma in args.noises:
            noised = noised_checkpoint(sigma, workdir / f"noise-{sigma}")
            proc, url = start_engine_serve("--model", str(noised), "--served-model-name", model)
            procs.append(proc)
            faults.append(("weight-noise", sigma, proxy(to=url)))
        nulls = [proxy() for _ in range(args.nulls)]

        served = {"engine": "openai", "weights": "fp32"}
        # every config, the baseline included, reaches its server through a proxy: the hop's own
        # latency is on both sides of every timing ratio
        configs = [{"name": "baseline", "baseline": True, **served, "engine_options": {"base_url": proxy()}}]
        names: dict[str, tuple[str, float | None]] = {}
        for kind, size, url in faults:
            name = kind if size is None else f"{kind}-{size:g}"
            names[name] = (kind, size)
            configs.append({"name": name, **served, "engine_options": {"base_url": url}})
        for i, url in enumerate(nulls):
            names[f"null-{i}"] = ("null", None)
            configs.append({"name": f"null-{i}", **served, "engine_options": {"base_url": url}})

        flagged: dict[str, list[dict]] = defaultdict(list)
        started = time.perf_counter()
        for seed in range(args.seeds):
            cfg = {"project": "detection", "model": {"name": "tiny", "path": model}, "configs": configs,
                   "suites": [{"name": f"seed-{seed}", "corpus": "builtin:pydoc-heldout", "samples": args.samples,
                               "seed": seed, "scorers": ["perplexity", "generation"], "perplexity": {"window": 128},
                               "generation": {"prompts": args.prompts, "prompt_words": 12, "max_new_tokens": 16}}]}
            with session_scope() as session:
                apply_config_file(session, parse_config(cfg))
            run_id, _ = start_run("detection", f"seed-{seed}", None, InlineDispatcher())
            with session_scope() as session:
                summary = run_summary(session, repo.get_run(session, repo.get_project(session, "detection"), run_id))
            by_config: dict[str, list[dict]] = defaultdict(list)
            for c in summary["comparisons"]:
                if METRICS[c["metric"]].gated and not (c.get("details") or {}).get("informational"):
                    by_config[c["config"]].append(c)
            for name in names:
                hits = [c for c in by_config.get(name, []) if c["verdict"] in FLAGGED]
                flagged[name].append({"seed": seed, "flagged": bool(hits),
                                      "by": sorted({f"{c['metric']}:{c['verdict']}" for c in hits}),
                                      "estimates": {c["metric"]: c["estimate"] for c in by_config.get(name, [])},
                                      "baseline_ttft_p50_ms": next((c["baseline_value"] for c in by_config.get(name, [])
                                                                    if c["metric"] == "ttft_ratio"), None)})
            print(json.dumps({"seed": seed, "run_id": run_id, "verdict": summary["verdict"],
                              "seconds": round(time.perf_counter() - started, 1)}), flush=True)

        rows = []
        for name, (kind, size) in names.items():
            if kind == "null":
                continue
            trials = flagged[name]
            expected = None
            if kind == "logprob-shift":
                expected = {"ppl_ratio": round(math.exp(size), 4),
                            "at_or_above_warn": math.exp(size) >= METRICS["ppl_ratio"].warn}
            elif kind == "delay":  # against the baseline's TTFT p50 measured beside it, in the same runs
                p50s = [t["baseline_ttft_p50_ms"] for t in trials if t["baseline_ttft_p50_ms"]]
                if p50s:
                    ratio = (sum(p50s) / len(p50s) + size) / (sum(p50s) / len(p50s))
                    expected = {"ttft_ratio": round(ratio, 3), "baseline_ttft_p50_ms": round(sum(p50s) / len(p50s), 1),
                                "at_or_above_warn": ratio >= METRICS["ttft_ratio"].warn}
            rows.append({"fault": kind, "size": size, "detected": sum(t["flagged"] for t in trials),
                         "trials": len(trials),
                         "by": sorted({b for t in trials for b in t["by"]}), "expected": expected,
                         "estimates": [{k: round(v, 4) for k, v in t["estimates"].items() if v is not None
                                        and not (isinstance(v, float) and math.isnan(v))} for t in trials]})
        null_trials = [t for name, (kind, _) in names.items() if kind == "null" for t in flagged[name]]
        false_alarms = [t for t in null_trials if t["flagged"]]
        for row in rows:
            print(json.dumps(row), flush=True)
        reliable: dict[str, float | str | None] = {}  # per class, the smallest size flagged in every trial
        for kind in dict.fromkeys(r["fault"] for r in rows):  # (and every size above it); a sizeless fault: yes/no
            sizes = sorted((r for r in rows if r["fault"] == kind), key=lambda r: r["size"] or 0)
            caught = [r["size"] for i, r in enumerate(sizes) if all(x["detected"] == x["trials"] for x in sizes[i:])]
            reliable[kind] = ("always" if caught else "not always") if sizes[0]["size"] is None else (
                caught[0] if caught else None)
        print(json.dumps({"benchmark": "detection", "smallest_reliably_caught": reliable,
                          "null_trials": len(null_trials), "false_alarms": len(false_alarms),
                          "false_alarm_rate": round(len(false_alarms) / len(null_trials), 4) if null_trials else None,
                          "false_alarms_by": sorted({b for t in false_alarms for b in t["by"]}),
                          "samples": args.samples, "prompts": args.prompts, "seeds": args.seeds,
                          "load_average": os.getloadavg()[0], "seconds": round(time.perf_counter() - started, 1)}),
              flush=True)
    finally:
        for server in servers:
            server.should_exit = True
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
