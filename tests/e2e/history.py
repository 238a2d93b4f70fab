"""A long history for the charts, written straight into a fresh database: `runs` finished runs of
one suite over `configs` configs (ppl_ratio and tpot_ratio comparisons, one config collapsed at
about 7× its baseline's perplexity), an alert rule, and alerts fired on some runs. The figures
are drawn from a seeded generator: they test how the pages draw a history, not any measurement
(those come from real runs in tests/e2e/conftest.py)."""

from __future__ import annotations

import random
from datetime import timedelta

from sqlalchemy import create_engine
from sqlalchemy.orm import Session


def seed_history(url: str, runs: int, configs: int, seed: int = 0) -> dict:
    """Fill the (migrated, empty) database at `url`; returns {"project", "configs", "run_ids"}."""
    from app.config_file import SuiteEntry
    from app.models import Alert, AlertRule, ComparisonRow, ConfigRun, Run, utcnow

    from tests.seed import catalogue

    rng = random.Random(seed)
    engine = create_engine(url)
    names = ["fp16", *[f"cfg-{i:02d}" for i in range(1, configs - 1)], "kv-int2-collapsed"][:configs]
    with Session(engine) as s, s.begin():
        # the suite's spec as a canary.yaml entry stores it (app/config_file.py), every default filled in
        spec = SuiteEntry(name="daily", corpus="builtin:pydoc-heldout", samples=100).model_dump(exclude={"name"})
        project, model, made, suite = catalogue(s, "history", "tiny", names,
                                                spec={"engine": "reference", "weights": "fp16"}, suite_spec=spec)
        rows = list(made.values())
        rule = AlertRule(project_id=project.id, metric="ppl_ratio", warn=1.15, critical=1.30, direction="above")
        s.add(rule)
        s.flush()
        start = utcnow() - timedelta(days=runs)
        run_ids = []
        for k in range(runs):
            at = start + timedelta(days=k)
            run = Run(project_id=project.id, suite_id=suite.id, suite_version="v1", model_id=model.id,
                      baseline_config_id=rows[0].id, trigger="schedule", status="done", verdict="fail",
                      verdict_reason="kv-int2-collapsed ppl_ratio critical", n_samples=100,
                      sample_keys=[f"d{i}" for i in range(100)], created_at=at, finished_at=at + timedelta(minutes=9))
            s.add(run)
            s.flush()
            run_ids.append(run.id)
            for i, cfg in enumerate(rows):
                s.add(ConfigRun(run_id=run.id, config_id=cfg.id, status="succeeded", finished_at=at,
                                figures={"tokens_per_second": 100.0 + 10 * i}))
                if i == 0:
                    continue
                # a few % for most configs, 7× for the collapsed one, a drift on one in the second half
                ratio = 6.96 if cfg.name.endswith("collapsed") else 1.0 + 0.004 * i + rng.gauss(0, 0.004)
                if i == 1 and k >= runs // 2:
                    ratio += 0.2
                half = 0.02 * ratio
                verdict = "critical" if ratio - half >= 1.30 else "warn" if ratio - half >= 1.15 else "ok"
                s.add(ComparisonRow(run_id=run.id, config_id=cfg.id, metric="ppl_ratio", estimate=ratio,
                                 ci_low=ratio - half, ci_high=ratio + half, n=100, verdict=verdict,
                                 rule="seeded history", details={}))
                tpot = 0.8 + 0.05 * i + rng.gauss(0, 0.01)
                s.add(ComparisonRow(run_id=run.id, config_id=cfg.id, metric="tpot_ratio", estimate=tpot,
                                 ci_low=tpot - 0.03, ci_high=tpot + 0.03, n=16, verdict="ok", rule="seeded history",
                                 details={}))
                if verdict != "ok" and (k % 3 == 0 or k == runs - 1):
                    s.add(Alert(project_id=project.id, rule_id=rule.id, fingerprint=f"{cfg.name}-{verdict}",
                                labels={"project": "history", "model": "tiny", "config": cfg.name,
                                        "metric": "ppl_ratio", "severity": verdict},
                                state="firing", severity=verdict, value=ratio, run_id=run.id, started_at=at,
                                fired_at=at))
    engine.dispose()
    return {"project": "history", "configs": names, "run_ids": run_ids}
