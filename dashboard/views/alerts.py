"""Alerts: firing, pending and resolved, with history; create and expire silences (write key)."""

from __future__ import annotations

import pandas as pd
import streamlit as st


def render(api, project: str, params) -> None:
    st.title("Alerts")
    alerts = api.get(f"/projects/{project}/alerts")
    for state in ("firing", "pending", "resolved"):
        rows = [a for a in alerts if a["state"] == state]
        st.subheader(f"{state.capitalize()} ({len(rows)})")
        if not rows:
            st.caption(f"No {state} alerts.")
            continue
        st.dataframe(pd.DataFrame([{"config": a["labels"].get("config"), "metric": a["labels"].get("metric"), "severity": a["severity"],
                                    "value": a["value"], "since": (a["fired_at"] or a["started_at"] or "")[:19],
                                    "resolved": (a["resolved_at"] or "")[:19], "run": a["run_id"],
                                    "rule": (a["annotations"] or {}).get("rule", "")} for a in rows]), hide_index=True, width="stretch")
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
