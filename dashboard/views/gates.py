"""Gates: the history of CI gate runs with their verdicts and links to the runs."""

from __future__ import annotations

import pandas as pd
import streamlit as st


def render(api, project: str, params) -> None:
    st.title("CI gates")
    gates = api.get(f"/projects/{project}/gates")
    if not gates:
        st.info("No gate has run yet. CI calls `canary gate …` (see deploy/ci/github-actions-gate.yml).")
        return
    colors = {"pass": "#c8e6c9", "warn": "#ffe0b2", "fail": "#ffcdd2", "error": "#ffcdd2"}
    table = pd.DataFrame([{"gate": gate["gate_id"], "verdict": gate["verdict"] or "pending",
                           "candidate": gate["candidate"], "baseline": gate["baseline"],
                           "run": f"?page=Run+detail&project={project}&run_id={gate['run_id']}",
                           "started": (gate["created_at"] or "")[:19], "decided": (gate["decided_at"] or "")[:19]}
                          for gate in gates])

    def shade(column):
        return [f"background-color: {colors.get(verdict, '')}" for verdict in column]

    st.dataframe(table.style.apply(shade, subset=["verdict"]),
                 hide_index=True, width="stretch",
                 column_config={"run": st.column_config.LinkColumn("run", display_text=r"run_id=(\d+)")})

