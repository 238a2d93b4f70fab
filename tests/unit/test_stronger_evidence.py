"""A smaller, later run never overrides stronger evidence (a 12-sample gate after a 100-sample
nightly): an alert is neither resolved nor downgraded by it (app/alert_evaluation.py `_weighed`),
and the Overview keeps showing the larger run (app/api/routes/views.py `_strongest_evidence`).
Each run below is evaluated as the worker evaluates a finished run, on the embedded database."""

from __future__ import annotations

from sqlalchemy import select

# (samples, ppl ratio, verdict) per run, in order; the rule: warn above 1.05, critical above 1.15
CRITICAL_100 = (100, 1.30, "critical")
OK_12 = (12, 1.01, "ok")
WARN_50 = (50, 1.08, "warn")
CRITICAL_12 = (12, 1.20, "critical")
OK_100 = (100, 1.00, "ok")


def _setup():
    from app.db import session_scope
    from app.models import AlertRule

    from tests.seed import catalogue

    with session_scope() as s:
        project, model, configs, suite = catalogue(s, "p", "m", ["fp16", "int4"])
        s.add(AlertRule(project_id=project.id, metric="ppl_ratio", warn=1.05, critical=1.15, direction="above"))
        s.flush()
        return project.id, model.id, configs["fp16"].id, configs["int4"].id, suite.id


def _run(ids, samples: int, ratio: float, verdict: str, *,
         kept: bool = False) -> dict[str, tuple[str, str | None]]:
    """One finished run of int4 against fp16, evaluated; each severity's alert: (state, held note).
    `kept`: each config-run keeps the spec it loaded in its figures, as the worker writes them
    (workers/execute.py); else the figures have none, as a run stored before they kept it."""
    from app.alert_evaluation import evaluate_run
    from app.db import session_scope
    from app.models import Alert, ComparisonRow, ConfigRun, OptimizationConfig, Run
    from vocabulary.figures import spec_digest

    project, model, base, int4, suite = ids
    with session_scope() as s:
        run = Run(project_id=project, suite_id=suite, suite_version="v1", model_id=model, baseline_config_id=base,
                  trigger="manual", status="done", n_samples=samples, sample_keys=[f"d{i}" for i in range(samples)])
        s.add(run)
        s.flush()
        # the baseline's tokens/s names its run: a tile compares int4 with the baseline of int4's own run
        specs = {c: s.get(OptimizationConfig, c).spec for c in (base, int4)}
        s.add_all([ConfigRun(run_id=run.id, config_id=c, status="succeeded",
                             figures={**({"tokens_per_second": float(run.id)} if c == base else {}),
                                      **({"config_digest": spec_digest(specs[c])} if kept else {})} or None)
                   for c in (base, int4)])
        s.add(ComparisonRow(run_id=run.id, config_id=int4, metric="ppl_ratio", estimate=ratio, ci_low=ratio - 0.01,
                         ci_high=ratio + 0.01, n=samples, verdict=verdict, rule="seeded", details={}))
        s.flush()
        evaluate_run(s, run)
    with session_scope() as s:
        newest = {}
        for alert in s.scalars(select(Alert).order_by(Alert.id)):
            newest[alert.severity] = (alert.state, (alert.annotations or {}).get("held"), alert.run_id)
        return newest


def test_a_run_with_fewer_samples_neither_resolves_nor_downgrades_an_alert(sqlite_env):
    ids = _setup()
    raised = _run(ids, *CRITICAL_100)
    assert {k: v[0] for k, v in raised.items()} == {"warn": "firing", "critical": "firing"}
    first_run = raised["critical"][2]
    # 12 samples say ok: both alerts stay firing, on the run that raised them, and say why
    after = _run(ids, *OK_12)
    assert after["critical"][:1] == ("firing",) and after["warn"][0] == "firing"
    assert after["critical"][2] == first_run
    assert after["critical"][1].endswith("said ok at n=12, fewer samples than the n=100 that raised this alert: "
                                         "kept as it was")
    # 50 samples say warn: the warn alert holds (breaching), the critical one is not downgraded
    after = _run(ids, *WARN_50)
    assert after["critical"][0] == "firing" and "said warn at n=50" in after["critical"][1]
    assert after["warn"] == ("firing", None, after["warn"][2])  # breaching evidence always counts
    # a small run that breaches counts too, and does not lower the evidence the alert stands on
    after = _run(ids, *CRITICAL_12)
    assert after["critical"][:2] == ("firing", None)
    after = _run(ids, *OK_12)
    assert after["critical"][0] == "firing" and "fewer samples than the n=100" in after["critical"][1]
    # as many samples as raised it, ok: resolved
    after = _run(ids, *OK_100)
    assert {k: v[0] for k, v in after.items()} == {"warn": "resolved", "critical": "resolved"}


def test_the_overview_shows_the_strongest_recent_evidence(sqlite_env):
    from app.api.routes.views import overview
    from app.db import session_scope
    from app.repo import get_project
    from app.schemas import jsonable

    def shown() -> tuple[int, int, str]:
        with session_scope() as s:
            view = jsonable(overview(get_project(s, "p"), s, None))
        int4 = next(c for c in view["models"]["m"] if c["config"] == "int4")
        ppl = int4["comparisons"]["ppl_ratio"]
        assert int4["baseline_figures"]["tokens_per_second"] == int4["run_id"]
        return int4["run_id"], ppl["n"], ppl["verdict"]

    ids = _setup()
    _run(ids, *WARN_50)
    assert shown()[1:] == (50, "warn")
    _run(ids, *CRITICAL_100)
    first = shown()
    assert first[1:] == (100, "critical")  # more samples, and newer
    _run(ids, *OK_12)
    assert shown() == first  # 12 samples, newer: the 100-sample run still stands for int4
    _run(ids, *OK_100)
    assert shown()[1:] == (100, "ok") and shown()[0] > first[0]  # as many samples, newer: it takes over


def test_an_escalation_does_not_raise_the_bar(sqlite_env):
    """An escalation confirms a regression on more samples (500); the regular 100-sample cadence
    that raised the alert can still resolve it."""
    ids = _setup()
    _run(ids, *CRITICAL_100)
    _run(ids, 500, 1.25, "critical")  # the escalation's larger run, still breaching
    after = _run(ids, *OK_100)
    assert {k: v[0] for k, v in after.items()} == {"warn": "resolved", "critical": "resolved"}


def test_trends_marks_an_alert_at_the_run_it_fired_on(sqlite_env):
    """Critical on run 1 (fires), critical again on run 2 (re-checked, still firing): the alert's run
    is run 2 on the Alerts page, but Trends marks it where it fired, run 1."""
    from app.api.routes.views import trends
    from app.db import session_scope
    from app.repo import get_project
    from app.schemas import jsonable

    ids = _setup()
    fired = _run(ids, *CRITICAL_100)["critical"][2]
    again = _run(ids, *CRITICAL_100)["critical"]
    assert again[0] == "firing" and again[2] > fired  # the alert's run_id follows the runs that re-check it
    with session_scope() as s:
        view = jsonable(trends(get_project(s, "p"), s, metric="ppl_ratio", config=None, suite=None, limit=200))
    marks = {(a["severity"], a["run_id"]) for a in view["alerts"]}
    assert marks == {("critical", fired), ("warn", fired)}


def _edit(name: str, **spec) -> None:
    """Edit a config in place, as PUT …/configs does: same name and id, another spec."""
    from app.db import session_scope
    from app.models import OptimizationConfig

    with session_scope() as s:
        config = s.scalar(select(OptimizationConfig).where(OptimizationConfig.name == name))
        config.spec = {**config.spec, **spec}


def _summary() -> dict:
    from app.api.routes.views import overview
    from app.db import session_scope
    from app.repo import get_project
    from app.schemas import jsonable

    with session_scope() as s:
        return jsonable(overview(get_project(s, "p"), s, None))["summaries"]["m"]


def _shown() -> dict:
    from app.api.routes.views import overview
    from app.db import session_scope
    from app.repo import get_project
    from app.schemas import jsonable

    with session_scope() as s:
        view = jsonable(overview(get_project(s, "p"), s, None))
    return next(c for c in view["models"]["m"] if c["config"] == "int4")


def test_a_config_edited_in_place_has_only_the_runs_since_as_evidence(sqlite_env):
    """A 100-sample run measured int4; then int4 is edited in place (another KV cache). The
    100-sample run stands for it no longer: until a run measures the new definition, the Overview
    shows the old run marked edited; then the 12-sample run of the new definition, although
    smaller. Editing the baseline does the same to every candidate. A run whose config-runs kept no
    spec (stored before they did) counts as measuring the config as it is."""
    ids = _setup()
    _run(ids, *CRITICAL_100, kept=True)
    first = _shown()
    assert (first["comparisons"]["ppl_ratio"]["n"], first["edited_since_checked"]) == (100, False)
    _run(ids, *OK_12, kept=True)
    assert _shown()["run_id"] == first["run_id"]  # the same definition: the stronger run stands
    _edit("int4", kv_cache="fp8")
    stale = _shown()
    assert stale["edited_since_checked"] is True  # no run measured the new int4: the latest run, marked
    (line,) = _summary()["groups"]["undecided"]  # whatever that run said, it said it of the old int4
    assert line["text"] == f"int4: edited since run {stale['run_id']} measured it (then: ok)"
    assert line["decide_samples"] == 12 and set(_summary()["groups"]) == {"undecided"}
    assert stale["run_id"] > first["run_id"] and stale["comparisons"]["ppl_ratio"]["n"] == 12
    _run(ids, *OK_12, kept=True)
    now = _shown()
    assert (now["comparisons"]["ppl_ratio"]["n"], now["comparisons"]["ppl_ratio"]["verdict"]) == (12, "ok")
    assert now["run_id"] > stale["run_id"] and now["edited_since_checked"] is False
    _run(ids, *WARN_50, kept=True)
    assert _shown()["comparisons"]["ppl_ratio"]["n"] == 50  # more samples of the new definition: it takes over
    _edit("fp16", dtype="bfloat16")  # the baseline: every candidate's evidence measured the old one
    assert _shown()["edited_since_checked"] is True
    _run(ids, *OK_12)  # figures without a kept spec: as the config is now
    assert _shown()["edited_since_checked"] is False and _shown()["comparisons"]["ppl_ratio"]["n"] == 12


def test_a_config_edited_after_a_critical_run_is_undecided_not_dropped(sqlite_env):
    """The critical finding was of the old definition: the summary puts int4 among the undecided,
    saying what that run found, and the command that decides it reruns as many documents."""
    ids = _setup()
    _run(ids, *CRITICAL_100, kept=True)
    assert set(_summary()["groups"]) == {"drop or fix"}
    _edit("int4", weights="int8")
    summary = _summary()
    (line,) = summary["groups"]["undecided"]
    assert set(summary["groups"]) == {"undecided"} and line["decide_samples"] == 100
    assert line["text"] == (f"int4: edited since run {_shown()['run_id']} measured it (then: ppl ratio +30.00% "
                            "[+29.00, +31.00] critical)")
    # the command measures it again as it now is, on the documents its run drew
    assert summary["lines"][-1] == "  decide: canary run -f canary.yaml --suite daily --configs int4 --samples 100"


def test_a_smaller_run_of_a_config_edited_since_can_resolve_its_alert(sqlite_env):
    """A 12-sample run holds a 100-sample critical alert while int4 is as it was; once int4 is
    edited in place, a 12-sample ok resolves it: the alert's evidence measured a config that no
    longer exists. A run that breaches again after the edit raises the bar to its own n."""
    ids = _setup()
    raised = _run(ids, *CRITICAL_100, kept=True)
    assert raised["critical"][0] == "firing"
    held = _run(ids, *OK_12, kept=True)
    assert held["critical"][0] == "firing" and "fewer samples than the n=100" in held["critical"][1]
    _edit("int4", kv_cache="fp8")
    after = _run(ids, *OK_12, kept=True)
    assert {k: v[0] for k, v in after.items()} == {"warn": "resolved", "critical": "resolved"}
    # a neighbour: edited again, it breaches at 50 samples; a 12-sample ok of that same definition is held
    _edit("int4", kv_cache="kivi-2")
    assert _run(ids, 50, 1.30, "critical", kept=True)["critical"][0] == "firing"
    again = _run(ids, *OK_12, kept=True)
    assert again["critical"][0] == "firing" and "fewer samples than the n=50" in again["critical"][1]


def test_the_overviews_decide_command_asks_for_no_fewer_documents_than_its_run_drew(sqlite_env):
    """The demo's run drew 100 documents and its candidate is undecided on its answers (n = the 16
    prompts, about 28 would decide it): the Overview's banner gives the command the CLI gives,
    `--samples 100 --prompts 28` (the prompts are openings of the documents drawn), never fewer
    documents than the run drew (it said `--samples 28` when the Overview passed no draw)."""
    from app.api.routes.views import overview
    from app.db import session_scope
    from app.models import ComparisonRow, ConfigRun, Run
    from app.repo import get_project
    from app.schemas import jsonable

    from tests.seed import catalogue

    with session_scope() as s:
        project, model, configs, suite = catalogue(s, "demo", "m", ["fp16", "int8"], n_documents=500)
        run = Run(project_id=project.id, suite_id=suite.id, suite_version="v1", model_id=model.id,
                  baseline_config_id=configs["fp16"].id, trigger="manual", status="done", n_samples=100,
                  sample_keys=[f"d{i}" for i in range(100)])
        s.add(run)
        s.flush()
        s.add_all([ConfigRun(run_id=run.id, config_id=c.id, status="succeeded") for c in configs.values()])
        s.add(ComparisonRow(run_id=run.id, config_id=configs["int8"].id, metric="degenerate_answers", estimate=0.125,
                            ci_low=0.0, ci_high=0.312, n=16, verdict="inconclusive",
                            rule="CI [0, 0.312] straddles warn 0.03: more samples needed (about 28 at this effect)",
                            details={}))
    with session_scope() as s:
        lines = jsonable(overview(get_project(s, "demo"), s, None))["summaries"]["m"]["lines"]
    assert lines[-1] == "  decide: canary demo --samples 100 --prompts 28", lines
