"""Trends: a metric over time per config, with warn/critical bands and alert markers."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.views.common import catalogue


def render(api, project: str, params) -> None:
    st.title("Trends")
    metric = st.selectbox("Metric", [m["name"] for m in catalogue(api)], key="metric")
    data = api.get(f"/projects/{project}/trends", metric=metric)
    pts = pd.DataFrame(data["points"])
    if pts.empty:
        st.info(f"No {metric} comparisons yet.")
        return
    pts["at"] = pd.to_datetime(pts["at"])
    line = alt.Chart(pts).mark_line(point=True).encode(x=alt.X("at:T", title="run"), y=alt.Y("estimate:Q", title=metric, scale=alt.Scale(zero=False)),
                                                        color="config:N",
                                                        tooltip=["config", "run_id", "estimate", "ci_low", "ci_high", "verdict"])
    band = alt.Chart(pts).mark_area(opacity=0.15).encode(x=alt.X("at:T", title="run"), y=alt.Y("ci_low:Q", title=metric), y2="ci_high:Q",
                                                         color="config:N")
    layers = [band, line]
    project_rule = next((r for r in data["thresholds"] if r["config_id"] is None and r["model_id"] is None), None)
    if project_rule:
        for level, color in (("warn", "#ef6c00"), ("critical", "#c62828")):
            if project_rule.get(level) is not None:
                layers.append(alt.Chart(pd.DataFrame({"y": [project_rule[level]], "level": [level]}))
                              .mark_rule(strokeDash=[6, 4], color=color).encode(y=alt.Y("y:Q", title=metric), tooltip=["level", "y"]))
    alerts = pd.DataFrame(data["alerts"])
    if not alerts.empty:
        alerts["fired_at"] = pd.to_datetime(alerts["fired_at"])
        layers.append(alt.Chart(alerts).mark_rule(color="#c62828", opacity=0.5).encode(x=alt.X("fired_at:T", title="run"), tooltip=["config", "severity", "state"]))
    st.altair_chart(alt.layer(*layers), width="stretch")
    st.caption("Shaded: 95% CI. Dashed: project warn / critical thresholds. Red verticals: alerts firing.")
