"""Overview: on one suite, which config regressed, by how much, how surely and since when — per
model, one row per config, worst first, each metric as "% change [95% CI]" coloured by its
threshold state."""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING

import pandas as pd
import streamlit as st

from dashboard.views.card import card_html, check_times, model_tiles
from dashboard.views.common import (
    BREACHING,
    COLOUR_KEY,
    fmt,
    human_time,
    judged_verdict,
    keep_ci_whole,
    metric_cell,
    pct_change,
    sparkline,
    style_verdicts,
    worst_first,
    worst_verdict,
)

if TYPE_CHECKING:
    from dashboard.client import Api


def suite_choice(api: Api, project: str, params: Mapping[str, str], path: str, **query: str | int) -> dict:
    """Read `path` for the suite chosen on the page (or ?suite=, else the API's default: the
    scheduled suite) and draw the suite selector; returns the API's answer for that suite."""
    asked = st.session_state.get("suite") or params.get("suite")
    data = api.get(path, suite=asked, **query)
    suites = data["suites"] or ([data["suite"]] if data["suite"] else [])
    if suites:
        st.selectbox("Suite", suites, index=suites.index(data["suite"]) if data["suite"] in suites else 0, key="suite",
                     help="Only runs of this suite are shown: a smoke gate never mixes with the daily suite.")
    return data


def config_rows(configs: list[dict], metrics: list[dict], now: datetime | None = None) -> list[dict]:
    """One row per config (worst first) with a text cell and a verdict per gated metric."""
    rows = []
    for c in configs:
        comps, f = c["comparisons"], c["figures"]
        gated = [comps[m["name"]] for m in metrics if m["name"] in comps]
        verdict = worst_verdict(judged_verdict(x) for x in gated)
        ppl = comps.get("ppl_ratio") or {}
        docs = ppl.get("n")
        prompts = max((comps[m["name"]]["n"] for m in metrics if m["producer"] == "generation" and m["name"] in comps
                       and m["comparison"] != "peak"), default=None)  # a peak is one reading, not n prompts
        breach = c.get("breaching_metric")
        row = {"config": c["config"] + (" (baseline)" if c["baseline"] else ""), "baseline": c["baseline"],
               "verdict": verdict or ("not measured" if c["run_id"] is None else ""), "ppl_ratio": ppl.get("estimate"),
               "breaching since": (f"{human_time(c['breaching_since'], now)} ({_label(metrics, breach)})"
                                   if breach and c.get("breaching_since") else ""),
               "cells": {}, "n docs / prompts": sample_counts(docs, prompts),
               "ppl trend": sparkline([p["estimate"] for p in c.get("ppl_history") or []])
               if len(c.get("ppl_history") or []) > 1 else "",
               "tok/s": fmt(f.get("tokens_per_second"), ".0f"), "KV B/token": fmt(f.get("kv_bytes_per_token"), "d"),
               "checked": human_time(c["checked_at"], now, never="never")
               + (" (edited since)" if c.get("edited_since_checked") else "")}
        for m in metrics:
            comp = comps.get(m["name"])
            ci = ("ci_low", "ci_high") if m["comparison"] != "peak" else ()  # a peak has no CI: one reading
            text = metric_cell(m["unit"], m["fmt"], *(comp.get(k) for k in ("estimate", *ci))) if comp else "—"
            row["cells"][m["label"]] = (text, judged_verdict(comp) if comp else "")
        rows.append(row)
    return worst_first(rows)


def edited_line(configs: list[dict]) -> str | None:
    """The configs edited in place since the run that stands for them (the API's
    edited_since_checked): their row describes the earlier definition until a run measures them."""
    names = [c["config"] for c in configs if c.get("edited_since_checked")]
    if not names:
        return None
    many = len(names) > 1
    return (f"{', '.join(names)} {'were' if many else 'was'} edited after {'their' if many else 'its'} last run: "
            f"{'their rows describe' if many else 'its row describes'} the earlier definition. Run "
            f"{'them' if many else 'it'} again to measure the config as it is now.")


def sample_counts(docs: int | None, prompts: int | None) -> str:
    """The documents and prompts behind a row's figures in one narrow column: "12 / 10"."""
    return "—" if docs is None and prompts is None else f"{fmt(docs, 'd')} / {fmt(prompts, 'd')}"


def _label(metrics: list[dict], name: str | None) -> str:
    return next((m["label"] for m in metrics if m["name"] == name), name or "")


def frame(rows: list[dict], metrics: list[dict]) -> tuple[pd.DataFrame, dict[str, str]]:
    """The table as shown (columns empty throughout, or judged on no row, left out) and its verdict
    twins for colouring."""
    table, twins = [], {"verdict": "_verdict"}
    for r in rows:
        out = {"config": r["config"], "verdict": r["verdict"], "_verdict": r["verdict"],
               "breaching since": r["breaching since"]}
        for label, (text, verdict) in r["cells"].items():
            out[label], out[f"_{label}"] = keep_ci_whole(text), verdict
            twins[label] = f"_{label}"
        for k in ("n docs / prompts", "ppl trend", "tok/s", "KV B/token", "checked"):
            out[k] = r[k]
        table.append(out)
    df = pd.DataFrame(table)
    empty = [c for c in df.columns if not c.startswith("_") and df[c].isin(["—", ""]).all()]
    # a metric reported on every row but judged on none (faithfulness by the offline approximation:
    # 0 % [0, 0] on each row, the baseline's too) is not a column; the card names it "not judged"
    empty += [label for label, twin in twins.items() if label != "verdict" and label not in empty
              and (df[twin] == "").all()]
    for c in empty:
        if c in twins:
            df = df.drop(columns=[twins.pop(c)])
    return df.drop(columns=empty), twins


SUMMARY_GROUPS = ("drop or fix", "watch", "slower than the baseline")  # the API's verdict summary, breaching groups


def headline(model: str, rows: list[dict], metrics: list[dict], summary: dict | None = None) -> tuple[str, str | None]:
    """The answer first: which configs breach, on what, by how much and since when. With the API's
    verdict summary (app/summary.py), its lines as every surface prints them, a config's line
    followed by since when it breaches; else one line."""
    bad = [r for r in rows if r["verdict"] in BREACHING or r["verdict"] == "measurement_error"]
    worst = worst_verdict(r["verdict"] for r in bad) if bad else None
    if summary and summary.get("lines"):
        return _grouped(model, rows, summary), worst
    if not bad:
        measured = [r for r in rows if not r["baseline"] and r["verdict"] not in ("", "not measured")]
        unsure = [r["config"] for r in measured if r["verdict"] == "inconclusive"]
        text = f"{model}: no config breaches a threshold" + (f" ({', '.join(unsure)} inconclusive)" if unsure else "")
        return text, None
    parts = []
    for r in bad:
        cells = [(label, text) for label, (text, v) in r["cells"].items() if v == r["verdict"]]
        what = ", ".join(f"{label} {text}" for label, text in cells[:2])
        since = f", since {r['breaching since'].split(' (')[0]}" if r["breaching since"] else ""
        parts.append(f"**{r['config']}** {r['verdict']} ({what}{since})")
    return f"{model}: " + "; ".join(parts), worst


def _grouped(model: str, rows: list[dict], summary: dict) -> str:
    """The banner: a count, then the summary's lines as printed, in Markdown: '*Group (n):*',
    '• **config**: finding; finding (since …)', the command that decides the undecided ones as
    code. Escaped: a config's name is the user's."""
    by_config = {r["config"]: r for r in rows}
    total = sum(len(summary["groups"].get(g) or []) for g in SUMMARY_GROUPS)
    out = [f"{model}: {total} config{'s' if total != 1 else ''} to act on" if total
           else f"{model}: no config breaches a threshold"]
    for line in summary["lines"]:
        if line.startswith("  decide: canary "):  # the command as code, what it says of itself as text
            command, _, why = line.removeprefix("  decide: ").partition(" (")
            out.append(f"decide: `{command}`" + (f" ({_md(why)}" if why else ""))
        elif line.startswith("  decide: "):  # no command: what would decide them, in words
            out.append(_md(line.strip()))
        elif line.startswith("  "):
            config, _, rest = line.strip().partition(": ")
            row = by_config.get(config) or {"breaching since": ""}
            since = f" (since {row['breaching since'].split(' (')[0]})" if row["breaching since"] else ""
            out.append(f"• **{_md(config)}**" + (f": {_md(rest)}" if rest else "") + since)
        elif line.endswith(":"):
            out.append(f"*{_md(line[0].upper() + line[1:-1])}:*")
        else:
            out.append(_md(line))
    return "  \n".join(out)


def _md(text: str) -> str:
    """Text shown as itself in Streamlit's Markdown: emphasis, code, HTML and LaTeX characters escaped
    (a config's name is the user's); brackets stay, as no parenthesis follows them to make a link."""
    return re.sub(r"([\\`*$<~])", r"\\\1", text)


def stale_banner(api: Api, project: str) -> None:
    """The canary itself: a schedule whose runs stopped succeeding makes every verdict below old."""
    for schedule in api.get(f"/projects/{project}/schedules"):
        if schedule.get("stale"):
            st.error(f"The canary is stale: {schedule['stale_reason']} The verdicts on this page may be out of date.")


def render(api: Api, project: str, params: Mapping[str, str]) -> None:
    st.title("Inference quality overview")
    stale_banner(api, project)
    with st.columns([2, 2])[0]:
        data = suite_choice(api, project, params, f"/projects/{project}/overview")
    if not data["models"]:
        st.info("No models in this project yet.")
        return
    # the gated metrics of the catalogue, the perplexity ratio first
    catalogue_ = api.get("/metrics")["metrics"]
    metrics = sorted((m for m in catalogue_ if m["gated"]), key=lambda m: m["name"] != "ppl_ratio")
    for model, configs in data["models"].items():
        rows = config_rows(configs, metrics)
        base = next((c for c in configs if c["baseline"]), None)
        ppl = next((c["comparisons"]["ppl_ratio"] for c in configs if "ppl_ratio" in c["comparisons"]), None)
        st.subheader(f"Model {model}")
        text, worst = headline(model, rows, metrics, (data.get("summaries") or {}).get(model))
        {None: st.success, "warn": st.warning, "measurement_error": st.warning}.get(worst, st.error)(text)
        edited = edited_line(configs)  # under the verdict it qualifies: those rows describe an earlier definition
        if edited:
            st.warning(edited)
        st.markdown(card_html(model_tiles(configs, catalogue_), *check_times(configs, data["next_check_at"])),
                    unsafe_allow_html=True)
        if base and ppl:
            st.caption(f"Baseline {base['config']}: domain perplexity {fmt(ppl['baseline_value'], '.3f')} on suite "
                       f"{data['suite']} (n = {ppl['n']} documents). Ratios are shown as % change against it.")
        df, twins = frame(rows, metrics)
        st.table(style_verdicts(df, twins).hide(axis="index"))
    st.caption(f"{COLOUR_KEY} Tiles: per model, the config doing worst on each figure (named), with its state in "
               "words. Table: one row per config, worst first. Ratios as % change vs the baseline; rates as %. ppl "
               f"trend: the perplexity ratio over the suite's recent runs, oldest first; {pct_change(1.0)} is parity.")
