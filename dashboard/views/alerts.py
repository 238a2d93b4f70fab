"""Alerts: firing, pending and resolved, with history; create and expire silences (write key)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.views.common import fmt, human_time


def render(api, project: str, params) -> None:
    st.title("Alerts")
    alerts = api.get(f"/projects/{project}/alerts")
    show_inhibited = st.toggle("Show warn alerts inhibited by a critical one", value=False, key="inhibited")
    inhibited = [a for a in alerts if a.get("inhibited_by") is not None]
    for state in ("firing", "pending", "resolved"):
        rows = [a for a in alerts if a["state"] == state and (show_inhibited or a.get("inhibited_by") is None)]
        st.subheader(f"{state.capitalize()} ({len(rows)})")
        hidden = sum(a["state"] == state for a in inhibited)
        if hidden and not show_inhibited:
            st.caption(f"One alert per regression: {hidden} warn alert(s) hidden, inhibited by the critical alert "
                       "of the same config and metric.")
        if not rows:
            st.caption(f"No {state} alerts.")
            continue
        st.dataframe(pd.DataFrame([{"config": a["labels"].get("config"), "metric": a["labels"].get("metric"),
                                    "severity": a["severity"], "value": fmt(a["value"]),
                                    "since": human_time(a["fired_at"] or a["started_at"]),
                                    "resolved": human_time(a["resolved_at"], never=""), "run": a["run_id"],
                                    "escalation run": a.get("escalation_run_id") or "",
                                    "inhibited by": a.get("inhibited_by") or "",
                                    "rule": (a["annotations"] or {}).get("rule", "")} for a in rows]),
                     hide_index=True, width="stretch")
    st.subheader("Silences")
    silences = api.get(f"/projects/{project}/silences")
    if silences:
        st.dataframe(pd.DataFrame([{"id": s["id"], "matchers": ", ".join(f"{m['name']}{'=~' if m['isRegex'] == 'true' else '='}{m['value']}" for m in s["matchers"]),
                                    "until": s["ends_at"][:19], "author": s["author"], "comment": s["comment"]} for s in silences]),
                     hide_index=True, width="stretch")
    else:
        st.caption("No silences.")
    if not api.can_write:
        st.info("Creating or expiring a silence needs a write key: this dashboard runs with a read-only key "
                "(set CANARY_DASHBOARD_WRITE_KEY to allow it).")
        return
    with st.form("silence"):
        st.write("New silence")
        name = st.selectbox("Label", ["config", "metric", "model", "severity"])
        value = st.text_input("Value (regular expression)")
        hours = st.number_input("Hours", min_value=1, max_value=24 * 30, value=4)
        author = st.text_input("Author")
        comment = st.text_input("Comment")
        if st.form_submit_button("Create silence"):
            s = api.post(f"/projects/{project}/silences", {"matchers": [{"name": name, "value": value, "isRegex": True}],
                                                           "duration_minutes": int(hours) * 60, "author": author, "comment": comment})
            st.success(f"Silence {s['id']} created until {s['ends_at'][:19]}")
    active = [s for s in silences]
    if active:
        sid = st.selectbox("Expire silence", [s["id"] for s in active])
        if st.button("Expire now"):
            api.delete(f"/projects/{project}/silences/{sid}")
            st.success(f"Silence {sid} expired")
