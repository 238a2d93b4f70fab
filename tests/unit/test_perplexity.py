"""Perplexity figures from per-document NLLs worked out by hand."""

import math

import pytest
from evals.perplexity import DocNLL, corpus_perplexity, ppl_ratio

LN2 = math.log(2)


def test_corpus_perplexity_by_hand():
    # Two documents, every token at p = 1/2: Σnll = 30·ln 2 over 30 tokens → token ppl 2.
    docs = [DocNLL("a", 10 * LN2, 10, 5, 40), DocNLL("b", 20 * LN2, 20, 10, 80)]
    p = corpus_perplexity(docs)
    assert p.token_ppl == pytest.approx(2.0)
    assert p.word_ppl == pytest.approx(2.0**2)  # 30 ln2 / 15 words
    assert p.byte_ppl == pytest.approx(2.0**0.25)  # 30 ln2 / 120 bytes
    assert p.bits_per_byte == pytest.approx(0.25)
    assert p.n_tokens == 30


def test_ratio_by_hand_and_verdict():
    # Candidate adds 0.3 nats to each 10-token document: ratio = exp(0.03) for every resample.
    base = [DocNLL(str(i), 20.0, 10, 6, 50) for i in range(12)]
    cand = [DocNLL(str(i), 20.3, 10, 6, 50) for i in range(12)]
    c = ppl_ratio(base, cand)
    assert c.estimate == pytest.approx(math.exp(0.03))
    assert c.ci_low == pytest.approx(math.exp(0.03)) and c.ci_high == pytest.approx(math.exp(0.03))
    assert c.verdict == "ok" and c.n == 12
    assert c.baseline_value == pytest.approx(math.exp(2.0))


def test_ratio_is_paired_by_document():
    # Documents differ wildly in difficulty, but the candidate is uniformly 20 % worse in ppl:
    # pairing makes the CI tight and the verdict warn (1.15 ≤ 1.2 < 1.30).
    base = [DocNLL(str(i), float(5 + 7 * i), 10, 5, 40) for i in range(30)]
    cand = [DocNLL(str(i), float(5 + 7 * i) + 10 * math.log(1.2), 10, 5, 40) for i in range(30)]
    c = ppl_ratio(list(reversed(base)), cand)
    assert c.estimate == pytest.approx(1.2)
    assert c.ci_high - c.ci_low < 1e-9
    assert c.verdict == "warn"


def test_ratio_too_few_documents_is_inconclusive():
    base = [DocNLL(str(i), 10.0, 10, 5, 40) for i in range(5)]
    c = ppl_ratio(base, base)
    assert c.estimate == pytest.approx(1.0)
    assert c.verdict == "inconclusive" and "too few" in c.rule


def test_token_mismatch_is_an_error():
    with pytest.raises(ValueError, match="same tokenizer"):
        ppl_ratio([DocNLL("a", 1.0, 10, 1, 1)], [DocNLL("a", 1.0, 11, 1, 1)])
