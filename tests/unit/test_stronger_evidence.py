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


def _run(ids, samples: int, ratio: float, verdict: str) -> dict[str, tuple[str, str | None]]:
    """One finished run of int4 against fp16, evaluated; each severity's alert: (state, held note)."""
    from app.alert_evaluation import evaluate_run
    from app.db import session_scope
    from app.models import Alert, ComparisonRow, ConfigRun, Run

    project, model, base, int4, suite = ids
    with session_scope() as s:
        run = Run(project_id=project, suite_id=suite, suite_version="v1", model_id=model, baseline_config_id=base,
                  trigger="manual", status="done", n_samples=samples, sample_keys=[f"d{i}" for i in range(samples)])
        s.add(run)
        s.flush()
        # the baseline's tokens/s names its run: a tile compares int4 with the baseline of int4's own run
        s.add_all([ConfigRun(run_id=run.id, config_id=c, status="succeeded",
                             figures={"tokens_per_second": float(run.id)} if c == base else None) for c in (base, int4)])
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
