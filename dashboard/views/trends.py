"""Trends: a metric over one suite's runs per config, with its 95% CI, the warn/critical
thresholds that apply to each config, and the alerts that fired (named by config)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import altair as alt
import pandas as pd
import streamlit as st

from dashboard.views.common import (
    CONFIG_COLORS,
    VERDICT_MARKS,
    catalogue,
    log_domain,
    metric_cell,
    spans_decades,
    y_domain,
)
from dashboard.views.overview import suite_choice

if TYPE_CHECKING:
    from dashboard.client import Api

SHAPES = {"ok": "circle", "inconclusive": "diamond", "warn": "triangle-up", "critical": "square",
          "measurement_error": "cross"}  # the verdict as a point's shape: colour is the config's


TREND_POINTS = 1000  # newest comparisons asked of the API: 30 runs of 30 configs (its default, 200, is 13 runs of 15)
ALERTS_LISTED = 8  # the newest alert marks listed under the chart by name


def threshold_lines(thresholds: list[dict], configs: list[str]) -> list[dict]:
    """One line per (rule, level): a rule scoped to a config is drawn for that config only (and
    only when it is shown); a project or model rule is drawn once, labelled 'all configs'."""
    lines = []
    for r in thresholds:
        if r["config"] is not None and r["config"] not in configs:
            continue
        for level in ("warn", "critical"):
            if r.get(level) is not None:
                lines.append({"y": r[level], "level": level, "config": r["config"] or "all configs",
                              "label": f"{r['config'] or 'all'} {level} {r[level]:g}"})
    return lines


def off_scale_bound(metric: dict, lines: list[dict], factor: float = 2.0) -> float | None:
    """For a ratio that is bad above its thresholds: `factor` × the highest threshold drawn (or
    × the seed critical). A point beyond it is off the scale; None where nothing bounds it."""
    if metric["unit"] != "ratio" or metric["direction"] != "above":
        return None
    levels = [line["y"] for line in lines] or [metric[k] for k in ("critical", "warn") if metric.get(k)]
    return factor * max(levels) if levels else None


PARITY = {"paired_ratio": 1.0, "paired_difference": 0.0}  # a comparison's value at no change


def near_threshold(pts: pd.DataFrame, metric: dict, lines: list[dict], bound: float | None) -> list[str]:
    """The configs Trends opens on: those whose newest point is on the scale (not beyond `bound`)
    and is judged other than ok, or whose CI's bad end has come at least halfway from parity to its
    warn threshold (the config's own line, else the project's, else the seed): where drift shows
    before it breaches. The collapsed ones (beyond `bound`) too, drawn apart as markers along the
    top. Every config where none on the scale is near, or where the metric has no parity or warn
    to measure against."""
    newest = pts.sort_values("run_id").groupby("config").tail(1)
    collapsed = newest[newest["estimate"] > bound] if bound is not None else newest.iloc[0:0]
    on_scale = newest.drop(collapsed.index)
    parity = PARITY.get(metric.get("comparison", ""))

    def warn_of(config: str) -> float | None:
        own = [line["y"] for line in lines if line["level"] == "warn" and line["config"] == config]
        shared = [line["y"] for line in lines if line["level"] == "warn" and line["config"] == "all configs"]
        return (own or shared or [metric.get("warn")])[0]

    def near(row: pd.Series) -> bool:
        warn = warn_of(row["config"])
        if parity is None or warn is None or row["verdict"] not in ("ok", None):
            return True
        above = metric["direction"] == "above"
        end = row["ci_high"] if above else row["ci_low"]
        end = row["estimate"] if end is None or end != end else end  # no CI: the estimate
        halfway = parity + (warn - parity) / 2
        return end >= halfway if above else end <= halfway

    picked = [row["config"] for _, row in on_scale.iterrows() if near(row)]
    return sorted([*picked, *collapsed["config"]]) if picked else sorted(newest["config"])


def axis_title(metric: dict) -> str:
    """The y axis in words: the catalogue's label and what its numbers are."""
    unit = {"ratio": "candidate ÷ baseline, 1 = parity", "fraction": "0–1", "ms": "milliseconds",
            "points": "rubric points"}.get(metric["unit"], metric["unit"])
    return f"{metric['label']} ({unit})"


def render(api: Api, project: str, params: Mapping[str, str]) -> None:
    st.title("Trends")
    top = st.columns([1, 1, 2])
    with top[0]:
        data = suite_choice(api, project, params, f"/projects/{project}/trends", metric="ppl_ratio", limit=TREND_POINTS)
    metrics = {m["name"]: m for m in catalogue(api)}
    metric = top[1].selectbox("Metric", list(metrics), key="metric",
                              format_func=lambda name: f"{metrics[name]['label']} ({name})")
    if metric != data["metric"]:
        data = api.get(f"/projects/{project}/trends", metric=metric, suite=data["suite"], limit=TREND_POINTS)
    pts = pd.DataFrame(data["points"])
    if pts.empty:
        st.info(f"No {metric} comparisons on suite {data['suite']} yet.")
        return
    all_configs = sorted(pts["config"].unique())
    # it opens on the configs near a threshold; the collapsed ones and those far inside stay a pick away
    near = near_threshold(pts, metrics[metric], threshold_lines(data["thresholds"], all_configs),
                          off_scale_bound(metrics[metric], threshold_lines(data["thresholds"], all_configs)))
    shown = top[2].multiselect("Configs", all_configs, default=near, key=f"configs-{data['suite']}-{metric}",
                               help="opens on the configs near a threshold: judged other than ok at their newest "
                                    "run, or with a CI halfway or more from parity to warn")
    pts = pts[pts["config"].isin(shown)]
    if pts.empty:
        st.info("Pick at least one config.")
        return
    pts["run"] = [f"#{r} {str(t)[5:16].replace('T', ' ')}" for r, t in zip(pts["run_id"], pts["at"], strict=True)]
    order = list(dict.fromkeys(pts.sort_values("run_id")["run"]))
    lines = threshold_lines(data["thresholds"], shown)
    # a collapsed config (7× its baseline) beside configs within a few % of theirs: its points go off
    # the scale, drawn as labelled markers along the top, so that the thresholds and the configs that
    # matter keep the axis (a log axis alone still squashes those onto one line)
    bound = off_scale_bound(metrics[metric], lines)
    off = pts[pts["estimate"] > bound] if bound is not None else pts.iloc[0:0]
    if len(off) == len(pts):  # only far-off points picked: their own scale
        off = pts.iloc[0:0]
    picked = pts  # every point of the shown configs, off-scale ones too (the run-against-run table)
    pts = pts.drop(off.index)
    values = [*pts["estimate"], *pts["ci_low"], *pts["ci_high"], *(x["y"] for x in lines)]
    # ratios that span decades (a collapsed config at 7× beside configs near 1) on a log axis: a linear
    # one would squash every config but the collapsed one onto a single line
    log = metrics[metric]["unit"] == "ratio" and spans_decades(values)
    scale = alt.Scale(type="log", domain=log_domain(values)) if log else alt.Scale(domain=y_domain(values))
    colour = alt.Color("config:N", scale=alt.Scale(domain=all_configs, range=CONFIG_COLORS[:len(all_configs)]),
                       legend=alt.Legend(columns=1 if len(all_configs) <= 12 else 2, symbolLimit=0, labelLimit=180))
    # a few runs' labels level; many slanted, and those that would still collide left out (greedy)
    x = alt.X("run:O", sort=order, title="run (id, UTC start)",
              axis=alt.Axis(labelAngle=0 if len(order) <= 8 else -40, labelOverlap="greedy", labelLimit=140))
    title = axis_title(metrics[metric]) + (", log scale" if log else "")
    y = alt.Y("estimate:Q", title=title, scale=scale)
    tooltip = ["config", "run_id", "at", "estimate", "ci_low", "ci_high", "n", "verdict"]
    base = alt.Chart(pts)
    ci = alt.Y("ci_low:Q", scale=scale, title=title)
    shape = alt.Shape("verdict:N", scale=alt.Scale(domain=list(SHAPES), range=list(SHAPES.values())))
    layers = [base.mark_rule(opacity=0.5, strokeWidth=2).encode(x=x, y=ci, y2="ci_high:Q", color=colour),
              base.mark_line().encode(x=x, y=y, color=colour),
              base.mark_point(size=90, filled=True).encode(x=x, y=y, color=colour, shape=shape, tooltip=tooltip)]
    # each line named at its end (its newest run), so that the legend need not be read colour by colour
    ends = pts.sort_values("run_id").groupby("config").tail(1).assign(end=lambda d: d["config"])
    layers.append(alt.Chart(ends).mark_text(align="left", dx=8, fontSize=11)
                  .encode(x=x, y=y, color=colour, text="end:N"))
    if not off.empty:
        layers += _off_scale_layers(off, x, scale, colour, tooltip)
    layers += _threshold_layers(lines, scale)
    named = _alerts_by_run(pd.DataFrame(data["alerts"]), pts, shown)
    if not named.empty:
        marks = alt.Chart(named)
        # a faint rule and a marker inside the top of the plot, the names in the tooltip and listed
        # under the chart: a label drawn on the chart would run across the axis or over its neighbours
        layers += [marks.mark_rule(color=VERDICT_MARKS["critical"], opacity=0.35, strokeWidth=3)
                   .encode(x=x, tooltip=["label"]),
                   marks.mark_point(shape="triangle-down", filled=True, size=110, color=VERDICT_MARKS["critical"])
                   .encode(x=x, y=alt.value(8), tooltip=["label"])]
    st.altair_chart(alt.layer(*layers).properties(height=420), width="stretch")
    if not named.empty:
        listed = list(zip(named["run"], named["label"], strict=True))
        left = len(listed) - ALERTS_LISTED
        earlier = f"  \n({left} earlier in the chart's tooltips)" if left > 0 else ""
        st.markdown("  \n".join(f"▼ run {run}: {label}" for run, label in listed[-ALERTS_LISTED:]) + earlier)
    _run_vs_run(picked, metrics[metric])
    st.caption(f"Suite {data['suite']} only. It opens on the configs near a threshold (judged other than ok at their "
               "newest run, or with a CI halfway or more from parity to warn) and the collapsed ones; pick others "
               "above. Points: the estimate, shaped by verdict (circle ok, diamond "
               "inconclusive, triangle warn, square critical, cross measurement error); vertical bars: 95% CI. "
               "Dashed: warn / critical thresholds, labelled by the config they apply to ('all': every config). "
               "Red verticals (▼): alerts that fired, listed above by run and config. ▲ along the top: a point off the "
               "scale (beyond twice the highest threshold), labelled with its value at the config's newest run.")


def _off_scale_layers(off: pd.DataFrame, x: alt.X, scale: alt.Scale, colour: alt.Color, tooltip: list[str]) -> list:
    """Points beyond the scale: a marker along the top at each, and one label per config at its
    newest run, the highest first, each a line below the one before."""
    top = scale.to_dict()["domain"][1]
    off = off.assign(top=top, label=[f"{c} {v:.3g} ↑" for c, v in zip(off["config"], off["estimate"], strict=True)])
    last = off.sort_values("run_id").groupby("config").tail(1).sort_values("estimate", ascending=False)
    layers = [alt.Chart(off).mark_point(shape="triangle-up", filled=True, size=110)
              .encode(x=x, y=alt.Y("top:Q", scale=scale), color=colour, tooltip=tooltip)]
    for i in range(len(last)):  # Vega-Lite's dy is per mark, not per datum
        layers.append(alt.Chart(last.iloc[i:i + 1]).mark_text(align="right", dx=-8, dy=10 + 13 * i, fontSize=11)
                      .encode(x=x, y=alt.Y("top:Q", scale=scale), color=colour, text="label"))
    return layers


def _threshold_layers(lines: list[dict], scale: alt.Scale) -> list:
    """One dashed rule and label per threshold, in the threshold's own colour (no second legend)."""
    layers = []
    for line in lines:
        one = alt.Chart(pd.DataFrame([line]))
        layers += [one.mark_rule(strokeDash=[6, 4], color=VERDICT_MARKS[line["level"]])
                   .encode(y=alt.Y("y:Q", scale=scale), tooltip=["label"]),
                   # critical's label above its line, warn's below: close thresholds keep both readable
                   one.mark_text(align="left", dx=4, dy=-6 if line["level"] == "critical" else 12, fontSize=11,
                                 color=VERDICT_MARKS[line["level"]])
                   .encode(y=alt.Y("y:Q", scale=scale), x=alt.value(0), text="label")]
    return layers


def _alerts_by_run(alerts: pd.DataFrame, pts: pd.DataFrame, shown: list[str]) -> pd.DataFrame:
    """One row per run of the chart that an alert of a shown config fired on: its label (`run`)
    and every config and severity that fired, named (`label`); empty when none did."""
    if not alerts.empty:
        alerts = alerts[alerts["config"].isin(shown) & alerts["run_id"].isin(pts["run_id"])]
    if alerts.empty:
        return pd.DataFrame(columns=["run_id", "run", "label"])
    labels = dict(zip(pts["run_id"], pts["run"], strict=False))
    named = (alerts.assign(what=[f"{c} {s}" for c, s in zip(alerts["config"], alerts["severity"], strict=True)])
             .groupby("run_id")["what"].agg(lambda w: ", ".join(sorted(set(w)))).reset_index())
    named["run"] = [labels[r] for r in named["run_id"]]
    named["label"] = "alert: " + named["what"]
    return named


def run_diff(pts: pd.DataFrame, a: int, b: int, cell: Callable[[pd.Series], str]) -> pd.DataFrame:
    """Run b against run a, per config both measured: each side's estimate with its CI and n (cell:
    how the metric is written, as on the other pages), the change b − a, and both verdicts; the configs
    whose verdict changed first, then by the size of the change."""
    one, two = (pts[pts["run_id"] == r].set_index("config") for r in (a, b))
    rows = []
    for config in sorted(set(one.index) & set(two.index)):
        x, y = one.loc[config], two.loc[config]
        change = y["estimate"] - x["estimate"] if pd.notna(x["estimate"]) and pd.notna(y["estimate"]) else None
        rows.append({"config": config, f"run {a}": f"{cell(x)} n={x['n']}", f"run {b}": f"{cell(y)} n={y['n']}",
                     "change": change, "verdict": f"{x['verdict']} → {y['verdict']}",
                     "_moved": x["verdict"] != y["verdict"]})
    rows.sort(key=lambda r: (not r["_moved"], -abs(r["change"] or 0.0)))
    return pd.DataFrame([{k: v for k, v in r.items() if k != "_moved"} for r in rows])


def _run_vs_run(pts: pd.DataFrame, metric: dict) -> None:
    """Two runs of the chart side by side: what changed between them, config by config."""
    runs = sorted(pts["run_id"].unique())
    if len(runs) < 2 or not st.toggle("Run against run", key="run_diff"):
        return
    left, right = st.columns(2)
    a = left.selectbox("From run", runs, index=len(runs) - 2, key="diff_a")
    b = right.selectbox("To run", runs, index=len(runs) - 1, key="diff_b")

    def cell(row: pd.Series) -> str:
        def known(v: Any) -> float | None:  # a pandas scalar (NaN where missing)
            return None if pd.isna(v) else float(v)
        return metric_cell(metric["unit"], metric["fmt"], *(known(row[k]) for k in ("estimate", "ci_low", "ci_high")))
    diff = run_diff(pts, int(a), int(b), cell)
    if diff.empty:
        st.caption(f"Runs {a} and {b} share no config on this metric.")
        return
    st.dataframe(diff, hide_index=True, width="stretch")
    st.caption(f"Run {b} against run {a}: each side's estimate [95% CI] and n, the change in the metric's own "
               "numbers, and the verdict before → after; configs whose verdict changed first.")
