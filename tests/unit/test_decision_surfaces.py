"""One decision, the same on every surface: a run's verdict for people (app/summary.py), read from
one stored run, as the CLI prints it, as `canary gate` prints it and writes its pull-request
comment, as the HTML report and the Overview's banner show it, and as an alert's chat message says
it. Every line below is worked out by hand from the seeded comparisons.

The seeded run holds four candidates, one per group (drop or fix, slower, undecided, ship). A gate
row points at it so that the gate's surfaces render the same run; a real gate run has one
candidate, and its lines are that candidate's."""

from __future__ import annotations

import html
import json
import re

import pytest
from app.summary import deploy_decision
from sqlalchemy import select

# ppl 1.30 [1.20, 1.40] → +30.00% [+20.00, +40.00]; TPOT 2.0 [1.8, 2.2] → +100.00% [+80.00, +120.00],
# measured by the reference engine on the CPU its figures name; u1's 1.10 [1.00, 1.20] at n=12, its
# rule saying about 48 samples decide it; int8 ok everywhere.
INT2_FOUND = "ppl ratio +30.00% [+20.00, +40.00] critical"
ADVICE = "disable kv_cache int2: 100 % of the ppl_ratio loss"  # int2 is stacked: its step-back advice
INT2 = f"int2: {INT2_FOUND} — step back: {ADVICE}"
KIVI = "kivi-4: TPOT ratio +100.00% [+80.00, +120.00] critical (reference engine on cpu)"
U1 = "u1: ppl ratio +10.00% [+0.00, +20.00] inconclusive at n=12 (about 48 samples would decide it)"
LINES = ["drop or fix (1):", f"  {INT2}", "slower than the baseline (1):", f"  {KIVI}", "undecided (1):", f"  {U1}",
         "  decide: canary run -f canary.yaml --suite daily --configs u1 --samples 48", "ship (1): int8"]


def _seed(url: str) -> int:
    """The project 'shop' with one done run of suite 'daily'; returns the run's id."""
    from app.models import (
        AlertRule,
        Channel,
        ComparisonRow,
        ConfigRun,
        Gate,
        Run,
    )
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from tests.seed import catalogue

    engine = create_engine(url)
    rows = {  # config: (metric, estimate, low, high, n, verdict, rule)
        "int2": ("ppl_ratio", 1.30, 1.20, 1.40, 12, "critical", "critical > 1.15"),
        "kivi-4": ("tpot_ratio", 2.0, 1.8, 2.2, 12, "critical", "critical > 1.5"),
        "u1": ("ppl_ratio", 1.10, 1.00, 1.20, 12, "inconclusive", "CI spans warn 1.05; about 48 at this effect"),
        "int8": ("ppl_ratio", 1.001, 1.0, 1.002, 12, "ok", "below warn 1.05"),
    }
    with Session(engine) as s, s.begin():
        project, model, configs, suite = catalogue(s, "shop", "tiny", ["fp16", *rows], spec={"engine": "reference"})
        run = Run(project_id=project.id, suite_id=suite.id, suite_version="v1", model_id=model.id,
                  baseline_config_id=configs["fp16"].id, trigger="manual", status="done", verdict="fail",
                  verdict_reason="int2 ppl_ratio critical", n_samples=12, sample_keys=[f"d{i}" for i in range(12)])
        s.add(run)
        s.flush()
        for config in configs.values():
            s.add(ConfigRun(run_id=run.id, config_id=config.id, status="succeeded",
                            figures={"engine": "reference", "device": "cpu", "model_digest": "ab12" * 16}))
        step_back = {"metric": "ppl_ratio", "stacked_ratio": 1.3, "interaction": 0.0, "disable": "kv_cache",
                     "advice": ADVICE, "layers": []}
        for name, (metric, est, low, high, n, verdict, rule) in rows.items():
            s.add(ComparisonRow(run_id=run.id, config_id=configs[name].id, metric=metric, estimate=est, ci_low=low,
                                ci_high=high, n=n, verdict=verdict, rule=rule,
                                details={"step_back": step_back} if name == "int2" else {}))
        s.add(AlertRule(project_id=project.id, metric="ppl_ratio", warn=1.05, critical=1.15, direction="above"))
        s.add(Channel(project_id=project.id, name="team", kind="slack", url="http://127.0.0.1:9/hook"))
        s.add(Gate(project_id=project.id, candidate="int2", baseline="fp16", run_id=run.id, verdict="fail"))
        run_id = run.id
    engine.dispose()
    return run_id


@pytest.fixture
def seeded(sqlite_env):
    return _seed(sqlite_env)


def _plain(markdown: str) -> str:
    """Markdown as read: emphasis, bullets and code ticks gone, escapes undone."""
    text = re.sub(r"^\*(.*)\*$", r"\1", markdown.replace("**", "").replace("• ", "  ").replace("`", ""))
    return re.sub(r"\\(.)", r"\1", text)


def test_every_surface_says_the_same_decision(seeded, capsys):
    from app.api.routes.catalogue import catalogue
    from app.api.routes.views import overview
    from app.cli.gate import _gate_out
    from app.cli.output import _print_summary
    from app.db import session_scope
    from app.models import Gate, Notification, Run
    from app.queries import gate_out
    from app.repo import get_project, get_run
    from app.report import build
    from app.schemas import jsonable
    from app.services import run_summary
    from dashboard.views.overview import config_rows, headline

    with session_scope() as s:
        project = get_project(s, "shop")
        run = get_run(s, project, seeded)
        summary = run_summary(s, run)
        gate = jsonable(gate_out(s, project, s.scalar(select(Gate))))
        report = build(s, project, run)
        view = jsonable(overview(project, s, None))
    assert summary.summary.lines == LINES  # the text itself, worked by hand above

    _print_summary(summary)  # the CLI: `canary run`, `canary demo`, `canary runs show`
    cli = capsys.readouterr().out.splitlines()
    assert cli[-len(LINES):] == LINES

    _gate_out(gate, None, False)  # `canary gate` without --json: its lines on stderr, as the CLI's
    said = capsys.readouterr().err.splitlines()
    assert said[0].startswith(f"gate 1: fail — candidate int2 vs fp16, run {seeded} (done)") and said[1:] == LINES
    md = gate["summary_markdown"].splitlines()  # its pull-request comment
    assert f"**Decision:** {deploy_decision('fail')}" in md and "deploy blocked: fail (exit 1)" in md[5]
    start = md.index("```text") + 1
    assert md[start:start + len(LINES)] == LINES

    pre = re.search(r"<pre>(.*?)</pre>", report, re.S)  # the HTML report's banner
    assert pre and html.unescape(pre.group(1)).splitlines() == LINES

    metrics = [m for m in jsonable(catalogue())["metrics"] if m["gated"]]  # as the Overview page reads them
    configs = view["models"]["tiny"]
    text, worst = headline("tiny", config_rows(configs, metrics), metrics, view["summaries"]["tiny"])
    banner = [_plain(line) for line in text.split("  \n")]  # the Overview's banner
    assert worst == "critical" and banner[0] == "tiny: 2 configs to act on"
    assert " (since " in banner[2]  # the Overview adds since when a breaching config breaches, and nothing else
    banner = [re.sub(r" \(since [^)]*\)$", "", line).strip() for line in banner]
    assert banner[1:] == [line[0].upper() + line[1:] if line.endswith(":") else line.strip() for line in LINES]

    from app import repo
    from app.alert_evaluation import evaluate_run
    from app.queries import alerts as read_alerts

    with session_scope() as s:  # an alert's chat message: int2 fires, its line says where it stands
        evaluate_run(s, s.get(Run, seeded))
    with session_scope() as s:
        payloads = [json.dumps(n.payload, ensure_ascii=False) for n in s.scalars(select(Notification))]
    assert len(payloads) == 1 and f"int2 overall: drop or fix: {INT2_FOUND}. Step back: {ADVICE}." in payloads[0]
    assert f"/?page=run&run_id={seeded}&project=shop" in payloads[0]  # its link opens the run in its project
    assert "Runbook: docs/runbooks.md#canaryperplexityratiohigh" in payloads[0]  # app/runbooks.py
    with session_scope() as s:  # the alerts API gives the same runbook link with each alert
        runbooks = {(a["labels"]["config"], a["labels"]["metric"]): a["annotations"]["runbook_url"]
                    for a in read_alerts(s, repo.get_project(s, "shop"))}
    assert runbooks[("int2", "ppl_ratio")] == "docs/runbooks.md#canaryperplexityratiohigh"


def test_the_release_review_report_holds_thresholds_environment_and_markdown(seeded):
    """`canary report` (app/report.py, app/report_context.py): the thresholds that judged the run,
    the environment that measured it, and the same as Markdown for a pull request."""
    from app.db import session_scope
    from app.repo import get_project, get_run
    from app.report import build
    from vocabulary.metrics import METRICS

    with session_scope() as s:
        project = get_project(s, "shop")
        run = get_run(s, project, seeded)
        page, md = build(s, project, run), build(s, project, run, "md")
    tpot = METRICS["tpot_ratio"]  # no rule of the project's: the metric table's seed thresholds
    thresholds = ["| ppl ratio | above | 1.05 | 1.15 | 10 | project rule | int2, int8, u1 |",
                  f"| TPOT ratio | above | {tpot.warn:g} | {tpot.critical:g} | {tpot.min_n} | seed | kivi-4 |"]
    lines = md.splitlines()
    assert lines[0] == f"# inference-canary · project `shop` · run {seeded}: **fail**"
    start = lines.index("## Decision") + 3
    assert lines[start:start + len(LINES)] == LINES  # the decision, as every surface prints it
    assert [line for line in lines if line.startswith(("| ppl ratio | above", "| TPOT ratio | above"))] == thresholds
    assert "| int2 | ppl ratio | +30.00% [+20.00, +40.00] | 12 | critical |" in lines
    assert "| model | tiny (builtin:pydoc-target) |" in lines and "| samples | 12 drawn |" in lines
    assert "| suite | daily, version v1 |" in lines
    assert "| model digest | sha256 ab12ab12ab12ab12… |" in lines  # every config loaded the same weights
    assert "| int2 | reference | cpu | — | — | — | — |" in lines  # the seeded figures name engine and device only
    # the HTML report: the same tables, and times in UTC
    assert "<h2>Thresholds (the rules as they stand now" in page and "<td>project rule</td>" in page and "<h2>Environment</h2>" in page
    assert re.search(r"started \d{4}-\d\d-\d\d \d\d:\d\d UTC", page)


def test_the_report_names_a_served_model_by_host_and_times_in_utc():
    from app.report_context import _public, when

    assert _public("http://user:secret@vllm.internal:8000/v1?api_key=x") == "http://vllm.internal:8000/***"
    assert _public("cuda:0:NVIDIA H200") == "cuda:0:NVIDIA H200"  # a device that is no URL stays as it is
    assert when("2026-11-29T07:10:00+01:00") == "2026-11-29 06:10 UTC" and when("2026-11-29T06:10:00") == \
        "2026-11-29 06:10 UTC"


def test_the_report_names_the_weights_each_config_loaded():
    """One digest for configs that loaded the same files; a config's own checkpoint apart; a served model none."""
    from app.report_context import _digests

    assert _digests({"fp16": "a" * 64, "int8": "a" * 64}) == "sha256 aaaaaaaaaaaaaaaa…"
    assert _digests({"fp16": "a" * 64, "int8": "a" * 64, "awq-ckpt": "b" * 64, "vllm": None}) == (
        "fp16, int8: sha256 aaaaaaaaaaaaaaaa…; awq-ckpt: sha256 bbbbbbbbbbbbbbbb…; "
        "vllm: not stored (a served model, or a run stored before it was)")
