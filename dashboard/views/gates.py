"""Gates: the history of CI gate runs with their verdicts and links to the runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import pandas as pd
import streamlit as st

from dashboard.views.common import human_time, parse_time

if TYPE_CHECKING:
    from dashboard.client import Api


def took(gate: dict) -> str:
    """From the gate's request to its verdict: "1 min 58 s", "42 s"; "" while pending."""
    start, end = parse_time(gate["created_at"]), parse_time(gate["decided_at"])
    if start is None or end is None:
        return ""
    seconds = round((end - start).total_seconds())
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def render(api: Api, project: str, params: Mapping[str, str]) -> None:
    st.title("CI gates")
    gates = api.get(f"/projects/{project}/gates")
    if not gates:
        st.info("No gate has run yet. CI calls `canary gate …` (see deploy/ci/github-actions-gate.yml).")
        return
    colors = {"pass": "#c8e6c9", "warn": "#ffe0b2", "fail": "#ffcdd2", "error": "#ffcdd2"}
    table = pd.DataFrame([{"gate": gate["gate_id"], "verdict": gate["verdict"] or "pending",
                           "candidate": gate["candidate"], "baseline": gate["baseline"],
                           "run": f"?page=Run+detail&project={project}&run_id={gate['run_id']}",
                           "started": human_time(gate["created_at"]), "took": took(gate)}
                          for gate in gates])
    latest = api.get(f"/projects/{project}/gates/{gates[0]['gate_id']}")  # newest first: the answer on top
    say = {"pass": st.success, "warn": st.warning}.get(latest["verdict"], st.error if latest["verdict"] else st.info)
    say(f"Latest gate {latest['gate_id']}: **{latest['verdict'] or 'pending'}** — {latest['candidate']} vs "
        f"{latest['baseline']}, {human_time(latest['created_at'])}" + (f": {latest['reason']}" if latest.get("reason")
                                                                        else ""))

    def shade(column: pd.Series) -> list[str]:
        return [f"background-color: {colors.get(verdict, '')}" for verdict in column]

    st.dataframe(table.style.apply(shade, subset=["verdict"]),
                 hide_index=True, width="stretch",
                 column_config={"run": st.column_config.LinkColumn("run", display_text=r"run_id=(\d+)")})

