"""Compare: baseline vs candidates on one run — estimates, CIs and verdicts per metric, and the
trade-off being decided: quality lost against speed and memory gained."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.views.common import fmt, style_verdict_column


def render(api, project: str, params) -> None:
    st.title("Compare configs")
    runs = [r for r in api.get(f"/projects/{project}/runs", limit=100) if r["status"] == "done"]
    if not runs:
        st.info("No finished runs yet.")
        return
    labels = {f"run {r['run_id']} · {r['trigger']} · {r['verdict']} · {r['created_at'][:16]}": r["run_id"] for r in runs}
    run_id = labels[st.selectbox("Run", list(labels))]
    run = api.get(f"/projects/{project}/runs/{run_id}")
    comps = pd.DataFrame(run["comparisons"])
    if comps.empty:
        st.info("This run has no comparisons.")
        return
    comps["CI"] = [f"[{fmt(a)}, {fmt(b)}]" for a, b in zip(comps["ci_low"], comps["ci_high"], strict=True)]
    st.dataframe(style_verdict_column(comps[["config", "metric", "estimate", "CI", "n", "verdict", "rule"]]), hide_index=True, width="stretch")
    base = run["baseline"]
    f = run["figures"]
    bf = f.get(base) or {}
    points = []
    for c in run["configs"]:
        name, fig = c["config"], f.get(c["config"]) or {}
        ratio = next((x for x in run["comparisons"] if x["config"] == name and x["metric"] == "ppl_ratio"), None)
        if name == base or ratio is None or not bf.get("tokens_per_second") or not fig.get("tokens_per_second"):
            continue
        points.append({"config": name, "quality loss %": (ratio["estimate"] - 1) * 100, "verdict": ratio["verdict"],
                       "speed gain ×": fig["tokens_per_second"] / bf["tokens_per_second"],
                       "memory saved %": 100 * (1 - (fig.get("weight_bytes", 0) + 512 * fig.get("kv_bytes_per_token", 0))
                                                / max(1, bf.get("weight_bytes", 0) + 512 * bf.get("kv_bytes_per_token", 0)))})
    if points:
        st.subheader("Quality lost vs speed and memory gained")
        axis = st.radio("Gain", ["speed gain ×", "memory saved %"], horizontal=True)
        chart = (alt.Chart(pd.DataFrame(points)).mark_circle(size=120)
                 .encode(x=alt.X(axis), y=alt.Y("quality loss %"), tooltip=list(points[0]),
                         color=alt.Color("verdict", scale=alt.Scale(domain=["ok", "warn", "critical", "inconclusive", "measurement_error"],
                                                                   range=["#2e7d32", "#ef6c00", "#c62828", "#9e9e9e", "#7b1fa2"])))
                 + alt.Chart(pd.DataFrame(points)).mark_text(dy=-12).encode(x=axis, y="quality loss %", text="config"))
        st.altair_chart(chart, width="stretch")
        st.caption("Memory = weight bytes + KV bytes for a 512-token context. Up and left is worse; down and right is the win.")
