"""Alerts: firing, pending and resolved, with history; create and expire silences (write key)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import pandas as pd
import streamlit as st

from dashboard.views.common import (
    catalogue,
    drop_empty_columns,
    fmt,
    human_time,
    metric_cell,
    parse_time,
    verdict_rank,
)

if TYPE_CHECKING:
    from dashboard.client import Api


def until(t: str) -> str:
    """A silence's end: "in 9 hours (16:42 UTC)"."""
    return f"{human_time(t)} ({parse_time(t):%H:%M} UTC)"


def resting_line(channel: dict) -> str:
    """A channel whose breaker is open: 'Channel ops (webhook) rests until 16:42:10 UTC (in 5 minutes): ...'."""
    times = channel.get("failed_in_a_row") or 1
    return (f"Channel {channel['name']} ({channel['kind']}) rests until "
            f"{parse_time(channel['resting_until']):%H:%M:%S} UTC ({human_time(channel['resting_until'])}): its "
            f"receiver failed or answered slowly {times} time{'s' if times != 1 else ''} in a row, so alerts to it "
            "wait (docs/runbooks.md, \"Webhook receiver down\").")


def stale_alert(schedule: dict) -> dict:
    """A stale schedule as a row of the firing list, shaped as the alerts API shapes one."""
    last = schedule.get("last_success_at")
    return {"labels": {"config": schedule["name"], "metric": "CanaryStale"}, "severity": "critical", "value": None,
            "state": "firing", "fired_at": last, "started_at": last, "resolved_at": None, "run_id": None,
            "annotations": {"rule": schedule["stale_reason"]}}


def incidents(alerts: list[dict], label: Callable[[dict], str], value: Callable[[dict], str]) -> list[dict]:
    """Firing alerts as incidents, Alertmanager's grouping by config and run: one row per (config, run)
    with every breaching metric inside, critical first (label: an alert's metric label; value: its
    value in the metric's unit), the earliest fire time, and the worst alert's runbook link."""
    by: dict[tuple, list[dict]] = {}
    for alert in alerts:
        by.setdefault((alert["labels"].get("config"), alert["run_id"]), []).append(alert)
    out = []
    for (config, run), group in by.items():
        group.sort(key=lambda a: (verdict_rank(a["severity"]), label(a)))  # an incident's worst first, and inside it
        since = min((a["fired_at"] or a["started_at"] or "" for a in group), default="")
        out.append({"config": config, "run": run, "severity": group[0]["severity"], "alerts": len(group),
                    "findings": "; ".join(f"{label(a)} {value(a)} {a['severity']}".replace("  ", " ").strip()
                                          for a in group),
                    "since": since, "runbook": (group[0]["annotations"] or {}).get("runbook_url", "")})
    out.sort(key=lambda row: (verdict_rank(row["severity"]), -row["alerts"], str(row["config"])))
    return out


def render(api: Api, project: str, params: Mapping[str, str]) -> None:
    st.title("Alerts")
    alerts = api.get(f"/projects/{project}/alerts")
    metrics = {m["name"]: m for m in catalogue(api)}

    def in_unit(alert: dict) -> str:  # in the metric's unit, as on the other pages: a ratio as % change
        metric = metrics.get(alert["labels"].get("metric"))
        return metric_cell(metric["unit"], metric["fmt"], alert["value"]) if metric else fmt(alert["value"])

    def label(alert: dict) -> str:  # the metric's label, as the other pages name it
        name = alert["labels"].get("metric", "")
        return metrics[name]["label"] if name in metrics else name

    # the canary itself (app/staleness.py): a schedule whose runs stopped succeeding fires CanaryStale
    # to the channels; here it leads the firing list, as on the overview it leads the page
    stale = [schedule for schedule in api.get(f"/projects/{project}/schedules") if schedule.get("stale")]
    for schedule in stale:
        st.error(f"The canary is stale: {schedule['stale_reason']}")
    # a channel whose receiver failed or answered slowly rests (app/notify.py's circuit breaker):
    # its alerts wait, so the page says so where the alerts are
    for channel in api.get(f"/projects/{project}/channels"):
        if channel.get("resting_until"):
            st.warning(resting_line(channel))
    show_inhibited = st.toggle("Show warn alerts inhibited by a critical one", value=False, key="inhibited")
    inhibited = [alert for alert in alerts if alert.get("inhibited_by") is not None]
    for state in ("firing", "pending", "resolved"):
        rows = [alert for alert in alerts
                if alert["state"] == state and (show_inhibited or alert.get("inhibited_by") is None)]
        if state == "firing":
            rows = [stale_alert(schedule) for schedule in stale] + rows
        st.subheader(f"{state.capitalize()} ({len(rows)})")
        hidden = sum(alert["state"] == state for alert in inhibited)
        if hidden and not show_inhibited:
            st.caption(f"One alert per regression: {hidden} warn alert(s) hidden, inhibited by the critical alert "
                       "of the same config and metric.")
        if not rows:
            st.caption(f"No {state} alerts.")
            continue
        if state == "firing":  # incidents first: one per config and run, every breaching metric inside
            found = incidents(rows, label, in_unit)
            links = all(row["runbook"].startswith(("http://", "https://")) for row in found if row["runbook"])
            st.caption(f"{len(found)} incident(s): one per config and run, its alerts critical first; "
                       "each alert below.")
            st.dataframe(pd.DataFrame([{**row, "since": human_time(row["since"] or None)} for row in found]),
                         hide_index=True, width="stretch",
                         column_config={"runbook": st.column_config.LinkColumn("runbook") if links
                                        else st.column_config.TextColumn("runbook")})
        st.dataframe(drop_empty_columns(pd.DataFrame([{
                                    "config": alert["labels"].get("config"), "metric": alert["labels"].get("metric"),
                                    "severity": alert["severity"], "value": in_unit(alert),
                                    "since": human_time(alert["fired_at"] or alert["started_at"]),
                                    "resolved": human_time(alert["resolved_at"], never=""), "run": alert["run_id"],
                                    "escalation run": alert.get("escalation_run_id") or "",
                                    "inhibited by": alert.get("inhibited_by") or "",
                                    "rule": (alert["annotations"] or {}).get("rule", "")} for alert in rows])),
                     hide_index=True, width="stretch")
    st.subheader("Silences")
    silences = api.get(f"/projects/{project}/silences")
    if silences:
        st.dataframe(pd.DataFrame([{"id": silence["id"], "matchers": _matchers(silence["matchers"]),
                                    "until": until(silence["ends_at"]), "author": silence["author"],
                                    "comment": silence["comment"]} for silence in silences]),
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
            silence = api.post(f"/projects/{project}/silences",
                               {"matchers": [{"name": name, "value": value, "isRegex": True}],
                                "duration_minutes": int(hours) * 60, "author": author, "comment": comment})
            st.success(f"Silence {silence['id']} created, ends {until(silence['ends_at'])}")
    active = list(silences)
    if active:
        silence_id = st.selectbox("Expire silence", [silence["id"] for silence in active])
        if st.button("Expire now"):
            api.delete(f"/projects/{project}/silences/{silence_id}")
            st.success(f"Silence {silence_id} expired")


def _matchers(matchers: list[dict]) -> str:
    """Alertmanager's way to write them: name=value, or name=~value for a regular expression."""
    return ", ".join(f"{matcher['name']}{'=~' if matcher['isRegex'] == 'true' else '='}{matcher['value']}"
                     for matcher in matchers)
