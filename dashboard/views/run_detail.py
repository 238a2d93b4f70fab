"""Run detail: what breached in one run, and the samples behind it — the worst candidate first,
its worst documents as perplexity ratios, baseline and candidate outputs side by side, judge
rationale and faithfulness statements."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import pandas as pd
import streamlit as st

from dashboard.views.common import (
    BREACHING,
    clock_time,
    doc_ppl_ratio,
    fmt,
    human_time,
    metric_cell,
    pct_change,
    samples_label,
    style_verdict_column,
    worst_first,
    worst_verdict,
)

if TYPE_CHECKING:
    from pandas.io.formats.style import Styler

    from dashboard.client import Api

SAMPLE_METRICS = ["nll", "faithfulness", "judge_pairwise", "judge_score"]


def comparison_rows(run: dict, metrics: dict[str, dict]) -> tuple[list[dict], list[dict]]:
    """The run's comparisons as rows, breaching (and broken) first, then the rest; left out: the
    baseline against itself and metrics that are only reported (no threshold, no say)."""
    shown = []
    layers = ablations(run)
    for c in run["comparisons"]:
        m = metrics.get(c["metric"])
        if c["config"] == run["baseline"] or c["config"] in layers or m is None or not m["gated"]:
            continue
        ci = () if m["comparison"] == "peak" else (c["ci_low"], c["ci_high"])
        cell = metric_cell(m["unit"], m["fmt"], c["estimate"], *ci)
        shown.append({"config": c["config"], "metric": m["label"], "change [95% CI]": cell,
                      "n": c["n"], "verdict": c["verdict"], "why": c["rule"] or "",
                      "ppl_ratio": c["estimate"] if c["metric"] == "ppl_ratio" else None})
    shown = worst_first(shown)
    breaching = [r for r in shown if r["verdict"] in (*BREACHING, "measurement_error")]
    return breaching, [r for r in shown if r not in breaching]


def example_answers(run: dict, metrics: dict[str, dict]) -> list[dict]:
    """One answer per breaching generation finding that stored one (evals/field.py): what an empty
    answer, a loop, a truncation or a confident departure looks like on this run, beside the
    baseline's answer to the same prompt where it was kept. Worst verdict first."""
    layers = ablations(run)
    found = []
    for c in run["comparisons"]:
        example = (c.get("details") or {}).get("example")
        m = metrics.get(c["metric"])
        if (not example or m is None or c["verdict"] not in BREACHING or c["config"] == run["baseline"]
                or c["config"] in layers):
            continue
        found.append({"config": c["config"], "metric": m["label"], "verdict": c["verdict"],
                      "prompt": example.get("sample_key", ""), "answer": example.get("text", ""),
                      "baseline_answer": example.get("baseline_text"), "alone": example.get("alone")})
    return sorted(found, key=lambda e: (e["verdict"] != "critical", e["config"], e["metric"]))


# what was scored: the documents, by prefill or a token per decode step; the generated answers, whose
# buckets are token indexes in the answer rather than slots of a window
PASSES = {"ppl_ratio": "prefill", "decode_nll_ratio": "decode", "gen_nll_ratio": "answer"}


def position_rows(run: dict) -> list[dict]:
    """Each candidate's perplexity ratio per position bucket of its windows (evals/positions.py),
    as ppl_ratio's details hold them (and decode_nll_ratio's, for the documents also scored a
    token per decode step), then gen_nll_ratio's per bucket of token index in the generated answers:
    a loss that starts deep in the context, or late in an answer, shows in the late buckets while
    the whole ratio averages it away. Configs in the run's order."""
    layers = ablations(run)
    rows = []
    for c in run["comparisons"]:
        if c["metric"] not in PASSES or c["config"] == run["baseline"] or c["config"] in layers:
            continue
        for b in (c.get("details") or {}).get("by_position") or []:
            rows.append({"config": c["config"], "scored": PASSES[c["metric"]], "positions": b["positions"],
                         "change [95% CI]": pct_change(b["estimate"], b["ci_low"], b["ci_high"]),
                         "tokens": b["tokens"], "n": b["n"], "verdict": b["verdict"]})
    configs = list(dict.fromkeys(r["config"] for r in rows))
    passes = list(PASSES.values())  # each config's prefill rows, then decode, then its answers
    return sorted(rows, key=lambda r: (configs.index(r["config"]), passes.index(r["scored"])))


def decode_rows(run: dict) -> list[dict]:
    """The KV configs whose first documents were also scored one token per decode step
    (decode_nll_ratio): the same documents' perplexity change by prefill and by decode, and the
    gap, decode ÷ prefill. A gap above 1 is loss that only decoding reads out of the cache."""
    layers = ablations(run)
    return [{"config": c["config"], "documents": c["n"],
             "prefill": pct_change(c["details"]["prefill_ratio"]),
             "decode [95% CI]": pct_change(c["estimate"], c["ci_low"], c["ci_high"]),
             "decode ÷ prefill": f"{c['details']['prefill_decode_gap']:.4f}", "verdict": c["verdict"]}
            for c in run["comparisons"]
            if c["metric"] == "decode_nll_ratio" and c.get("estimate") is not None and c["config"] not in layers]


def distribution_rows(run: dict) -> list[dict]:
    """Each candidate's next-token distributions against the baseline's, as llama-perplexity
    --kl-divergence prints them (kld_mean's details): mean KLD with its CI, its 99th percentile,
    Δp's RMS, same top p, mean KLD by position in the window, and whether the top-20 bounds held.
    Where a server gave only its top-20 (kld_bound "lower"), the mean KLD is a lower bound and shows
    as "≥"."""
    rows = []
    for c in run["comparisons"]:
        d = c.get("details") or {}
        if c["metric"] != "kld_mean" or c.get("estimate") is None or "same_top" not in d:
            continue
        bounds = d.get("topk_bounds") or {}
        at_least = "≥ " if d.get("kld_bound") == "lower" else ""  # a server's top-20 on both sides
        rows.append({"config": c["config"], "tokens": d["tokens"],
                     "mean KLD [95% CI]": f"{at_least}{c['estimate']:.5f} [{c['ci_low']:.5f}, {c['ci_high']:.5f}]",
                     "KLD p99": f"{d['kld_percentiles']['p99']:.4f}", "Δp RMS": f"{d['dp_rms'] * 100:.2f}%",
                     "same top p": f"{d['same_top'] * 100:.1f}%", "KLD by position": kld_by_position(d),
                     "top-20 bounds (self-check)": (f"{bounds['bracketed'] * 100:.0f}% bracketed, width "
                                                    f"{bounds['width_mean']:.3g}" if bounds and bounds.get("width_mean")
                                                    is not None else "lower bound: both sides' top-20" if at_least
                                                    else "—")})
    return rows


LAYER_ROWS = 5  # the configs that drift most; the rest are in the run's comparisons


def layer_rows(run: dict) -> list[dict]:
    """The configs that drift most from the baseline's forward pass, worst first (layer_drift's
    details, evals/layer_drift.py): where the drift starts (the first layer and site past its
    bound), how it grows per layer, the hidden state's error after each layer and after the last."""
    found = [c for c in run["comparisons"]
             if c["metric"] == "layer_drift" and c.get("estimate") is not None and c["config"] != run["baseline"]]
    rows = []
    for c in sorted(found, key=lambda c: -c["estimate"])[:LAYER_ROWS]:
        d = c.get("details") or {}
        per_layer = d.get("per_layer") or {}
        growth = d.get("growth_per_layer")
        rows.append({"config": c["config"], "drift starts at": d.get("first_divergent", "—"),
                     "growth per layer": f"×{growth:.2f}" if growth is not None else "—",
                     "hidden error after each layer": " · ".join(f"{x:.3g}" for x in per_layer.get("hidden") or []),
                     "after the last [95% CI]": f"{c['estimate']:.4f} [{c['ci_low']:.4f}, {c['ci_high']:.4f}]",
                     "cosine after the last": f"{(per_layer.get('hidden_cos') or [float('nan')])[-1]:.4f}",
                     "documents": c["n"]})
    return rows


def kld_by_position(details: dict) -> str:
    """Mean KLD per position bucket of the windows, "0–127 0.0121 · 128–255 0.0342"; "—" with one bucket."""
    return " · ".join(f"{b['positions']} {b['estimate']:.4g}" for b in details.get("by_position") or []) or "—"


def task_rows(run: dict) -> list[dict]:
    """Each candidate's answers on the suite's labelled items against the baseline's (task_recovery's
    details, task_flips' verdict): the two accuracies, the recovery, the flips each way and
    McNemar's exact p."""
    flips = {c["config"]: c for c in run["comparisons"] if c["metric"] == "task_flips"}
    rows = []
    for c in run["comparisons"]:
        d = c.get("details") or {}
        if c["metric"] != "task_recovery" or "items" not in d:
            continue
        f = flips.get(c["config"]) or {}
        rows.append({"config": c["config"], "items": d["items"],
                     "accuracy": f"{d['baseline_accuracy'] * 100:.1f}% → {d['candidate_accuracy'] * 100:.1f}%",
                     "recovery [95% CI]": ("—" if c.get("estimate") is None else
                                           f"{c['estimate']:.3f} [{c['ci_low']:.3f}, {c['ci_high']:.3f}]"),
                     "right→wrong": d["right_to_wrong"], "wrong→right": d["wrong_to_right"],
                     "of them at a near-tie": (f.get("details") or {}).get("near_tie_flips", "—"),
                     "McNemar p": f"{d['mcnemar_p']:.3g}",
                     "verdict": worst_verdict([v for v in (c["verdict"], f.get("verdict")) if v])})
    return rows


def ablations(run: dict) -> set[str]:
    """The run's single-optimization ablations of a stacked config (step back one layer): shown
    in their own section, not as candidates."""
    return {c["config"] for c in run["configs"] if c.get("ablation_of")}


def step_back_rows(found: dict) -> list[dict]:
    """One stacked config's layers, largest share of the loss first, as the API gives them."""
    return [{"layer": f"{layer['axis']} {layer['value']}" + (" (lossless)" if layer["lossless"] else ""),
             f"{found['metric']} alone": f"{layer['ratio']:.4g}", "verdict": layer["verdict"],
             "share of the loss": "—" if layer["share"] is None else f"{layer['share'] * 100:.1f} %",
             "run alone as": layer["config"]}
            for layer in found["layers"]]


def candidates_worst_first(run: dict, metrics: dict[str, dict]) -> list[str]:
    """Candidates by their worst gated verdict, then by the larger perplexity ratio."""
    rows = []
    for c in run["configs"]:
        if c["config"] == run["baseline"] or c.get("ablation_of"):
            continue
        comps = [x for x in run["comparisons"]
                 if x["config"] == c["config"] and (metrics.get(x["metric"]) or {}).get("gated")]
        ppl = next((x["estimate"] for x in comps if x["metric"] == "ppl_ratio"), None)
        rows.append({"config": c["config"], "verdict": worst_verdict(x["verdict"] for x in comps), "ppl_ratio": ppl})
    return [r["config"] for r in worst_first(rows)]


def _table(rows: list[dict]) -> Styler:
    df = pd.DataFrame(rows).drop(columns=["ppl_ratio"])
    return style_verdict_column(df).hide(axis="index")


def render(api: Api, project: str, params: Mapping[str, str]) -> None:
    st.title("Run detail")
    runs = api.get(f"/projects/{project}/runs", limit=100)
    if not runs:
        st.info("No runs yet.")
        return
    ids = [r["run_id"] for r in runs]
    by_id = {r["run_id"]: r for r in runs}
    asked = str(params.get("run_id", ""))
    wanted = int(asked) if asked.isdigit() and int(asked) in ids else ids[0]

    def label(i: int) -> str:
        r = by_id[i]
        return f"run {i} · {r['trigger']} · {r['verdict'] or r['status']} · {clock_time(r['created_at'])}"

    run_id = st.selectbox("Run", ids, index=ids.index(wanted), key="run", format_func=label)
    run = api.get(f"/projects/{project}/runs/{run_id}")
    suites = {s["id"]: s["name"] for s in api.get(f"/projects/{project}/suites")}
    metrics = {m["name"]: m for m in api.get("/metrics")["metrics"]}
    suite = suites.get(run["suite_id"], "?")
    st.markdown(f"**Verdict {run['verdict'] or '—'}** ({run['status']}) · suite **{suite}** · "
                f"{samples_label(run)} · {run['trigger']} · started {human_time(run['created_at'])}, "
                f"baseline {run['baseline']}")
    breaching, rest = comparison_rows(run, metrics)
    if breaching:
        st.subheader(f"Breaching ({len(breaching)})")
        st.table(_table(breaching))
    else:
        st.success("No comparison breaches a threshold in this run.")
    for found in run.get("step_back") or []:
        st.subheader(f"Step back one layer: {found['config']}")
        st.markdown(f"{found['metric']} {found['stacked_ratio']:.4g} stacked: **{found['advice']}**")
        st.table(style_verdict_column(pd.DataFrame(step_back_rows(found))).hide(axis="index"))
    if rest:
        with st.expander(f"Other comparisons ({len(rest)}: ok or inconclusive)"):
            st.table(_table(rest))
    by_position = position_rows(run)
    if by_position:
        flagged = sorted({r["config"] for r in by_position if r["verdict"] in BREACHING})
        title = ("Perplexity by position in the context and in the answer"
                 + (f" (flagged: {', '.join(flagged)})" if flagged else ""))
        with st.expander(title, expanded=bool(flagged)):
            st.caption("Each config's perplexity ratio over the tokens predicted from those slots of their window "
                       "(documents scored by prefill or by decode), and the baseline model's perplexity of its "
                       "generated answers by token index in the answer against the baseline's own answers, with "
                       "its own CI and verdict (ppl ratio's and gen NLL ratio's thresholds): reported, not judged.")
            st.table(style_verdict_column(pd.DataFrame(by_position)).hide(axis="index"))
    _rows_in_expander("Next-token distributions against the baseline (llama-perplexity --kl-divergence)",
                      "Over every token of the suite's first perplexity.distribution_samples documents. Reported, "
                      "not judged: near the baseline KL stops ranking configs. Bounds: what the baseline's top 20 "
                      "log-probs alone (what a server returns) say of each token's KLD.", distribution_rows(run))
    _rows_in_expander("Where the drift starts, layer by layer",
                      f"The {LAYER_ROWS} configs whose forward pass drifts most from the baseline's on the same "
                      "window (the suite's layers scorer): the first layer and site (keys and values as the KV "
                      "cache holds them, attention output, hidden state) whose relative error passes 0.001, and "
                      "how the hidden state's error grows per layer from there. Reported, not judged: it says "
                      "where to look.", layer_rows(run))
    _rows_in_expander("KV cache: scored by prefill and by decode",
                      "The same documents scored in one prefill and one token per decode step through the KV "
                      "cache: a gap above 1 is loss only decoding reads. Reported, not judged (verdict: ppl "
                      "ratio's thresholds).", decode_rows(run))
    _rows_in_expander("Task accuracy on labelled items",
                      "Each candidate's answers on the suite's labelled items against the baseline's, item by item: "
                      "recovery (right answers ÷ the baseline's) and flips either way, which recovery cannot see; "
                      "the verdict is the worse of task_recovery's and task_flips'.", task_rows(run))
    _examples(run, metrics)
    candidates = candidates_worst_first(run, metrics)
    if not candidates:
        st.info("This run has only the baseline.")
        return
    if not _worst_samples(api, project, run, candidates):
        return
    with st.expander("Verdict reason, as stored"):
        st.text(run["verdict_reason"] or "—")


def _rows_in_expander(title: str, caption: str, rows: list[dict]) -> None:
    """A closed expander with a caption and a table of `rows` (verdicts coloured where a row has
    one); nothing where there are no rows."""
    if not rows:
        return
    with st.expander(title):
        st.caption(caption)
        frame = pd.DataFrame(rows)
        styled = style_verdict_column(frame) if "verdict" in frame else frame.style
        st.table(styled.hide(axis="index"))


def _examples(run: dict, metrics: dict) -> None:
    """Each breaching generation finding's stored example: the candidate's answer beside the
    baseline's, or beside the same prompt sent alone."""
    examples = example_answers(run, metrics)
    if not examples:
        return
    st.subheader(f"Example answers ({len(examples)})")
    for e in examples:
        st.markdown(f"**{e['config']} · {e['metric']}** ({e['verdict']}) — prompt `{e['prompt']}`")
        sides = [("candidate", e["answer"])]
        if e["baseline_answer"] is not None:
            sides.append((f"baseline {run['baseline']}", e["baseline_answer"]))
        if e["alone"] is not None:
            sides.append(("the same prompt sent alone", e["alone"]))
        for col, (side, text) in zip(st.columns(len(sides)), sides, strict=True):
            col.caption(side)
            col.code(text if text else "(empty answer)", language=None)


def _worst_samples(api: Api, project: str, run: dict, candidates: list[str]) -> bool:
    """A candidate's worst samples by a per-sample metric, each with both sides' outputs and what
    the judge and faithfulness said; False when it has no paired samples on that metric."""
    st.subheader("Worst samples")
    config = st.selectbox("Candidate (worst first)", candidates, key=f"candidate-{run['run_id']}")  # per run: the worst
    metric = st.selectbox("Rank samples by", SAMPLE_METRICS, key="sample_metric",
                          format_func=lambda m: "document perplexity ratio" if m == "nll" else m)
    run_id = run["run_id"]
    worst = api.get(f"/projects/{project}/runs/{run_id}/worst", config=config, metric=metric,
                    limit=200 if metric == "nll" else 20)
    items = worst["items"]
    if not items:
        st.info(f"No paired {metric} samples for {config} in this run.")
        return False
    if metric == "nll":  # per document: exp((NLL_c − NLL_b) / tokens), the ratio the run's ppl_ratio pools
        for item in items:
            item["ratio"] = doc_ppl_ratio(item["candidate_value"], item["baseline_value"],
                                          (item["baseline_extra"] or {}).get("n_tokens"))
        items = sorted(items, key=lambda i: -(i["ratio"] or 0))[:20]
    for item in items:
        if metric == "nll":
            tokens = (item["baseline_extra"] or {}).get("n_tokens")
            head = (f"{item['sample_key']} — perplexity ×{fmt(item['ratio'], '.3f')} ({pct_change(item['ratio'])}) "
                    f"over {tokens} tokens")
        else:
            head = (f"{item['sample_key']} — Δ {fmt(item['delta'], '+.4g')} (baseline {fmt(item['baseline_value'])}, "
                    f"candidate {fmt(item['candidate_value'])})")
        with st.expander(head):
            outs = item["outputs"]
            left, right = st.columns(2)
            for col, side, name in ((left, "baseline", run["baseline"]), (right, "candidate", config)):
                gen = (outs.get(side) or {}).get("generation") or {}
                col.markdown(f"**{side}: {name}**")
                col.code(gen.get("text", "(no generation)"), language=None)
            judge = (outs.get("candidate") or {}).get("judge_pairwise")
            if judge:
                st.markdown(f"**Judge:** {judge.get('winner')} (orders {judge.get('orders')}) — "
                            f"{judge.get('rationale', '')}")
            faith = (outs.get("candidate") or {}).get("faithfulness")
            if faith:
                st.markdown(f"**Faithfulness** ({faith.get('method')}):")
                for s in faith.get("statements", []):
                    st.markdown(f"- {'✅' if s['supported'] else '❌'} {s['statement']}")
    return True
