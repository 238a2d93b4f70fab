"""Render the measured-performance table of docs/benchmarks.md from the JSON the benchmarks printed
(`make bench` writes them to benchmarks/results/ and then runs this). Each row names the
command that produced it, its figures with their spread, the goal, and the load it ran at;
the machine is described once, above the table. Rewrites the part of docs/benchmarks.md between
`<!-- bench:begin -->` and `<!-- bench:end -->`; nothing else.

    python benchmarks/report.py [benchmarks/results] [docs/benchmarks.md]
    python benchmarks/report.py --machine     # print this machine's description as JSON
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def machine() -> dict:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        mem_kb = 0
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 2**20, 1),
            "load_avg_1m_at_start": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d")}


def mm(s: dict, unit: str = "", digits: int = 2) -> str:
    """A {"median", "min", "max"} spread as "median (min–max) unit"."""
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])} ({f.format(s['min'])}–{f.format(s['max'])}){unit}"


def load(r: dict) -> str:
    threads = f"{r['threads']} threads, " if "threads" in r else ""
    return f"{threads}load {r.get('load_avg_1m', '?')}"


def row_gate(r: dict) -> list[str]:
    runs = ", ".join(f"{k} {mm(v, ' s')}" for k, v in r["config_run_s"].items())
    return ["`python benchmarks/gate.py`", f"gate time-to-verdict, embedded default, {r['samples']}-document smoke suite, "
            f"int8 vs fp16 ({r['repeats']} fresh servers)",
            f"cold {mm(r['cold_s'], ' s')}, warm {mm(r['warm_s'], ' s')}; server up {mm(r['server_up_s'], ' s')}; "
            f"cold config-runs: {runs}"
            + (f"; warm: baseline {'reused' if r['warm_baseline_reused'] else 'computed'}, config-runs "
               + ", ".join(f"{k} {mm(v, ' s')}" for k, v in r["warm_config_run_s"].items())
               if "warm_config_run_s" in r else "")
            + f"; peak RSS {r['peak_rss_mb']:.0f} MB; verdict {r['verdict']}",
            f"cold ≤ {r['goal']['cold_s']} s, warm ≤ {r['goal']['warm_s']} s", load(r)]


def row_dashboard(r: dict) -> list[str]:
    o = r["overall"]
    worst = max(r["calls"].items(), key=lambda kv: kv[1]["p99_ms"])
    workers = r.get("server_workers", 1)
    return [f"`python benchmarks/dashboard_api.py --server-workers {workers}`",
            f"dashboard API views, {workers} API process{'es' if workers > 1 else ''}, {r['clients']} concurrent clients "
            f"(each a {r.get('client_mode', 'thread')}), "
            f"{r['requests']} requests, {r['sample_results']:,} sample results in Postgres",
            f"p50 {o['p50_ms']:.0f} ms, p95 {o['p95_ms']:.0f} ms, p99 {o['p99_ms']:.0f} ms; {r['requests_per_s']:.0f} "
            f"requests/s; slowest view {worst[0]} (p99 {worst[1]['p99_ms']:.0f} ms); {r['errors']} errors",
            f"p99 < {r['goal_p99_ms']} ms", load(r)]


def row_perplexity(r: dict) -> list[str]:
    s = r["speedup"]
    return [f"`python benchmarks/perplexity_throughput.py --docs {r['documents']} --threads {r['threads']}`",
            f"perplexity scoring vs lm-eval `hf`, {r['documents']} documents ({r['tokens']:,} tokens), fp32, "
            f"batch {r['batch_size']}, {r['repeats']} alternating rounds",
            f"{mm(s['wall'], '×', 2)} by wall time, {mm(s['cpu'], '×', 2)} by CPU time; "
            f"{r['reference_tokens_per_s']['wall']['median']:.0f} vs {r['lm_eval_hf_tokens_per_s']['wall']['median']:.0f} "
            f"tokens/s; perplexities equal to {r['relative_ppl_difference']:.1e}", "≥ 2×", load(r)]


def row_decode(r: dict) -> list[str]:
    parts = []
    for x in r["lengths"]:
        parts.append(f"~{x['prompt_tokens']}-token prompts: {mm(x['speedup']['wall'], '×', 2)} "
                     f"({x['reference_tokens_per_s']['wall']['median']:.0f} vs "
                     f"{x['transformers_tokens_per_s']['wall']['median']:.0f} tokens/s), TTFT "
                     f"{x['reference_ttft_ms']['median']:.1f} vs {x['transformers_ttft_ms']['median']:.1f} ms, "
                     f"tokens {'identical' if x['identical_tokens'] else 'DIFFERENT'}")
    return ["`python benchmarks/reference_decode.py`", f"greedy decode vs transformers `generate`, batch 1, "
            f"{r['prompts']} prompts × {r['new_tokens']} tokens, {r['repeats']} alternating rounds", "; ".join(parts),
            "≥ 1.5× at every length", load(r)]


def row_speculative(r: dict) -> list[str]:
    parts = [f"{x['method']} k={x['k']}: {mm(x['realised_speedup']['wall'], '×', 2)} realised vs "
             f"{x['theory_speedup']:.2f}× theory ({x['realised_over_theory']:.1%})"
             + (f", a pass with a draft costs {x['pass_with_draft_cost']:.2f} plain steps"
                if x.get("pass_with_draft_cost") else "") for x in r["configs"]]
    return ["`python benchmarks/speculative.py`", f"speculative vs plain decoding, greedy, batch 1, {r['prompts']} prompts "
            f"× {r['new_tokens']} tokens; draft cost ratio c = {r['draft_cost_ratio_c']}", "; ".join(parts),
            "realised ≥ 80 % of theory", load(r)]


def row_demo(r: dict) -> list[str]:
    slowest = ", ".join(f"{k} {v:.0f} s" for k, v in list(r["warm_config_run_s"].items())[:3])
    return ["`python benchmarks/demo.py`", f"`canary demo` through a pipe, {r['configs']} configs × {r['samples']} "
            "documents, embedded default; cold = empty AWQ cache (fresh HOME), warm = the cache the cold run filled",
            f"cold {', '.join(f'{x:.0f}' for x in r['cold_s'])} s, warm {', '.join(f'{x:.0f}' for x in r['warm_s'])} s; "
            f"slowest config-runs (warm): {slowest}", f"≤ {r['goal_s']} s", load(r)]


ROWS = {"demo": row_demo, "gate": row_gate, "dashboard_api": row_dashboard, "perplexity_throughput": row_perplexity,
        "reference_decode": row_decode, "speculative": row_speculative}


def render(results: Path) -> str:
    m = json.loads((results / "machine.json").read_text())
    lines = [BEGIN, f"Measured by `make bench` on {m['date']}: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
             f"no GPU; load average {m['load_avg_1m_at_start']} when it started. Spreads are median (min–max) over "
             "the repeats; the raw JSON is in `benchmarks/results/`.", "",
             "| command | what | measured | goal | threads, load |", "|---|---|---|---|---|"]
    for name, row in ROWS.items():  # name.json, and variants such as perplexity_throughput_200.json
        for path in sorted(results.glob(f"{name}*.json")):
            lines.append("| " + " | ".join(row(json.loads(path.read_text()))) + " |")
    return "\n".join([*lines, END])


def main() -> None:
    if sys.argv[1:] == ["--machine"]:
        print(json.dumps(machine()))
        return
    if "--help" in sys.argv or "-h" in sys.argv:
        print(__doc__)
        return
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
    readme = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/benchmarks.md")
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme}: no {BEGIN} … {END} section to rewrite")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    readme.write_text(head + render(results) + tail)


if __name__ == "__main__":
    main()
