"""Every dashboard page under Streamlit's AppTest, against the seeded API over real HTTP:
what each page shows is checked against the API's own figures; empty states and API errors are
shown as messages, never as a stack trace."""

from __future__ import annotations

import re

import httpx
import pandas as pd
import pytest
from dashboard.views.common import doc_ppl_ratio, human_time, keep_ci_whole, pct_change, verdict_rank
from streamlit.testing.v1 import AppTest
from vocabulary.metrics import METRICS, format_estimate

from tests.conftest import ROOT
from tests.e2e.conftest import SMOKE

APP = str(ROOT / "dashboard/app.py")


def page(seeded_api, monkeypatch, name: str, **env) -> AppTest:
    monkeypatch.setenv("CANARY_API_URL", seeded_api["url"])
    monkeypatch.delenv("CANARY_DASHBOARD_WRITE_KEY", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, at.exception
    if name != "Overview":
        at.sidebar.radio[0].set_value(name).run()
    assert not at.exception, at.exception
    return at


def frames(at) -> list:
    return [d.value for d in at.dataframe]


def api(seeded_api, path: str, **params):
    import httpx

    r = httpx.get(f"{seeded_api['url']}/api/v1/projects/dash{path}", params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def suite_runs(seeded_api) -> dict[str, set[int]]:
    """Run ids by suite name, from the API's own run records."""
    ids = {s["id"]: s["name"] for s in api(seeded_api, "/suites")}
    out: dict[str, set[int]] = {}
    for r in api(seeded_api, "/runs"):
        out.setdefault(ids[api(seeded_api, f"/runs/{r['run_id']}")["suite_id"]], set()).add(r["run_id"])
    return out


def test_overview_and_trends_never_mix_suites(seeded_api):
    """The smoke suite ran last, yet the default is the scheduled suite; each view's figures come
    from its suite's runs only, and an unknown suite is a 404 naming the project's suites."""
    runs = suite_runs(seeded_api)
    assert runs.keys() == {"s", SMOKE}
    daily = api(seeded_api, "/overview")
    assert daily["suite"] == "s" and daily["suites"] == ["s", SMOKE] and daily["next_check_at"]
    assert {c["run_id"] for c in daily["models"]["tiny"]} <= runs["s"]
    smoke = api(seeded_api, "/overview", suite=SMOKE)
    measured = {c["config"]: c for c in smoke["models"]["tiny"] if c["run_id"] is not None}
    assert set(measured) == {"fp32", "int8"} and {c["run_id"] for c in measured.values()} <= runs[SMOKE]
    assert set(measured["int8"]["comparisons"]) == {"ppl_ratio"}  # the smoke suite scores perplexity only
    assert smoke["next_check_at"] is None  # no schedule runs the smoke suite
    for suite in ("s", SMOKE):
        points = api(seeded_api, "/trends", metric="ppl_ratio", suite=suite)["points"]
        assert points and {p["run_id"] for p in points} <= runs[suite]
    assert api(seeded_api, "/trends")["suite"] == "s"
    import httpx

    r = httpx.get(f"{seeded_api['url']}/api/v1/projects/dash/overview", params={"suite": "nightly"})
    assert r.status_code == 404 and "suites: s, smoke" in r.text


def test_overview_lists_the_critical_config_first_with_its_ci(seeded_api, monkeypatch):
    at = page(seeded_api, monkeypatch, "Overview")
    assert at.title[0].value == "Inference quality overview"
    assert at.selectbox(key="suite").value == "s"  # the scheduled suite, although smoke ran last
    over = api(seeded_api, "/overview")
    int2 = next(c for c in over["models"]["tiny"] if c["config"] == "int2")
    ppl = int2["comparisons"]["ppl_ratio"]
    assert ppl["verdict"] == "critical"
    df = at.table[0].value  # an HTML table, coloured by verdict
    assert df["config"].iloc[0] == "int2" and df["config"].iloc[-1] == "fp32 (baseline)"
    assert list(df["verdict"])[:2] == ["critical", "critical"]  # int2, then spec-ngram (acceptance), by ppl ratio
    row, cell = df.iloc[0], pct_change(ppl["estimate"], ppl["ci_low"], ppl["ci_high"])  # "+5.8% [+4.4, +8.7]"
    assert row["ppl ratio"] == keep_ci_whole(cell)  # no-break spaces inside the CI
    assert list(df.columns[:4]) == ["config", "verdict", "breaching since", "ppl ratio"]  # ppl ratio first
    assert row["breaching since"] == f"{human_time(int2['breaching_since'])} (ppl ratio)"
    prompts = int2["comparisons"]["ttft_ms"]["n"]  # the generation comparisons' prompts
    assert row["n docs / prompts"] == f"{ppl['n']} / {prompts}"
    assert "lossless EM" in df.columns and "judge win" not in df.columns  # no judge in the suite: left out
    # above it all, the seeded schedule's staleness (tests/e2e/conftest.py), then the model's headline
    stale, headline = (e.value for e in at.error[:2])
    assert stale.startswith("The canary is stale: schedule 'daily' (0 6 * * *) of project 'dash'")
    # the headline names it with its CI, in the words of every surface (app/summary.py)
    said = over["summaries"]["tiny"]["groups"]["drop or fix"][0]
    assert said["config"] == "int2" and f"• **int2**: {said['findings']} (since " in headline
    # the card under the banner: a tile per headline figure, from the configs' latest runs of the suite
    card = next(m.value for m in at.markdown if "canary-card" in m.value)
    tiles = {title: state for state, title in
             re.findall(r'data-state="([^"]+)"[^>]*><div class="t">([^<]+)</div>', card)}
    # domain PPL: int2's ratio, the worst of the three candidates, critical, against the baseline's perplexity
    assert tiles["domain PPL"] == "critical" and cell.split(" [")[0] in card and "int2, worst of 3 on ppl ratio" in card
    assert f"baseline fp32 PPL {ppl['baseline_value']:.2f}" in card
    # acceptance: only spec-ngram decodes speculatively; its rate as a whole % and its verdict
    spec = next(c for c in over["models"]["tiny"] if c["config"] == "spec-ngram")["comparisons"]
    accept = spec["spec_acceptance_rate"]
    assert tiles["spec-decode acceptance"] == accept["verdict"] == "critical"
    shown = re.sub(r"<[^>]+>", "", card)  # the card's text, as a reader sees it
    assert f"{accept['estimate'] * 100:.0f}% [{accept['ci_low'] * 100:.0f}, {accept['ci_high'] * 100:.0f}]" in shown
    # no judge in the suite and no KV config decoded: named, no figure
    assert tiles["no data"] == "no data" and ">judge score, KV cache by decode<" in card
    # faithfulness by the offline approximation (no judge endpoint): reported, never judged, so never "ok"
    faith = [c["comparisons"]["faithfulness"] for c in over["models"]["tiny"]]
    assert not any(f["judged"] for f in faith) and ppl["judged"]
    assert tiles["faithfulness"] == "not judged" and "offline approximation" in card
    assert "faithful" not in df.columns  # judged on no row: no column of 0 % [0, 0]
    assert {"TTFT p50 / p99", "throughput", "KV-cache usage"} <= set(tiles)
    # the field signals (docs/scorers.md) have tiles too: each the worst verdict the API gave on its metrics
    configs = over["models"]["tiny"]
    for title, names in (("lossless outputs", ("confident_divergence", "lossless_exact_match", "batch_divergence")),
                         ("generation health", ("empty_answers", "degenerate_answers", "max_tokens_hits",
                                                "output_length_ratio")),
                         ("task accuracy", ("task_recovery", "task_flips"))):
        cells = [c["comparisons"][n] for c in configs for n in names if n in c["comparisons"]]
        assert cells, title  # the seeded suite generates, and spec-ngram is lossless
        worst = min((x["verdict"] for x in cells if x["judged"]), key=verdict_rank)  # 0 = critical
        assert tiles[title] == worst, (title, tiles[title], worst)
    assert "confident div." in card or "lossless EM" in card
    # the labelled items (24 of the built-in task): each candidate's accuracy against the baseline's, as % in the tile
    recovery = {c["config"]: c["comparisons"]["task_recovery"] for c in configs if "task_recovery" in c["comparisons"]}
    assert set(recovery) == {"int8", "int2", "spec-ngram"} and all(r["n"] == 24 for r in recovery.values())
    assert re.search(r"accuracy \d+% → \d+% \((int8|int2|spec-ngram)\)", shown)
    # the distribution signals': the next-token KLD of the candidate furthest from the baseline's distributions (int2, the
    # broken one), reported without a threshold; no KV config in the suite, so nothing decoded
    klds = {c["config"]: c["comparisons"]["kld_mean"]["estimate"] for c in configs if "kld_mean" in c["comparisons"]}
    assert set(klds) == {"int8", "int2", "spec-ngram"} and max(klds, key=klds.__getitem__) == "int2"
    assert tiles["next-token KLD"] == "not judged" and f"{klds['int2']:.5f}" in shown and "int2, worst of 3 on KLD" in shown
    assert "KV cache by decode" in shown.split("no data", 1)[1]  # named under no data
    last, nxt = re.search(r"last <b>([^<]+)</b>.*?next <b>([^<]+)</b>", card).groups()
    assert last.endswith("ago") or last == "just now"
    assert nxt.startswith("in ")  # the daily schedule's next slot, in human time

    at.selectbox(key="suite").set_value(SMOKE).run()
    df = at.table[0].value
    smoke = api(seeded_api, "/overview", suite=SMOKE)
    int8 = next(c for c in smoke["models"]["tiny"] if c["config"] == "int8")["comparisons"]["ppl_ratio"]
    cell = pct_change(int8["estimate"], int8["ci_low"], int8["ci_high"])
    assert df[df["config"] == "int8"].iloc[0]["ppl ratio"] == keep_ci_whole(cell)
    assert set(df[df["verdict"] == "not measured"]["config"]) == {"int2", "spec-ngram"}
    assert "next <b>not scheduled</b>" in next(m.value for m in at.markdown if "canary-card" in m.value)


def chart_data(at) -> list:
    """The data frames behind the page's Altair charts (Arrow IPC in the chart's message)."""
    import pyarrow as pa

    return [pa.ipc.open_stream(d.data.data).read_all().to_pandas()
            for chart in at.get("vega_lite_chart") for d in chart.proto.datasets]


def test_trends_one_suite_named_alerts_config_filter_and_empty_state(seeded_api, monkeypatch):
    runs = suite_runs(seeded_api)
    at = page(seeded_api, monkeypatch, "Trends")
    assert not at.info and at.selectbox(key="suite").value == "s"
    # it opens on the configs near a threshold (dashboard/views/trends.near_threshold, worked by hand in
    # tests/unit/test_dashboard_format.py); then every config is picked
    from dashboard.views.trends import near_threshold, off_scale_bound, threshold_lines

    picker = at.multiselect(key="configs-s-ppl_ratio")
    trend = api(seeded_api, "/trends", metric="ppl_ratio", suite="s", limit=1000)
    metric = next(m for m in httpx.get(f"{seeded_api['url']}/api/v1/metrics").json()["metrics"]
                  if m["name"] == "ppl_ratio")
    every = sorted({p["config"] for p in trend["points"]})
    lines = threshold_lines(trend["thresholds"], every)
    assert picker.value == near_threshold(pd.DataFrame(trend["points"]), metric, lines, off_scale_bound(metric, lines))
    picker.set_value(every).run()
    frames_ = chart_data(at)
    points = next(f for f in frames_ if "estimate" in f.columns)
    assert set(points["run_id"]) <= runs["s"] and {"int2", "int8"} <= set(points["config"])
    alerts = next(f for f in frames_ if "label" in f.columns and f["label"].str.startswith("alert: ").all())
    assert any("int2 critical" in label for label in alerts["label"])  # the marker names its config
    lines = [f for f in frames_ if "level" in f.columns]
    assert {"all warn 1.01", "all critical 1.03"} <= {x for f in lines for x in f["label"]}
    ends = next(f for f in frames_ if "end" in f.columns)  # each line named at its newest run
    assert sorted(ends["end"]) == sorted(points["config"].unique())
    assert all(ends.loc[ends["end"] == c, "run_id"].iloc[0] == points.loc[points["config"] == c, "run_id"].max()
               for c in ends["end"])
    # run against run: the two newest runs, config by config
    at.toggle(key="run_diff").set_value(True).run()
    diff = next(df for df in frames(at) if "verdict" in df.columns and "change" in df.columns)
    newest = sorted(points["run_id"].unique())[-2:]
    assert list(diff.columns) == ["config", f"run {newest[0]}", f"run {newest[1]}", "change", "verdict"]
    assert set(diff["config"]) <= set(points["config"]) and len(diff) >= 1
    at.toggle(key="run_diff").set_value(False).run()
    # the config filter: only int8 is drawn
    at.multiselect(key="configs-s-ppl_ratio").set_value(["int8"]).run()
    points = next(f for f in chart_data(at) if "estimate" in f.columns)
    assert set(points["config"]) == {"int8"}
    # suite B: only its own runs, never a point of suite A
    at.selectbox(key="suite").set_value(SMOKE).run()
    points = next(f for f in chart_data(at) if "estimate" in f.columns)
    assert set(points["run_id"]) <= runs[SMOKE] and set(points["config"]) == {"int8"}
    spec = at.get("vega_lite_chart")[0].proto.spec
    import json

    low, high = json.loads(spec)["layer"][0]["encoding"]["y"]["scale"]["domain"]
    assert high - low < 0.1 and low < points["estimate"].iloc[0] < high  # one point: an axis around it, not ".309"s
    at.selectbox(key="metric").set_value("judge_win_rate").run()  # no judge in either seeded suite
    assert "No judge_win_rate comparisons on suite smoke yet." in at.info[0].value


def test_compare_one_row_per_config_worst_first_and_the_trade_off(seeded_api, monkeypatch):
    at = page(seeded_api, monkeypatch, "Compare")
    first = min(r["run_id"] for r in api(seeded_api, "/runs"))
    at.selectbox(key="compare_run").set_value(first).run()
    df = at.table[0].value
    assert list(df["config"]) == ["int2", "spec-ngram", "int8", "fp32 (baseline)"]  # worst first
    run = api(seeded_api, f"/runs/{first}")
    ppl = next(c for c in run["comparisons"] if c["config"] == "int2" and c["metric"] == "ppl_ratio")
    assert df.iloc[0]["ppl ratio"] == keep_ci_whole(pct_change(ppl["estimate"], ppl["ci_low"], ppl["ci_high"]))
    # the answer above the table: the run's breaching configs, the worst first, with the figure and its CI
    # grouped as the API's verdict summary groups it (app/summary.py), a line per config
    banner = at.error[0].value.split("  \n")
    cells = (ppl["estimate"], ppl["ci_low"], ppl["ci_high"])  # as every surface prints it (app/summary.py)
    assert banner[:3] == [f"Run {first}: 2 configs to act on", "*Drop or fix (1):*",
                          f"• **int2**: ppl ratio {format_estimate(METRICS['ppl_ratio'], *cells)} critical"], banner
    assert banner[3] == "*Slower than the baseline (1):*" and banner[4].startswith("• **spec-ngram**: accept ")
    assert at.subheader[0].value == "Quality lost vs speed and memory gained"
    data = chart_data(at)
    points = next(f for f in data if "loss" in f.columns and "dy" in f.columns and len(f) == 4)
    base = points[points["verdict"] == "baseline"].iloc[0]
    assert (base["loss"], base["speed"]) == (0.0, 1.0)  # the baseline point at the origin
    int2 = points[points["config"] == "int2"].iloc[0]
    assert int2["loss_low"] == pytest.approx((ppl["ci_low"] - 1) * 100)  # the error bar is the CI
    labels = {tuple(r) for r in points[["speed", "loss", "dy"]].itertuples(index=False)}
    assert len(labels) == 4  # no two labels at the same place
    assert {"warn +1.0%", "critical +3.0%"} <= {x for f in data if "label" in f.columns for x in f["label"]}


def test_compare_says_when_a_gates_baseline_was_reused(seeded_api, monkeypatch):
    """The seeded gate runs suite s on the seeded run's samples: its baseline takes that run's rows."""
    first = min(r["run_id"] for r in api(seeded_api, "/runs"))
    gate_run = seeded_api["gate"]["run_id"]
    assert api(seeded_api, f"/runs/{gate_run}")["figures"]["fp32"]["reused_from_run"] == first
    at = page(seeded_api, monkeypatch, "Compare")
    at.selectbox(key="compare_run").set_value(gate_run).run()
    assert any(f"baseline fp32 (its results reused from run {first}:" in c.value for c in at.caption)
    at.selectbox(key="compare_run").set_value(first).run()
    assert not any("reused" in c.value for c in at.caption)


def test_alerts_history_and_read_only_silences(seeded_api, monkeypatch):
    at = page(seeded_api, monkeypatch, "Alerts")
    heads = [s.value for s in at.subheader]
    assert any(h.startswith("Firing (") for h in heads) and "Silences" in heads
    assert any("int8" in str(df.to_dict()) for df in frames(at))  # the seeded silence
    assert any("needs a write key" in i.value for i in at.info)
    # one regression, one alert: int2's ppl_ratio fires warn and critical; the list shows the critical one
    seeded = api(seeded_api, "/alerts")
    pairs = [(a["labels"]["config"], a["labels"]["metric"]) for a in seeded if a["state"] == "firing"]
    assert pairs.count(("int2", "ppl_ratio")) == 2  # both severities fire on the server
    # incidents first: one per config and run, every breaching metric inside, critical first, a runbook link
    found = frames(at)[0]
    assert list(found.columns) == ["config", "run", "severity", "alerts", "findings", "since", "runbook"]
    int2 = found[found["config"] == "int2"].iloc[0]
    assert int2["severity"] == "critical" and int2["findings"].startswith("ppl ratio ")
    assert int2["runbook"] == "docs/runbooks.md#canaryperplexityratiohigh"
    assert len(found) == len(set(zip(found["config"], found["run"], strict=True)))
    firing = frames(at)[1]
    shown = firing[(firing["config"] == "int2") & (firing["metric"] == "ppl_ratio")]
    assert list(shown["severity"]) == ["critical"], firing.to_dict()
    # the canary itself: the seeded stale schedule (tests/e2e/conftest.py) leads the firing list and the page
    assert at.error[0].value.startswith("The canary is stale: schedule 'daily'")
    assert (firing.iloc[0]["config"], firing.iloc[0]["metric"], firing.iloc[0]["severity"]) == (
        "daily", "CanaryStale", "critical")
    assert firing.iloc[0]["rule"].startswith("schedule 'daily'")
    critical = next(a for a in seeded if a["state"] == "firing" and a["severity"] == "critical"
                    and (a["labels"]["config"], a["labels"]["metric"]) == ("int2", "ppl_ratio"))
    assert shown["value"].iloc[0] == pct_change(critical["value"])  # a ratio as % change, as on the other pages
    silences = next(df for df in frames(at) if "matchers" in df.columns)
    assert silences["until"].iloc[0].startswith("in ") and silences["until"].iloc[0].endswith(" UTC)")
    assert any("hidden, inhibited by the critical alert" in c.value for c in at.caption)
    at.toggle(key="inhibited").set_value(True).run()
    firing = frames(at)[1]
    shown = firing[(firing["config"] == "int2") & (firing["metric"] == "ppl_ratio")]
    assert sorted(shown["severity"]) == ["critical", "warn"]


def test_alerts_says_which_channel_rests_and_until_when(seeded_api, monkeypatch):
    """A channel whose breaker is open (its receiver failed three times in a row, app/notify.py):
    the Alerts page says that its alerts wait, until when, and where the runbook is."""
    import sqlite3
    from datetime import UTC, datetime, timedelta

    r = httpx.put(f"{seeded_api['url']}/api/v1/projects/dash/channels", timeout=30,
                  json={"name": "oncall", "kind": "webhook", "url": "https://93.184.216.34/hook"})
    assert r.status_code == 200, r.text
    until = datetime.now(UTC) + timedelta(minutes=7, seconds=30)
    with sqlite3.connect(seeded_api["tmp"] / "dash.db") as db:
        db.execute("UPDATE channels SET breaker_strikes = 3, breaker_until = ? WHERE name = 'oncall'",
                   (until.replace(tzinfo=None).isoformat(sep=" "),))
    try:
        at = page(seeded_api, monkeypatch, "Alerts")
        (line,) = [w.value for w in at.warning if w.value.startswith("Channel oncall")]
        assert line == (f"Channel oncall (webhook) rests until {until:%H:%M:%S} UTC (in 7 minutes): its receiver "
                        "failed or answered slowly 3 times in a row, so alerts to it wait (docs/runbooks.md, "
                        '"Webhook receiver down").')
    finally:
        with sqlite3.connect(seeded_api["tmp"] / "dash.db") as db:
            db.execute("DELETE FROM channels WHERE name = 'oncall'")
    assert not [w for w in page(seeded_api, monkeypatch, "Alerts").warning if w.value.startswith("Channel ")]


def test_run_detail_opens_on_the_worst_candidate_breaches_first(seeded_api, monkeypatch):
    at = page(seeded_api, monkeypatch, "Run detail")
    first = min(r["run_id"] for r in api(seeded_api, "/runs"))  # the seeded run of every config
    at.selectbox(key="run").set_value(first).run()
    assert at.selectbox(key=f"candidate-{first}").value == "int2"  # the worst candidate, not the first one
    breaching = at.table[0].value
    rows = list(zip(breaching["config"], breaching["metric"], breaching["verdict"], strict=True))
    assert rows[0] == ("int2", "ppl ratio", "critical") and ("spec-ngram", "accept", "critical") in rows
    # timed figures (TTFT / TPOT ratios) may breach too on a loaded host; whatever breaches, the worst comes first
    assert [verdict_rank(v) for v in breaching["verdict"]] == sorted(verdict_rank(v) for v in breaching["verdict"])
    run = api(seeded_api, f"/runs/{first}")
    ppl = next(c for c in run["comparisons"] if c["config"] == "int2" and c["metric"] == "ppl_ratio")
    assert breaching.iloc[0]["change [95% CI]"] == pct_change(ppl["estimate"], ppl["ci_low"], ppl["ci_high"])
    rest = at.table[1].value  # ok and inconclusive, under an expander
    # the 24 labelled items: each candidate's accuracies and flips, as the API gave them
    (tasks,) = [e for e in at.expander if e.label == "Task accuracy on labelled items"]
    shown_tasks = tasks.table[0].value
    recovery = {c["config"]: c for c in run["comparisons"] if c["metric"] == "task_recovery"}
    assert sorted(shown_tasks["config"]) == sorted(recovery) == ["int2", "int8", "spec-ngram"]
    for config, items, r2w in zip(shown_tasks["config"], shown_tasks["items"], shown_tasks["right→wrong"], strict=True):
        assert int(items) == 24 and int(r2w) == recovery[config]["details"]["right_to_wrong"]
    assert "fp32" not in set(rest["config"]) and not {"exact match", "top-1 agree"} & set(rest["metric"])
    exps = [e for e in at.expander if "perplexity ×" in e.label]
    assert exps, "no documents listed"
    ratios = [float(e.label.split("perplexity ×")[1].split(" ")[0]) for e in exps]
    assert ratios == sorted(ratios, reverse=True) and ratios[0] > 1  # per-document ratios, worst first
    worst = api(seeded_api, f"/runs/{run['run_id']}/worst", config="int2", limit=200)["items"]
    by_hand = max(doc_ppl_ratio(i["candidate_value"], i["baseline_value"], i["baseline_extra"]["n_tokens"])
                  for i in worst)
    assert ratios[0] == float(f"{by_hand:.3f}")
    assert len(exps[0].code) == 2  # baseline and candidate generations side by side


def test_run_detail_says_a_run_was_topped_up(seeded_api, monkeypatch):
    smoke = max(suite_runs(seeded_api)[SMOKE])
    run = api(seeded_api, f"/runs/{smoke}")
    assert (run["n_samples"], run["samples_drawn"]) == (4, 12)  # 4 → 8 → 12: min_n 10 decided at 12
    int8 = next(c for c in run["comparisons"] if c["config"] == "int8" and c["metric"] == "ppl_ratio")
    assert int8["n"] == 12 and int8["verdict"] != "inconclusive"
    at = page(seeded_api, monkeypatch, "Run detail")
    at.selectbox(key="run").set_value(smoke).run()
    assert any("12 samples (topped up from 4)" in m.value for m in at.markdown)


def test_gates_history(seeded_api, monkeypatch):
    at = page(seeded_api, monkeypatch, "Gates")
    df = frames(at)[0]
    assert list(df["candidate"]) == ["int8"] and seeded_api["gate"]["verdict"] in df["verdict"].iloc[0]
    assert df["started"].iloc[0].endswith("ago") or df["started"].iloc[0] == "just now"  # not an ISO timestamp
    gate = api(seeded_api, f"/gates/{seeded_api['gate']['gate_id']}")
    banner = (at.success or at.warning or at.error)[0].value  # the latest gate's verdict and why, above the table
    assert banner.startswith(f"Latest gate {gate['gate_id']}: **{gate['verdict']}**") and gate["reason"] in banner


@pytest.mark.parametrize("url,needle", [("http://127.0.0.1:9", "is unreachable")])
def test_api_down_is_a_message_not_a_stack_trace(monkeypatch, url, needle):
    monkeypatch.setenv("CANARY_API_URL", url)
    at = AppTest.from_file(APP, default_timeout=30).run()
    assert not at.exception
    assert needle in at.error[0].value


def test_with_keys_required_the_dashboard_reads_with_a_read_only_key(seeded_api, monkeypatch, tmp_path):
    """The production shape: the API requires keys; the dashboard holds a read-only key, which
    reads every page but cannot silence; without a key it says which setting to fix."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.loopback import canary_serve

    env = {**seeded_api["env"], "CANARY_REQUIRE_API_KEYS": "true"}
    out = subprocess.run([sys.executable, "-m", "app.cli", "keys", "create", "--project", "dash", "--read-only",
                          "--name", "dashboard"],
                         cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    key = out.strip().splitlines()[-1]
    with canary_serve(env, str(tmp_path / "api.log"), "--no-upgrade-db") as base:
        monkeypatch.delenv("CANARY_DASHBOARD_WRITE_KEY", raising=False)
        monkeypatch.setenv("CANARY_API_URL", base)
        monkeypatch.delenv("CANARY_API_KEY", raising=False)
        at = AppTest.from_file(APP, default_timeout=60).run()
        assert not at.exception and "refused the dashboard's key; set CANARY_API_KEY" in at.error[0].value

        monkeypatch.setenv("CANARY_API_KEY", key)
        at = AppTest.from_file(APP, default_timeout=60).run()
        # the staleness banner and the model's headline, nothing else
        assert not at.exception and [e.value.split(":")[0] for e in at.error] == ["The canary is stale", "tiny"]
        assert at.table[0].value["config"].iloc[0] == "int2"
        at.sidebar.radio[0].set_value("Alerts").run()
        assert not at.exception and [e.value.split(":")[0] for e in at.error] == ["The canary is stale"]
        assert any("needs a write key" in i.value for i in at.info)

        # the key is read-only: handed to the dashboard as its write key, a silence is refused
        monkeypatch.setenv("CANARY_DASHBOARD_WRITE_KEY", key)
        from dashboard.client import Api, ApiError

        with pytest.raises(ApiError, match="refused the dashboard's key"):
            Api().post("/projects/dash/silences", {"matchers": [{"name": "config", "value": "int2"}],
                                                   "duration_minutes": 5,
                                                   "author": "ana", "comment": "x"})
