"""Run detail: per-sample drill-down — worst regressions first, baseline and candidate outputs
side by side, judge rationale and faithfulness statements."""

from __future__ import annotations

import streamlit as st

from dashboard.views.common import fmt


def render(api, project: str, params) -> None:
    st.title("Run detail")
    runs = api.get(f"/projects/{project}/runs", limit=100)
    if not runs:
        st.info("No runs yet.")
        return
    ids = [r["run_id"] for r in runs]
    wanted = int(params["run_id"]) if str(params.get("run_id", "")).isdigit() and int(params["run_id"]) in ids else ids[0]
    run_id = st.selectbox("Run", ids, index=ids.index(wanted), key="run")
    run = api.get(f"/projects/{project}/runs/{run_id}")
    st.write(f"**{run['status']}** · verdict **{run['verdict'] or '—'}** · {run['verdict_reason'] or ''}")
    candidates = [c["config"] for c in run["configs"] if c["config"] != run["baseline"]]
    if not candidates:
        st.info("This run has only the baseline.")
        return
    config = st.selectbox("Candidate", candidates, key="candidate")
    metric = st.selectbox("Rank samples by", ["nll", "faithfulness", "judge_pairwise", "judge_score"])
    worst = api.get(f"/projects/{project}/runs/{run_id}/worst", config=config, metric=metric, limit=20)
    if not worst["items"]:
        st.info(f"No paired {metric} samples for {config} in this run.")
        return
    for item in worst["items"]:
        head = f"{item['sample_key']} — Δ {fmt(item['delta'], '+.4g')} (baseline {fmt(item['baseline_value'])}, candidate {fmt(item['candidate_value'])})"
        with st.expander(head):
            outs = item["outputs"]
            left, right = st.columns(2)
            for col, side, name in ((left, "baseline", run["baseline"]), (right, "candidate", config)):
                gen = (outs.get(side) or {}).get("generation") or {}
                col.markdown(f"**{side}: {name}**")
                col.code(gen.get("text", "(no generation)"), language=None)
            judge = (outs.get("candidate") or {}).get("judge_pairwise")
            if judge:
                st.markdown(f"**Judge:** {judge.get('winner')} (orders {judge.get('orders')}) — {judge.get('rationale', '')}")
            faith = (outs.get("candidate") or {}).get("faithfulness")
            if faith:
                st.markdown(f"**Faithfulness** ({faith.get('method')}):")
                for s in faith.get("statements", []):
                    st.markdown(f"- {'✅' if s['supported'] else '❌'} {s['statement']}")
