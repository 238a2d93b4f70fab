"""Domain perplexity: token, word and byte perplexity over strided windows, per-document
negative log-likelihood sums, and the paired ratio candidate / baseline.

Definitions (lm-eval-harness, docs/reference.md §4), Σ over documents:
    token_ppl = exp(Σnll / Σtokens)   word_ppl = exp(Σnll / Σwords)   byte_ppl = exp(Σnll / Σbytes)
    bits_per_byte = Σnll / (Σbytes · ln 2)
    ppl_ratio = token_ppl(candidate) / token_ppl(baseline) = exp((Σnll_c − Σnll_b) / Σtokens)
The ratio is paired: both configs score the same documents with the same tokenizer and windows,
and the bootstrap resamples source documents (clusters of chunks), keeping each document's two
NLLs together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engines.protocol import RollingResult
from evals.stats import Thresholds, decide, paired_bootstrap_ci
from vocabulary.comparison import Comparison

PPL_RATIO_THRESHOLDS = Thresholds.seed("ppl_ratio")


@dataclass(frozen=True)
class DocNLL:
    doc_id: str
    nll: float  # Σ −log p over the document's tokens, nats
    n_tokens: int
    n_words: int
    n_bytes: int
    cluster: str | None = None  # source document this sample was cut from (clustered bootstrap)

    @classmethod
    def from_result(cls, r: RollingResult, cluster: str | None = None) -> DocNLL:
        return cls(r.doc_id, r.nll, len(r.token_ids), r.n_words, r.n_bytes, cluster)


@dataclass(frozen=True)
class Perplexity:
    token_ppl: float
    word_ppl: float
    byte_ppl: float
    bits_per_byte: float
    n_docs: int
    n_tokens: int


def corpus_perplexity(docs: Sequence[DocNLL]) -> Perplexity:
    if not docs:
        raise ValueError("no documents to score")
    nll = sum(d.nll for d in docs)
    toks = sum(d.n_tokens for d in docs)
    words = sum(d.n_words for d in docs)
    nbytes = sum(d.n_bytes for d in docs)
    return Perplexity(
        token_ppl=math.exp(nll / toks),
        word_ppl=math.exp(nll / words) if words else math.nan,
        byte_ppl=math.exp(nll / nbytes),
        bits_per_byte=nll / (nbytes * math.log(2)),
        n_docs=len(docs),
        n_tokens=toks,
    )


def token_mismatch(baseline: Sequence[DocNLL], candidate: Sequence[DocNLL]) -> str | None:
    """Why the two configs' documents cannot be paired token for token, or None: the first document
    both scored with a different number of tokens, and how many more do."""
    cand = {d.doc_id: d for d in candidate}
    off = [(b, cand[b.doc_id]) for b in baseline if b.doc_id in cand and cand[b.doc_id].n_tokens != b.n_tokens]
    if not off:
        return None
    b, c = off[0]
    more = f" (and {len(off) - 1} more documents)" if len(off) > 1 else ""
    hint = (" one engine begins the text with a start token the other does not (an engine: openai config can set "
            "engine_options.start_token_id, or serve /tokenizer_info)" if abs(b.n_tokens - c.n_tokens) == 1 else
            " they tokenize it differently")
    return (f"token counts differ: document '{b.doc_id}' has {b.n_tokens} tokens on the baseline and {c.n_tokens} "
            f"on this config{more}; a token perplexity ratio needs the same tokens on both sides, and{hint}")


def pair(baseline: Sequence[DocNLL], candidate: Sequence[DocNLL]) -> list[tuple[DocNLL, DocNLL]]:
    """Documents scored by both configs, in baseline order; token counts must agree."""
    cand = {d.doc_id: d for d in candidate}
    pairs = []
    for b in baseline:
        c = cand.get(b.doc_id)
        if c is None:
            continue
        if c.n_tokens != b.n_tokens:
            raise ValueError(
                f"document '{b.doc_id}' has {b.n_tokens} baseline tokens but {c.n_tokens} candidate tokens; "
                "token perplexity ratios need the same tokenizer (compare word or byte perplexity instead)"
            )
        pairs.append((b, c))
    return pairs


def ppl_ratio(
    baseline: Sequence[DocNLL],
    candidate: Sequence[DocNLL],
    thresholds: Thresholds = PPL_RATIO_THRESHOLDS,
    *,
    n_resamples: int = 2000,
    seed: int = 0,
) -> Comparison:
    pairs = pair(baseline, candidate)
    n = len(pairs)
    if n == 0:
        return Comparison("ppl_ratio", math.nan, math.nan, math.nan, 0, "inconclusive", "no paired documents")
    nll_b = np.array([b.nll for b, _ in pairs])
    nll_c = np.array([c.nll for _, c in pairs])
    toks = np.array([b.n_tokens for b, _ in pairs], dtype=np.float64)
    diff = nll_c - nll_b
    clusters = [b.cluster or b.doc_id for b, _ in pairs]
    n_clusters = len(set(clusters))
    estimate = math.exp(diff.sum() / toks.sum())
    lo, hi = paired_bootstrap_ci(lambda w: np.exp((w @ diff) / (w @ toks)), n, clusters=clusters,
                                 n_resamples=n_resamples, seed=seed)
    # Independent evidence is per source document: min_n counts clusters, not chunks.
    verdict, rule = decide(estimate, lo, hi, n_clusters, thresholds)
    ppl_b = corpus_perplexity([b for b, _ in pairs])
    ppl_c = corpus_perplexity([c for _, c in pairs])
    return Comparison(
        metric="ppl_ratio",
        estimate=estimate,
        ci_low=lo,
        ci_high=hi,
        n=n,
        verdict=verdict,
        rule=rule,
        baseline_value=ppl_b.token_ppl,
        candidate_value=ppl_c.token_ppl,
        details={
            "baseline_word_ppl": ppl_b.word_ppl,
            "candidate_word_ppl": ppl_c.word_ppl,
            "baseline_byte_ppl": ppl_b.byte_ppl,
            "candidate_byte_ppl": ppl_c.byte_ppl,
            "delta_nll_per_token": float(diff.sum() / toks.sum()),
            "n_tokens": int(toks.sum()),
            "n_clusters": n_clusters,
            "n_resamples": n_resamples,
        },
    )
