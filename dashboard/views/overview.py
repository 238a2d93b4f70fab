"""Overview: per model, every config's current standing against its baseline and thresholds."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.views.common import catalogue, fmt, style_verdicts


def render(api, project: str, params) -> None:
    st.title("Inference quality overview")
    data = api.get(f"/projects/{project}/overview")
    c1, c2 = st.columns(2)
    c1.metric("Last check", data["last_check_at"] or "never")
    c2.metric("Next scheduled check", data["next_check_at"] or "no schedule")
    if not data["models"]:
        st.info("No models in this project yet.")
        return
    # one column per gated metric of the catalogue; a metric no config has a figure for is left out
    columns = [(m["name"], m["label"], m["fmt"]) for m in catalogue(api) if m["gated"]]
    for model, configs in data["models"].items():
        st.subheader(f"Model {model}")
        rows, verdicts = [], {}
        for c in configs:
            comps, f = c["comparisons"], c["figures"]
            base_ppl = (comps.get("ppl_ratio") or {}).get("baseline_value")
            row = {"config": c["config"] + (" (baseline)" if c["baseline"] else ""),
                   "domain ppl": fmt(f.get("token_ppl"), ".3f"),
                   "% vs baseline": fmt(((comps["ppl_ratio"]["estimate"] - 1) * 100) if comps.get("ppl_ratio") and comps["ppl_ratio"]["estimate"] is not None else None, "+.2f"),
                   "TTFT p99 ms": fmt(f.get("ttft_ms_p99"), ".1f"), "tok/s": fmt(f.get("tokens_per_second"), ".0f"),
                   "KV B/token": fmt(f.get("kv_bytes_per_token"), "d"),
                   "checked": (c["checked_at"] or "never")[:19]}
            for key, label, spec in columns:
                comp = comps.get(key)
                value = comp.get("estimate") if comp else (f.get("ttft_ms_p50") if key == "ttft_ms" else None)
                row[label] = fmt(value, spec)
                row[f"_{key}"] = comp.get("verdict") if comp else ""
                verdicts[label] = f"_{key}"
            if base_ppl is None and not c["baseline"] and not comps:
                row["checked"] = "no finished run"
            rows.append(row)
        df = pd.DataFrame(rows)
        empty = [label for label in verdicts if (df[label] == "—").all()]
        df = df.drop(columns=empty + [verdicts.pop(label) for label in empty])
        st.table(style_verdicts(df, verdicts).hide(axis="index"))
    st.caption("Cells are coloured by their threshold state: green ok, orange warn, red critical, grey inconclusive (CI-based verdicts), "
               "purple measurement error (a figure that cannot be right: the run is incomplete).")
