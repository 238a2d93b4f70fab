"""Lossless means exact: which configs must reproduce the baseline's greedy outputs
(engines.spec.lossless_against), and the comparison that gates them (evals.compare
lossless_exact_comparison), on outputs worked out by hand; then a whole embedded run where a
config that claims to be lossless is not."""

from __future__ import annotations

import pytest
from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.schemas import jsonable
from app.services import apply_config_file, run_summary, start_run
from engines.spec import OptimizationSpec
from engines.spec import lossless_against as lossless
from evals.compare import lossless_exact_comparison
from evals.records import GenerationRecord
from evals.stats import Thresholds

SEED = Thresholds.seed("lossless_exact_match")  # warn 1.0, critical 0.9, min_n 10


def spec(**axes) -> OptimizationSpec:
    return OptimizationSpec(engine=axes.pop("engine", "reference"), **axes)


def test_which_configs_must_be_exact():
    fp16 = spec(weights="fp16")
    assert lossless(spec(weights="fp16", speculative={"method": "ngram", "k": 4}), fp16)  # spec decode, greedy verify
    assert lossless(spec(weights="fp16", kv_cache="fp16"), fp16)  # 'auto' is the model's own dtype
    assert lossless(spec(engine="openai", weights="fp16", engine_options={"base_url": "http://h/v1"}), fp16)
    assert not lossless(spec(weights="int8"), fp16)
    assert not lossless(spec(weights="fp16", kv_cache="fp8"), fp16)
    assert not lossless(spec(weights="fp32"), fp16)  # another precision: near-ties may flip
    assert lossless(spec(weights="fp32", lossless=True), fp16) and not lossless(spec(weights="fp16", lossless=False), fp16)
    assert "lossless" not in spec(weights="fp16").model_dump()  # unset: the stored config is as before


def gens(outputs: list[tuple[int, ...]]) -> dict[str, GenerationRecord]:
    return {f"p{i}": GenerationRecord(f"p{i}", 5.0, "prompt", "", len(ids), 3, token_ids=ids) for i, ids in enumerate(outputs)}


BASE = [(1, 2, 3, 4)] * 12


def test_twelve_identical_outputs_are_ok():
    c = lossless_exact_comparison(gens(BASE), gens(BASE), SEED)
    # Wilson 12/12: centre (1 + z²/24)/(1 + z²/12), half z·sqrt(z²/576)/(1 + z²/12): [0.7575, 1]
    assert (c.verdict, c.estimate, c.n) == ("ok", 1.0, 12)
    assert c.ci_low == pytest.approx(0.7575, abs=1e-4) and c.ci_high == pytest.approx(1.0)
    assert c.rule == "12 of 12 outputs identical to the baseline's" and c.details["first_divergence"] == {}


def test_one_divergent_output_is_a_warn_naming_where_it_diverged():
    c = lossless_exact_comparison(gens([(1, 2, 9, 4)] + BASE[1:]), gens(BASE), SEED)
    assert (c.verdict, c.estimate) == ("warn", pytest.approx(11 / 12))
    assert c.details["first_divergence"] == {"p0": 2} and c.details["matches"] == 11
    assert c.rule == "1 of 12 outputs diverge confidently from the baseline's; lossless should be exact"  # unscored: confident


def test_half_divergent_is_critical():
    # 6/12: Wilson centre 0.5, half 1.96·sqrt(0.25/12 + z²/576)/(1 + z²/12) = 0.2462 → high 0.7462 ≤ 0.9
    cand = [(1, 2, 3)] * 6 + BASE[6:]  # the first six stop one token early: divergence at index 3
    c = lossless_exact_comparison(gens(cand), gens(BASE), SEED)
    assert c.verdict == "critical" and c.ci_high == pytest.approx(0.7462, abs=1e-4)
    assert c.details["first_divergence"] == {f"p{i}": 3 for i in range(6)}


def test_too_few_prompts_decide_nothing_and_texts_compare_when_ids_are_missing():
    c = lossless_exact_comparison(gens(BASE[:5]), gens(BASE[:5]), SEED)
    assert c.verdict == "inconclusive" and c.rule == "n=5 < min_n=10: too few samples to decide"
    # an HTTP engine gives text only: both sides compare as text, not ids against a string
    text = {k: GenerationRecord(k, 5.0, "p", " def f(x):", 4, 3) for k in gens(BASE)}
    with_ids = {k: GenerationRecord(k, 5.0, "p", " def f(x):", 4, 3, token_ids=(1, 2, 3, 4)) for k in gens(BASE)}
    assert lossless_exact_comparison(text, with_ids, SEED).verdict == "ok"


LOSSLESS_CONFIG = {
    "project": "exact",
    "model": {"name": "tiny", "path": "builtin:pydoc-target"},
    "configs": [
        {"name": "fp32", "baseline": True, "engine": "reference", "weights": "fp32"},
        {"name": "ngram", "engine": "reference", "weights": "fp32", "speculative": {"method": "ngram", "k": 3}},
        # claims to compute what the baseline computes, but quantizes to 2 bits
        {"name": "claims-lossless", "engine": "reference", "weights": "rtn-int2", "lossless": True},
    ],
    "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 10, "seed": 3, "perplexity": {"window": 32},
                "generation": {"prompts": 10, "prompt_words": 6, "max_new_tokens": 8}}],
}


@pytest.mark.integration
def test_a_run_gates_lossless_configs_on_exact_outputs(sqlite_env):
    with session_scope() as session:
        apply_config_file(session, parse_config(LOSSLESS_CONFIG))
    run_id, _ = start_run("exact", "s", None, InlineDispatcher())
    with session_scope() as session:
        summary = jsonable(run_summary(session, repo.get_run(session, repo.get_project(session, "exact"), run_id)))
    exact = {c["config"]: c for c in summary["comparisons"] if c["metric"] == "lossless_exact_match"}
    assert set(exact) == {"ngram", "claims-lossless"}  # the baseline is not compared with itself
    assert exact["ngram"]["verdict"] == "ok" and exact["ngram"]["estimate"] == 1.0  # greedy verification is exact
    bad = exact["claims-lossless"]
    assert bad["verdict"] in ("warn", "critical") and bad["details"]["first_divergence"]
    assert summary["verdict"] in ("warn", "fail") and "claims-lossless lossless_exact_match" in summary["verdict_reason"]
