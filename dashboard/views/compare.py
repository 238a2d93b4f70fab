"""Compare: one run's configs side by side — one row per config, worst first, each metric as
"% change [95% CI]" coloured by its threshold state — and the trade-off being decided: quality
lost (with its CI) against speed or memory gained."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.views.common import (
    COLOUR_KEY,
    VERDICT_MARKS,
    clock_time,
    label_offsets,
    samples_label,
    style_verdicts,
    y_domain,
)
from dashboard.views.overview import config_rows, frame, headline

if TYPE_CHECKING:
    from dashboard.client import Api

SYMLOG_TICKS = [-300, -100, -30, -10, -3, -1, 0, 1, 3, 10, 30, 100, 300, 1000, 3000]


def wide_spread(values: list[float], factor: float = 10.0) -> bool:
    """Changes whose largest magnitude is `factor` times the typical (median, at least 1 %): on a
    linear axis all but the largest would sit on one line."""
    known = sorted(abs(v) for v in values if v is not None and not math.isnan(v))
    return bool(known) and known[-1] >= factor * max(known[len(known) // 2], 1.0)


def render(api: Api, project: str, params: Mapping[str, str]) -> None:
    st.title("Compare configs")
    runs = [r for r in api.get(f"/projects/{project}/runs", limit=100) if r["status"] == "done"]
    if not runs:
        st.info("No finished runs yet.")
        return
    by_id = {r["run_id"]: r for r in runs}
    ids = list(by_id)
    asked = str(params.get("run_id", ""))
    def label(i: int) -> str:
        return f"run {i} · {by_id[i]['trigger']} · {by_id[i]['verdict']} · {clock_time(by_id[i]['created_at'])}"

    run_id = st.selectbox("Run", ids, index=ids.index(int(asked)) if asked.isdigit() and int(asked) in ids else 0,
                          key="compare_run", format_func=label)
    run = api.get(f"/projects/{project}/runs/{run_id}")
    if not run["comparisons"]:
        st.info("This run has no comparisons.")
        return
    suites = {s["id"]: s["name"] for s in api.get(f"/projects/{project}/suites")}
    suite = suites.get(run["suite_id"], "?")
    reused = (run["figures"].get(run["baseline"]) or {}).get("reused_from_run")
    st.caption(f"Suite {suite} · {samples_label(run)} · baseline {run['baseline']}"
               + (f" (its results reused from run {reused}: same model files, config, suite and samples)"
                  if reused else "") + f" · verdict {run['verdict']}")
    metrics = sorted((m for m in api.get("/metrics")["metrics"] if m["gated"]), key=lambda m: m["name"] != "ppl_ratio")
    configs = [{"config": c["config"], "baseline": c["config"] == run["baseline"], "run_id": run_id, "checked_at": None,
                "comparisons": {x["metric"]: x for x in run["comparisons"] if x["config"] == c["config"]},
                "figures": run["figures"].get(c["config"]) or {}} for c in run["configs"]]
    rows = config_rows(configs, metrics)
    # the answer first: which configs breach, by how much, grouped as the API's verdict summary groups them
    text, worst = headline(f"Run {run_id}", rows, metrics, run.get("summary"))
    {None: st.success, "warn": st.warning, "measurement_error": st.warning}.get(worst, st.error)(text)
    df, twins = frame(rows, metrics)
    st.table(style_verdicts(df.drop(columns=["checked"], errors="ignore"), twins).hide(axis="index"))
    st.caption(COLOUR_KEY)

    points = run.get("trade_off") or []  # the API's (app/summary.py trade_off_points)
    if len(points) >= 2:
        _trade_off(api, project, suite, points)


def _trade_off(api: Api, project: str, suite: str, points: list[dict]) -> None:
    """The run's configs as quality lost (ppl ratio, with its CI) against speed or memory gained,
    with the project's perplexity thresholds."""
    st.subheader("Quality lost vs speed and memory gained")
    axis = st.radio("Gain", ["speed gain ×", "memory saved %"], horizontal=True)
    x_field = "speed" if str(axis).startswith("speed") else "memory"
    pts = pd.DataFrame([p for p in points if p[x_field] is not None])
    thresholds = api.get(f"/projects/{project}/trends", metric="ppl_ratio", suite=suite, limit=1)["thresholds"]
    rule = next((r for r in thresholds if r["config"] is None), None)
    levels = [(lvl, (rule[lvl] - 1) * 100) for lvl in ("warn", "critical") if rule and rule.get(lvl) is not None]
    y_range = y_domain([*pts["loss_low"], *pts["loss_high"], *pts["loss"], *(v for _, v in levels)])
    spread = ("speed_low", "speed_high") if x_field == "speed" else (x_field,)
    x_range = y_domain([v for col in spread for v in pts[col]])
    # collapsed configs (+596 %) beside the ones that matter (a few %): a symmetric log axis, which
    # keeps 0 and negative changes, so that the small ones do not sit on top of each other at 0
    symlog = wide_spread(list(pts["loss"]))
    y_scale = alt.Scale(type="symlog", constant=1, domain=y_range) if symlog else alt.Scale(domain=y_range)
    x_scale = alt.Scale(domain=x_range)
    drawn = (lambda v: math.copysign(math.log1p(abs(v)), v)) if symlog else (lambda v: v)  # as the axis places it
    pts["dy"] = label_offsets(list(pts[x_field]), [drawn(v) for v in pts["loss"]], list(pts["config"]), x_range,
                              [drawn(v) for v in y_range])
    x = alt.X(f"{x_field}:Q", title=axis, scale=x_scale)
    # a symmetric log axis gets its ticks named: Vega's own are two or three for the whole range
    ticks = [v for v in SYMLOG_TICKS if y_range[0] <= v <= y_range[1]] if symlog else None
    y = alt.Y("loss:Q", title="quality loss: ppl ratio as % change" + (", symmetric log scale" if symlog else ""),
              scale=y_scale, axis=alt.Axis(values=ticks) if ticks else alt.Axis())
    colour = alt.Color("verdict:N", scale=alt.Scale(domain=[*VERDICT_MARKS, "baseline"],
                                                    range=[*VERDICT_MARKS.values(), "#000000"]))
    base = alt.Chart(pts)
    layers = [base.mark_rule(strokeWidth=2).encode(x=x, y=alt.Y("loss_low:Q", scale=y_scale), y2="loss_high:Q",
                                                   color=colour)]
    if x_field == "speed":  # horizontal CI bars; dashed where the speed comparison is inconclusive
        dash = alt.StrokeDash("speed_sure:N", legend=None,
                              scale=alt.Scale(domain=[True, False], range=[[1, 0], [4, 3]]))
        layers += [base.mark_rule(strokeWidth=2).encode(x=alt.X("speed_low:Q", scale=x_scale), x2="speed_high:Q", y=y,
                                                         color=colour, strokeDash=dash)]
    layers += [base.mark_point(size=140, filled=True).encode(
        x=x, y=y, color=colour, tooltip=["config", "loss", "loss_low", "loss_high", "speed", "speed_low", "speed_high",
                                         "memory", "verdict"],
        shape=alt.Shape("speed_sure:N", legend=alt.Legend(title="speed sure"),
                        scale=alt.Scale(domain=[True, False], range=["circle", "diamond"])))]
    for dy in sorted(set(pts["dy"])):  # Vega-Lite's dy is per mark, not per datum
        layers.append(alt.Chart(pts[pts["dy"] == dy]).mark_text(dy=dy, fontSize=12).encode(x=x, y=y, text="config"))
    for level, value in levels:
        line = alt.Chart(pd.DataFrame({"y": [value], "label": [f"{level} +{value:.1f}%"]}))
        layers += [line.mark_rule(strokeDash=[6, 4], color=VERDICT_MARKS[level])
                   .encode(y=alt.Y("y:Q", scale=y_scale)),
                   line.mark_text(align="left", dx=4, dy=-6, color=VERDICT_MARKS[level])
                   .encode(y=alt.Y("y:Q", scale=y_scale), x=alt.value(0), text="label")]
    st.altair_chart(alt.layer(*layers).properties(height=420), width="stretch")
    st.caption("Colour: the perplexity ratio's verdict. Vertical bars: 95% CI of the perplexity ratio; horizontal "
               "bars: 95% CI of the speed gain (1 / paired TPOT ratio), dashed and the point a diamond where that "
               "comparison is inconclusive. Dashed lines: the project's warn / critical thresholds. Memory = weight "
               "bytes + KV bytes for a 512-token context. Up is worse; right is the win.")
