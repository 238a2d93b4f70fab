"""Revisions on PostgreSQL with rows as the schema before them wrote them.

0002: a generation stored under metric 'ttft_ms' becomes a 'generation' record that
GenerationRecord reads back whole, other rows are untouched, and the downgrade restores the old
layout. 0003: a comparison's verdict widens to hold 'measurement_error' (too long before it);
the downgrade reads one as 'inconclusive'. 0006: details.informational becomes the gated
column (false where the key was true), the key leaves details, and the downgrade puts it back."""

from __future__ import annotations

import json

import pytest
from app.db import downgrade, upgrade
from evals.records import DocRecord, GenerationRecord, read_row
from sqlalchemy import create_engine, pool, text
from sqlalchemy.exc import DataError

# what main wrote before 0002 (workers/execute.py at 0395128): the generation's row is its TTFT
OLD_GENERATION = {"text": " def f(x)", "prompt": "Return the", "n_tokens": 3, "prompt_tokens": 2, "itl_ms": [1.5, 2.25],
                  "tokens_per_second": 120.0, "token_ids": [5, 6, 7],
                  "spec": {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 3, "accepted_per_position": [2, 1, 0, 0]}}
OLD_DOC = {"n_tokens": 10, "n_words": 4, "n_bytes": 21, "top1_hits": 6, "cluster": "os", "greedy_ids": [1, 2]}


def _rows(engine) -> dict:
    with engine.connect() as conn:
        return {(r.sample_key, r.metric): (r.value, r.extra) for r in conn.execute(text(
            "SELECT sample_key, metric, value, extra FROM sample_results ORDER BY id"))}


def _one_run(conn, config_name: str = "int8", baseline: bool = False) -> tuple[int, int]:
    """A project, model, config, suite and run as the schema at 0001 stores them: (run id, config id)."""
    run = lambda q, **kw: conn.execute(text(q), kw).scalar()  # noqa: E731
    project = run("INSERT INTO projects (name, created_at) VALUES ('p', now()) RETURNING id")
    model = run("INSERT INTO models (project_id, name, path, created_at) VALUES (:p, 'm', 'builtin:x', now()) RETURNING id",
                p=project)
    config = run("INSERT INTO optimization_configs (project_id, model_id, name, spec, is_baseline, created_at) "
                 "VALUES (:p, :m, :n, '{}', :b, now()) RETURNING id", p=project, m=model, n=config_name, b=baseline)
    suite = run("INSERT INTO suites (project_id, name, spec, version, n_documents, created_at) "
                "VALUES (:p, 's', '{}', 'v1', 1, now()) RETURNING id", p=project)
    run_id = run("INSERT INTO runs (project_id, suite_id, suite_version, model_id, baseline_config_id, trigger, status, "
                 "n_samples, seed, sample_keys, created_at) VALUES (:p, :s, 'v1', :m, :c, 'manual', 'done', 1, 0, "
                 "'[\"d0\"]', now()) RETURNING id", p=project, s=suite, m=model, c=config)
    return run_id, config


def test_generation_rows_move_to_their_own_kind_and_back(make_database):
    url = make_database(migrate=False)
    upgrade(url, "0001")
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.begin() as conn:
            run_id, config = _one_run(conn, "fp16", True)
            for key, metric, value, extra in (("d0", "ttft_ms", 12.5, OLD_GENERATION), ("d0", "nll", 30.25, OLD_DOC)):
                conn.execute(text("INSERT INTO sample_results (run_id, config_id, sample_key, metric, value, extra, created_at) "
                                  "VALUES (:r, :c, :k, :m, :v, CAST(:e AS JSONB), now())"),
                             {"r": run_id, "c": config, "k": key, "m": metric, "v": value, "e": json.dumps(extra)})
        before = _rows(engine)

        upgrade(url, "head")
        after = _rows(engine)
        assert set(after) == {("d0", "generation"), ("d0", "nll")}
        assert after[("d0", "nll")] == before[("d0", "nll")]
        gen = read_row("generation", "d0", *after[("d0", "generation")])
        assert isinstance(gen, GenerationRecord)
        assert (gen.ttft_ms, gen.text, gen.prompt, gen.n_tokens, gen.prompt_tokens) == (12.5, " def f(x)", "Return the", 3, 2)
        assert gen.itl_ms == (1.5, 2.25) and gen.token_ids == (5, 6, 7) and gen.sequence == (5, 6, 7)
        assert (gen.spec.num_drafts, gen.spec.num_draft_tokens, gen.spec.num_accepted_tokens) == (2, 8, 3)
        assert gen.spec.accepted_per_position == (2, 1, 0, 0) and gen.spec_scope == "request"
        assert gen.to_row()["extra"] == OLD_GENERATION  # the record writes the layout it reads
        doc = read_row("nll", "d0", *after[("d0", "nll")])
        assert isinstance(doc, DocRecord) and doc.to_row()["extra"] == OLD_DOC and doc.n_tokens == 10

        downgrade(url, "0001")
        assert _rows(engine) == before
    finally:
        engine.dispose()


def test_informational_comparisons_become_ungated_and_back(make_database):
    url = make_database(migrate=False)
    upgrade(url, "0005")
    engine = create_engine(url, poolclass=pool.NullPool)
    insert = ("INSERT INTO comparisons (run_id, config_id, metric, estimate, ci_low, ci_high, n, verdict, rule, details, "
              "created_at) VALUES (:r, :c, :m, 0.9, 0.8, 1.0, 12, 'ok', 'x', CAST(:d AS JSONB), now())")
    try:
        with engine.begin() as conn:
            run_id, config = _one_run(conn)
            for metric, details in (("faithfulness", {"method": "offline", "informational": True}),
                                    ("lossless_exact_match", {"informational": True}),
                                    ("ppl_ratio", {"source": "x"}), ("ttft_ratio", None)):
                conn.execute(text(insert), {"r": run_id, "c": config, "m": metric, "d": json.dumps(details)})

        def rows(*cols) -> dict:
            with engine.connect() as conn:
                return {r[0]: tuple(r[1:]) for r in conn.execute(text(f"SELECT metric, {', '.join(cols)} FROM comparisons"))}

        before = rows("details")
        upgrade(url, "0006")
        assert rows("gated", "details") == {"faithfulness": (False, {"method": "offline"}),
                                            "lossless_exact_match": (False, None),
                                            "ppl_ratio": (True, {"source": "x"}), "ttft_ratio": (True, None)}
        downgrade(url, "0005")
        assert rows("details") == before
    finally:
        engine.dispose()


def test_comparison_verdicts_widen_for_measurement_error_and_back(make_database):
    url = make_database(migrate=False)
    upgrade(url, "0002")
    engine = create_engine(url, poolclass=pool.NullPool)
    insert = ("INSERT INTO comparisons (run_id, config_id, metric, estimate, ci_low, ci_high, n, verdict, rule, created_at) "
              "VALUES (:r, :c, :m, 1.2, 1.1, 1.3, 12, :v, 'x', now())")
    try:
        with engine.begin() as conn:
            run_id, config = _one_run(conn)
            conn.execute(text(insert), {"r": run_id, "c": config, "m": "ppl_ratio", "v": "critical"})
        with pytest.raises(DataError), engine.begin() as conn:  # the old width refuses the new verdict
            conn.execute(text(insert), {"r": run_id, "c": config, "m": "ttft_ms", "v": "measurement_error"})

        upgrade(url, "head")
        with engine.begin() as conn:
            conn.execute(text(insert), {"r": run_id, "c": config, "m": "ttft_ms", "v": "measurement_error"})

        def verdicts() -> dict:
            with engine.connect() as conn:
                return dict(conn.execute(text("SELECT metric, verdict FROM comparisons")).all())

        assert verdicts() == {"ppl_ratio": "critical", "ttft_ms": "measurement_error"}

        downgrade(url, "0002")
        assert verdicts() == {"ppl_ratio": "critical", "ttft_ms": "inconclusive"}
    finally:
        engine.dispose()
