"""Serving figures and the reconciler, on inputs worked out by hand."""

from datetime import timedelta

import pytest
from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import AGGREGATE_RUN, EXECUTE_CONFIG_RUN
from app.models import ConfigRun, utcnow
from app.services import apply_config_file
from evals.compare import ttft_comparison
from evals.run_stats import percentile
from evals.stats import Thresholds
from sqlalchemy import update
from workers.tasks import reconcile


def test_percentile_by_hand():
    xs = [10.0, 20.0, 30.0, 40.0]
    assert percentile(xs, 50) == 25.0  # halfway between 20 and 30
    assert percentile(xs, 99) == pytest.approx(39.7)  # 30 + 0.97 · 10
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_ttft_comparison_by_hand():
    t = Thresholds(warn=2000, critical=5000, direction="above", min_n=3)
    c = ttft_comparison([100.0, 300.0, 200.0, 250.0, 150.0], t)
    assert c.estimate == 200.0 and c.n == 5
    assert 100.0 <= c.ci_low <= 200.0 <= c.ci_high <= 300.0
    assert c.verdict == "ok"
    slow = ttft_comparison([6000.0, 7000.0, 8000.0], t)
    assert slow.verdict == "critical" and slow.estimate == 7000.0
    assert ttft_comparison([1.0, 2.0], t).verdict == "inconclusive"  # n < min_n


class Recorder:
    def __init__(self):
        self.sent = []

    def send(self, task, *args, priority=3):
        self.sent.append((task, *args))


def test_reconciler_requeues_lost_messages_and_expired_leases(sqlite_env):
    cfg = parse_config({
        "project": "r", "model": {"name": "m", "path": "builtin:pydoc-target"},
        "configs": [{"name": "a", "baseline": True}, {"name": "b", "weights": "int8"}, {"name": "c", "weights": "rtn-int4"}],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 10}],
    })
    with session_scope() as s:
        apply_config_file(s, cfg)
        project = repo.get_project(s, "r")
        run, _ = repo.create_run(s, project, repo.get_suite(s, project, "s"), repo.list_configs(s, project))
        a, b, c = (cr.id for cr in run.config_runs)
        old = utcnow() - timedelta(hours=1)
        # a: queued an hour ago, its message lost; b: running but its worker died (lease expired);
        # c: queued a moment ago — left alone.
        s.execute(update(ConfigRun).where(ConfigRun.id == a).values(enqueued_at=old))
        s.execute(update(ConfigRun).where(ConfigRun.id == b).values(status="running", attempt=1, lease_expires_at=old, enqueued_at=old))
    rec = Recorder()
    assert reconcile(dispatcher=rec) == 2
    assert sorted(rec.sent) == [(EXECUTE_CONFIG_RUN, a), (EXECUTE_CONFIG_RUN, b)]
    assert reconcile(dispatcher=Recorder()) == 0  # both were re-stamped: no re-send storm while they wait for a worker


def test_reconciler_restarts_a_lost_aggregation(sqlite_env):
    cfg = parse_config({
        "project": "r", "model": {"name": "m", "path": "builtin:pydoc-target"},
        "configs": [{"name": "a", "baseline": True}],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 10}],
    })
    with session_scope() as s:
        apply_config_file(s, cfg)
        project = repo.get_project(s, "r")
        run, _ = repo.create_run(s, project, repo.get_suite(s, project, "s"), repo.list_configs(s, project))
        run_id = run.id
        old = utcnow() - timedelta(hours=1)
        # the worker finished its config-run, then died before the aggregate message went out
        s.execute(update(ConfigRun).where(ConfigRun.run_id == run_id).values(status="succeeded", finished_at=old))
    rec = Recorder()
    assert reconcile(dispatcher=rec) == 1
    assert rec.sent == [(AGGREGATE_RUN, run_id)]
    with session_scope() as s:
        assert repo.get_run(s, repo.get_project(s, "r"), run_id).status == "aggregating"


def test_acceptance_comparison_by_hand():
    from evals.compare import acceptance_comparison

    t = Thresholds(warn=0.5, critical=0.3, direction="below", min_n=3)
    # 3 prompts: 8/10, 6/10, 4/10 accepted → 18/30 = 0.6; every resample stays within [0.4, 0.8]
    c = acceptance_comparison([10, 10, 10], [8, 6, 4], t)
    assert c.estimate == pytest.approx(0.6) and 0.4 <= c.ci_low <= 0.6 <= c.ci_high <= 0.8
    assert c.verdict == "inconclusive"  # the CI reaches below warn 0.5
    low = acceptance_comparison([10, 10, 10], [2, 2, 2], t)
    assert low.estimate == pytest.approx(0.2) and low.verdict == "critical"


def test_a_reference_config_stores_the_engines_peak_kv_cache_usage(sqlite_env):
    """The in-process engine knows its own KV cache (EngineDescription.kv_cache_usage, tested by
    hand in the engine's tests); the config-run stores that peak, and no server figures."""
    from app.dispatch import InlineDispatcher
    from app.services import start_run
    from workers.engine_cache import _ENGINES, reset_engine_cache

    cfg = parse_config({
        "project": "kv", "model": {"name": "m", "path": "builtin:pydoc-target"},
        "configs": [{"name": "fp32", "baseline": True, "engine": "reference", "weights": "fp32"}],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 3, "perplexity": {"window": 64},
                    "generation": {"prompts": 2, "prompt_words": 8, "max_new_tokens": 8}}],
    })
    with session_scope() as s:
        apply_config_file(s, cfg)
    reset_engine_cache()  # a fresh engine: its peak is this config-run's
    run_id, _ = start_run("kv", "s", None, InlineDispatcher())
    (engine,) = _ENGINES.values()
    with session_scope() as s:
        (config_run,) = repo.get_run(s, repo.get_project(s, "kv"), run_id).config_runs
        figures = config_run.figures
    assert config_run.status == "succeeded", config_run.error
    assert figures["kv_cache_usage"] == engine.describe().kv_cache_usage
    assert 0 < figures["kv_cache_usage"] <= 1
    assert "server" not in figures
