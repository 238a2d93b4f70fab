"""Domain-term NLL (vocabulary/terms.py) and term_nll_ratio (evals/compare.py), worked by hand."""

from __future__ import annotations

import math

import pytest
from app import repo
from app.config_file import ConfigFileError, parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.schemas import jsonable
from app.services import apply_config_file, run_summary, start_run
from evals.compare import term_nll_ratio_comparison
from evals.perplexity import DocNLL, ppl_ratio
from evals.records import DocRecord, RunRecords
from evals.stats import Thresholds
from vocabulary.terms import compile_terms, term_nll, term_spans, term_token_mask


def test_terms_mark_the_tokens_that_overlap_them():
    text = "x = os.path.join(a)  # __init__"
    pattern = compile_terms(["builtin:python-identifiers"])
    assert term_spans(text, pattern) == [(4, 16), (23, 31)]  # os.path.join, __init__
    # tokens as a byte-level BPE cuts them: the leading space rides on the next token
    spans = [(0, 1), (1, 3), (3, 6), (6, 7), (7, 11), (11, 12), (12, 16), (16, 17), (17, 18), (18, 19),
             (19, 22), (22, 25), (25, 31)]
    assert term_token_mask(spans, term_spans(text, pattern)) == [
        False, False, True, True, True, True, True, False, False, False, False, True, True]
    logprobs = [-1.0] * 13
    logprobs[2], logprobs[12] = -3.0, -0.5  # " os" and "init__"
    # 7 term tokens: 3.0 + 4 × 1.0 + 1.0 (" __" at 22–25) + 0.5
    assert term_nll(text, logprobs, spans, pattern) == (8.5, 7)


def test_literal_and_regex_terms_and_an_engine_without_offsets():
    pattern = compile_terms(["IFRS 9.3.1.1", r"re:\bPEP \d+"])
    text = "IFRS 9.3.1.1 and PEP 8, not IFRS 9"
    assert term_spans(text, pattern) == [(0, 12), (17, 22)]  # the literal matches as written: its dots are dots
    assert term_nll(text, [-1.0, -2.0], (), pattern) is None  # no token spans: cannot say which tokens


@pytest.mark.parametrize("entry, message", [
    ("re:(", "is not a valid regular expression"),
    ("re:a*", "matches the empty string"),
    ("builtin:nope", "is not a shipped term list; known: builtin:python-identifiers"),
    ("  ", "an empty term matches everywhere"),
])
def test_a_bad_term_is_refused_naming_it(entry, message):
    with pytest.raises(ValueError, match=message):
        compile_terms([entry])
    cfg = {"project": "p", "model": {"name": "m", "path": "builtin:pydoc-target"},
           "configs": [{"name": "b", "baseline": True}],
           "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "perplexity": {"terms": ["json.dumps", entry]}}]}
    with pytest.raises(ConfigFileError) as err:
        parse_config(cfg)
    assert "suites[0].perplexity.terms" in str(err.value) and "terms[1]:" in str(err.value)


def test_a_term_threshold_without_terms_is_refused():
    cfg = {"project": "p", "model": {"name": "m", "path": "builtin:pydoc-target"},
           "configs": [{"name": "b", "baseline": True}], "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout"}],
           "thresholds": {"term_nll_ratio": {"warn": 1.05}}}
    with pytest.raises(ConfigFileError, match=r"thresholds.term_nll_ratio: no suite lists perplexity.terms"):
        parse_config(cfg)


def _doc(key: str, nll: float, term_nll: float | None, term_tokens: int | None, cluster: str | None = None):
    return DocRecord(key, nll, 100, 20, 400, cluster=cluster, term_nll=term_nll, term_tokens=term_tokens)


def test_term_nll_ratio_by_hand():
    # three documents with 4, 6 and 0 term tokens; the candidate loses 1.0 nat on the first's terms and
    # 2.0 on the second's: exp(3.0 / 10) on the terms, while the documents' 300 tokens see exp(3.0 / 300)
    base = {"a": _doc("a", 50.0, 4.0, 4), "b": _doc("b", 60.0, 3.0, 6), "c": _doc("c", 40.0, 0.0, 0)}
    cand = {"a": _doc("a", 51.0, 5.0, 4), "b": _doc("b", 62.0, 5.0, 6), "c": _doc("c", 40.0, 0.0, 0)}
    c = term_nll_ratio_comparison(cand, base, Thresholds(warn=1.15, critical=1.30, min_n=2))
    assert c.estimate == pytest.approx(math.exp(0.3))
    assert c.n == 2 and c.details["term_tokens"] == 10  # the document without terms says nothing
    assert c.baseline_value == pytest.approx(math.exp(7.0 / 10)) and c.candidate_value == pytest.approx(math.exp(1.0))
    # two documents: a resample is (a, a) with ratio exp(1/4), (b, b) exp(2/6) or mixed exp(0.3), a quarter
    # of the time each of the first two, so the 95 % interval is [exp(1/4), exp(1/3)]
    assert (c.ci_low, c.ci_high) == (pytest.approx(math.exp(0.25)), pytest.approx(math.exp(1 / 3)))
    assert c.verdict == "warn"  # CI low 1.284 ≥ warn 1.15, below critical 1.30 (the estimate 1.35 is above it)
    # the same loss over the whole documents: exp(3 / 300) = 1.010, well inside the ppl_ratio budget
    whole = ppl_ratio([DocNLL(k, d.nll, d.n_tokens, 20, 400) for k, d in base.items()],
                      [DocNLL(k, d.nll, d.n_tokens, 20, 400) for k, d in cand.items()], Thresholds(1.15, 1.30, min_n=2))
    assert whole.estimate == pytest.approx(math.exp(0.01)) and whole.verdict == "ok"


def test_term_nll_ratio_says_why_it_cannot_be_computed():
    base = {"a": _doc("a", 50.0, 4.0, 4)}
    http = {"a": _doc("a", 50.0, None, None)}  # an engine that gave no token spans
    c = term_nll_ratio_comparison(http, base, Thresholds(warn=1.15))
    assert c.verdict == "inconclusive" and "candidate's engine did not place its tokens" in c.rule
    other_tokenizer = {"a": _doc("a", 50.0, 4.0, 5)}
    assert "same tokenizer" in term_nll_ratio_comparison(other_tokenizer, base, Thresholds(warn=1.15)).rule
    none = {"a": _doc("a", 50.0, 0.0, 0)}
    assert "no scored document contains" in term_nll_ratio_comparison(none, none, Thresholds(warn=1.15)).rule


def test_the_record_round_trips_its_term_figures():
    doc = _doc("a", 50.0, 4.5, 4)
    row = doc.to_row()
    assert DocRecord.from_row(row["sample_key"], row["value"], row["extra"]) == doc
    plain = _doc("a", 50.0, None, None)
    assert "term_tokens" not in plain.to_row()["extra"]
    assert DocRecord.from_row("a", 50.0, plain.to_row()["extra"]) == plain


TERMS_CONFIG = {
    "project": "terms",
    "model": {"name": "tiny", "path": "builtin:pydoc-target"},
    "configs": [{"name": "fp32", "baseline": True, "engine": "reference", "weights": "fp32"},
                {"name": "int2", "engine": "reference", "weights": "rtn-int2"}],
    "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 12, "seed": 1, "scorers": ["perplexity"],
                "perplexity": {"window": 64, "terms": ["builtin:python-identifiers"]}}],
}


def test_a_run_stores_each_documents_term_loss_and_compares_it(sqlite_env):
    """The reference engine places its tokens in the text; the stored term sums give the ratio."""
    with session_scope() as session:
        apply_config_file(session, parse_config(TERMS_CONFIG))
    run_id, _ = start_run("terms", "s", None, InlineDispatcher())
    with session_scope() as session:
        run = repo.get_run(session, repo.get_project(session, "terms"), run_id)
        summary = jsonable(run_summary(session, run))
        table = RunRecords.from_rows(repo.sample_rows(session, run_id))
        ids = {cr.config.name: cr.config_id for cr in run.config_runs}
    base, cand = table[ids["fp32"]].docs, table[ids["int2"]].docs
    assert all(d.term_tokens is not None for d in (*base.values(), *cand.values()))
    held = [k for k, d in base.items() if d.term_tokens]
    assert held and all(cand[k].term_tokens == base[k].term_tokens for k in held)  # the same tokens on both sides
    assert all(0 < base[k].term_nll < base[k].nll for k in held)  # a part of the document's loss
    term = next(c for c in summary["comparisons"] if c["metric"] == "term_nll_ratio")
    expected = math.exp(sum(cand[k].term_nll - base[k].term_nll for k in held) / sum(base[k].term_tokens for k in held))
    assert term["config"] == "int2" and term["n"] == len(held)
    assert term["estimate"] == pytest.approx(expected, rel=1e-9) and term["estimate"] > 1  # 2-bit weights lose
