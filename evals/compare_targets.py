"""The compare target of each metric row (vocabulary/metrics.py, `Metric.compare`): one config's typed
records and its run's context in, that metric's comparison out, or None when the config has
nothing to compare on it (no generations, the baseline itself, a scorer the suite does not run).

The aggregation (workers/aggregate.py) builds one `CompareContext` per config and loops over the
table (`config_comparisons`), so adding a metric is its row, its target here (or in any module
the row names) and its test: nothing under workers/ changes.

Each target only chooses its inputs from the records; the statistics live in evals/compare.py
and evals/field.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from evals import compare, sanity
from evals.field import (
    batch_divergence_comparison,
    confident_divergence_comparison,
    early_stop_share,
    health_share,
    output_length_comparison,
)
from evals.health import NEAR_TIE_NATS
from evals.perplexity import DocNLL, token_mismatch
from evals.records import ConfigRecords, GenerationRecord
from evals.stats import Thresholds
from vocabulary.comparison import Comparison
from vocabulary.figures import RunFigures
from vocabulary.metrics import METRICS


@dataclass(frozen=True)
class CompareContext:
    """What one config's comparisons read: its records, the baseline's, and the run's settings."""

    mine: ConfigRecords
    base: ConfigRecords
    thresholds: Callable[[str], Thresholds]  # the run's thresholds for a metric on this config
    seed: int = 0
    is_base: bool = False  # the baseline itself: only the metrics judged on their own (baseline_compared)
    figures: RunFigures | None = None  # the config-run's figures (its KV cache peak, a baseline scoring error)
    failed_scorers: Mapping[str, str] = field(default_factory=dict)  # scorer → why it failed on this run
    scorers: Sequence[str] = ()  # the suite's scorers
    greedy: bool = False  # the suite generates at temperature 0
    lossless: bool = False  # a candidate whose greedy outputs must equal the baseline's (engines.spec.lossless_against)
    tau: float = NEAR_TIE_NATS  # the suite's near-tie gap in nats

    @cached_property
    def logprob_problem(self) -> str | None:
        """The first side whose prompt log-probs cannot be right, named (evals/sanity.py)."""
        for side, records in (("candidate", self.mine), ("baseline", self.base)):
            problem = sanity.logprob_problem(list(records.docs.values()), f"the {side}'s")
            if problem:
                return problem
        return None

    @cached_property
    def timed(self) -> list[GenerationRecord]:
        """The candidate's generations that were timed (an answer with a first token)."""
        return [g for g in self.mine.generations.values() if g.ttft_ms is not None]


def config_comparisons(ctx: CompareContext) -> list[Comparison]:
    """Every comparison of one config, in the table's order: each row's target called once. An
    estimate outside its metric's valid range is no result (evals/sanity.py)."""
    out: list[Comparison] = []
    for metric in METRICS.values():
        if metric.compare:
            found = metric.compare_target()(ctx)
            if found is not None:
                out.append(found)
    return [sanity.checked(c) for c in out]


def _doc_nlls(records: ConfigRecords) -> list[DocNLL]:
    return [DocNLL(d.sample_key, d.nll, d.n_tokens, d.n_words, d.n_bytes, d.cluster) for d in records.docs.values()]


def _batches(generations: list[GenerationRecord]) -> list:
    """The batch of each generation, for a clustered CI; a generation of an older run (no batch
    stored) is its own."""
    return [g.batch if g.batch is not None else g.sample_key for g in generations]


def ppl_ratio(ctx: CompareContext) -> Comparison | None:
    if ctx.is_base:
        return None
    if ctx.logprob_problem:  # NaN or impossible log-probs: no ratio is computed from them
        return sanity.as_measurement_error(compare.unscored("ppl_ratio", ""), ctx.logprob_problem)
    base, mine = _doc_nlls(ctx.base), _doc_nlls(ctx.mine)
    mismatch = token_mismatch(base, mine)  # another tokenization (a start token added on one side only)
    if mismatch:
        return sanity.as_measurement_error(compare.unscored("ppl_ratio", ""), mismatch)
    ratio = compare.ppl_ratio(base, mine, ctx.thresholds("ppl_ratio"), seed=ctx.seed)
    buckets = compare.ppl_ratio_by_position(ctx.mine.docs, ctx.base.docs, ctx.thresholds("ppl_ratio"), seed=ctx.seed)
    return with_buckets(ratio, buckets, "positions")


def with_buckets(ratio: Comparison, buckets: list[dict], what: str) -> Comparison:
    """A ratio with its position buckets in details["by_position"] (none with one bucket: it is
    the whole ratio again), its rule naming the worst bucket whose own verdict is worse than the
    whole's: reported, not judged, a late loss that the whole ratio averages away."""
    if len(buckets) < 2:
        return ratio
    rule = ratio.rule
    alarm = {"warn": 1, "critical": 2}
    worse = [b for b in buckets if alarm.get(b["verdict"], 0) > alarm.get(ratio.verdict, 0)]
    if worse:
        w = max(worse, key=lambda b: (alarm[b["verdict"]], b["lo"]))
        rule += (f"; {what} {w['positions']}: {w['verdict']} on their own "
                 f"({w['estimate']:.4g} [{w['ci_low']:.4g}, {w['ci_high']:.4g}])")
    return replace(ratio, rule=rule, details={**ratio.details, "by_position": buckets})


def decode_nll_ratio(ctx: CompareContext) -> Comparison | None:
    """The documents a lossy-KV config also scored one token per decode step (suite
    perplexity.decode_samples) against the baseline's: its own decode pass where it has one, else
    its rolling pass (a lossless cache gives back what was written). details: the same documents'
    prefill ratio and the gap between the two, decode ÷ prefill, and the decode pass by position."""
    if ctx.is_base or ctx.logprob_problem:
        return None
    keys = [k for k, d in ctx.mine.docs.items() if d.decode_nll is not None and k in ctx.base.docs]
    if not keys:
        return None
    t = ctx.thresholds("ppl_ratio")  # reported, not gated: the verdict ppl_ratio's budget would give it

    def decoded(records: ConfigRecords, fall_back: bool) -> dict:
        return {k: replace(d, nll=d.decode_nll, positions=d.decode_positions) if d.decode_nll is not None
                else d for k in keys if (d := records.docs[k]).decode_nll is not None or fall_back}

    mine, base = decoded(ctx.mine, False), decoded(ctx.base, True)
    nlls = {side: [DocNLL(k, d.nll, d.n_tokens, d.n_words, d.n_bytes, d.cluster) for k, d in docs.items()]
            for side, docs in (("mine", mine), ("base", base))}
    ratio = replace(compare.ppl_ratio(nlls["base"], nlls["mine"], t, seed=ctx.seed), metric="decode_nll_ratio")
    prefill = compare.ppl_ratio([n for n in _doc_nlls(ctx.base) if n.doc_id in mine],
                                [n for n in _doc_nlls(ctx.mine) if n.doc_id in mine], t, seed=ctx.seed)
    gap = ratio.estimate / prefill.estimate
    buckets = compare.ppl_ratio_by_position(mine, base, t, seed=ctx.seed)
    return replace(ratio, rule=f"{ratio.rule}; decode ÷ prefill on these documents {gap:.4g}", gated=False,
                   details={**ratio.details, "prefill_ratio": prefill.estimate, "prefill_decode_gap": gap,
                            "by_position": buckets})


def kld_mean(ctx: CompareContext) -> Comparison | None:
    """Only on the documents a candidate compared next-token distributions on (suite
    perplexity.distribution_samples): llama-perplexity --kl-divergence's figures. Whole
    distributions where the candidate's config-run compared them with the baseline engine's
    (in-process on both sides); else the candidate's stored top-k table against the baseline's,
    stored once by the baseline's config-run (a server gives only its top k)."""
    from evals.distribution import doc_distribution_stored, kld_comparison

    if ctx.is_base:
        return None
    found = []
    for k, d in ctx.mine.docs.items():
        dist = d.distribution
        if dist is None and d.topk is not None and (b := ctx.base.docs.get(k)) is not None and b.topk is not None:
            dist = doc_distribution_stored(b.topk, d.topk)
        if dist is not None:
            found.append((k, d.cluster or k, dist))
    if not found:
        return None
    return kld_comparison([(k, d) for k, _, d in found], seed=ctx.seed, min_n=METRICS["kld_mean"].min_n,
                          clusters=[c for _, c, _ in found])


def term_nll_ratio(ctx: CompareContext) -> Comparison | None:
    """Only when the suite lists domain terms: their tokens' loss, which whole documents average away."""
    docs = (*ctx.mine.docs.values(), *ctx.base.docs.values())
    if ctx.is_base or ctx.logprob_problem or all(d.term_tokens is None for d in docs):
        return None
    return compare.term_nll_ratio_comparison(ctx.mine.docs, ctx.base.docs, ctx.thresholds("term_nll_ratio"),
                                             seed=ctx.seed)


def ttft_ms(ctx: CompareContext) -> Comparison | None:
    """A service budget on the candidate; the baseline's own speed is the reference."""
    if ctx.is_base or not ctx.timed:
        return None
    return compare.ttft_comparison([g.ttft_ms for g in ctx.timed if g.ttft_ms is not None],
                                   ctx.thresholds("ttft_ms"), seed=ctx.seed)


def ttft_ratio(ctx: CompareContext) -> Comparison | None:
    paired = [g for g in ctx.timed if g.ttft_ms is not None and g.paired_baseline_ttft_ms is not None]
    if ctx.is_base or not paired:
        return None
    pairs = [(g.ttft_ms, g.paired_baseline_ttft_ms) for g in paired
             if g.ttft_ms is not None and g.paired_baseline_ttft_ms is not None]  # again, for the type checker
    return compare.paired_timing_ratio("ttft_ratio", pairs, ctx.thresholds("ttft_ratio"), seed=ctx.seed,
                                       batches=_batches(paired))


def tpot_ratio(ctx: CompareContext) -> Comparison | None:
    both = [g for g in ctx.timed if g.paired_baseline_ttft_ms is not None
            and g.tpot_ms is not None and g.paired_baseline_tpot_ms is not None]
    if ctx.is_base or not both:
        return None
    pairs = [(g.tpot_ms, g.paired_baseline_tpot_ms) for g in both
             if g.tpot_ms is not None and g.paired_baseline_tpot_ms is not None]
    return compare.paired_timing_ratio("tpot_ratio", pairs, ctx.thresholds("tpot_ratio"), seed=ctx.seed,
                                       batches=_batches(both))


def spec_acceptance_rate(ctx: CompareContext) -> Comparison | None:
    stats = [g.spec for g in ctx.timed if g.spec is not None]
    if not stats:
        return None
    acceptance = compare.acceptance_comparison([x.num_draft_tokens for x in stats],
                                               [x.num_accepted_tokens for x in stats],
                                               ctx.thresholds("spec_acceptance_rate"), seed=ctx.seed)
    return sanity.checked(acceptance, sanity.spec_counter_problem(list(ctx.mine.generations.values())))


def kv_cache_usage(ctx: CompareContext) -> Comparison | None:
    """An engine that cannot tell says nothing, rather than 'inconclusive'."""
    usage = ctx.figures.kv_cache_usage if ctx.figures else None
    if usage is None:
        return None
    return compare.peak_comparison("kv_cache_usage", usage, ctx.thresholds("kv_cache_usage"),
                                   "peak over the config-run")


def gen_nll_ratio(ctx: CompareContext) -> Comparison | None:
    if ctx.is_base or not ctx.timed:
        return None
    scoring_error = ctx.figures.baseline_scoring_error if ctx.figures else None
    if scoring_error:
        return compare.unscored("gen_nll_ratio", f"the baseline model could not score outputs: {scoring_error}")
    t = ctx.thresholds("gen_nll_ratio")
    ratio = compare.gen_nll_ratio_comparison(ctx.mine.generations, ctx.base.generations, t, seed=ctx.seed)
    if ratio.estimate is None:
        return ratio
    buckets = compare.gen_nll_ratio_by_position(ctx.mine.generations, ctx.base.generations, t, seed=ctx.seed)
    return with_buckets(ratio, buckets, "answer tokens")


def _health(metric: str) -> Callable[[CompareContext], Comparison | None]:
    def target(ctx: CompareContext) -> Comparison | None:
        if ctx.is_base or not ctx.timed:
            return None
        return health_share(metric, ctx.mine.generations, ctx.base.generations, ctx.thresholds(metric), seed=ctx.seed)

    target.__name__ = metric
    return target


empty_answers = _health("empty_answers")
degenerate_answers = _health("degenerate_answers")
max_tokens_hits = _health("max_tokens_hits")


def early_stops(ctx: CompareContext) -> Comparison | None:
    if ctx.is_base or not ctx.timed:
        return None
    return early_stop_share(ctx.mine.generations, ctx.base.generations, ctx.mine.repeats, ctx.thresholds("early_stops"),
                            seed=ctx.seed)


def output_length_ratio(ctx: CompareContext) -> Comparison | None:
    if ctx.is_base or not ctx.timed:
        return None
    return output_length_comparison(ctx.mine.generations, ctx.base.generations, ctx.thresholds("output_length_ratio"),
                                    seed=ctx.seed)


def batch_divergence(ctx: CompareContext) -> Comparison | None:
    if ctx.is_base or not ctx.timed:
        return None
    return batch_divergence_comparison(ctx.mine.generations, ctx.mine.solos, ctx.base.generations, ctx.base.solos,
                                       ctx.thresholds("batch_divergence"), seed=ctx.seed, tau=ctx.tau)


def lossless_exact_match(ctx: CompareContext) -> Comparison | None:
    if not (ctx.lossless and ctx.greedy):
        return None
    return compare.lossless_exact_comparison(ctx.mine.generations, ctx.base.generations,
                                             ctx.thresholds("lossless_exact_match"), ctx.mine.repeats, tau=ctx.tau)


def confident_divergence(ctx: CompareContext) -> Comparison | None:
    if not (ctx.lossless and ctx.greedy):
        return None
    return confident_divergence_comparison(ctx.mine.generations, ctx.base.generations, ctx.mine.repeats,
                                           ctx.thresholds("confident_divergence"), seed=ctx.seed, tau=ctx.tau)


def faithfulness(ctx: CompareContext) -> Comparison | None:
    """Judged on the baseline too (its own absolute threshold)."""
    failed = ctx.failed_scorers.get("faithfulness")
    if failed is not None:
        return compare.unscored("faithfulness", f"scorer 'faithfulness' failed: {failed}")
    if not ctx.mine.faithfulness:
        return None
    return compare.faithfulness_comparison(list(ctx.mine.faithfulness.values()), list(ctx.base.faithfulness.values()),
                                           ctx.thresholds("faithfulness"), ctx.seed)


def judge_win_rate(ctx: CompareContext) -> Comparison | None:
    if ctx.is_base:
        return None
    failed = ctx.failed_scorers.get("judge")
    if failed is not None:  # said once, on the judge's headline metric
        return compare.unscored("judge_win_rate", f"scorer 'judge' failed: {failed}")
    if not ctx.mine.pairwise:
        return None
    return compare.judge_win_rate_comparison(list(ctx.mine.pairwise.values()), ctx.thresholds("judge_win_rate"),
                                             ctx.seed)


def judge_score_delta(ctx: CompareContext) -> Comparison | None:
    if ctx.is_base or ctx.failed_scorers.get("judge") is not None or not ctx.mine.rubric:
        return None
    return compare.judge_score_delta_comparison(ctx.mine.rubric, ctx.base.rubric, ctx.thresholds("judge_score_delta"),
                                                ctx.seed)


def exact_match(ctx: CompareContext) -> Comparison | None:
    if ctx.is_base or "agreement" not in ctx.scorers:
        return None
    return compare.exact_match_comparison(ctx.mine.generations, ctx.base.generations)


def top1_agreement(ctx: CompareContext) -> Comparison | None:
    if ctx.is_base or "agreement" not in ctx.scorers:
        return None
    pairs = [(b.greedy_ids, d.greedy_ids, d.cluster) for d in ctx.mine.docs.values()
             if (b := ctx.base.docs.get(d.sample_key)) is not None and d.greedy_ids and b.greedy_ids
             and len(d.greedy_ids) == len(b.greedy_ids)]
    from evals.distribution import top1_agreement_comparison

    return top1_agreement_comparison(pairs, ctx.seed)


def task_recovery(ctx: CompareContext) -> Comparison | None:
    if ctx.is_base or "labelled" not in ctx.scorers:
        return None
    from evals.flips import recovery_comparison

    return recovery_comparison(ctx.mine.items, ctx.base.items, ctx.thresholds("task_recovery"), ctx.seed)


def task_flips(ctx: CompareContext) -> Comparison | None:
    if ctx.is_base or "labelled" not in ctx.scorers:
        return None
    from evals.flips import flips_comparison

    return flips_comparison(ctx.mine.items, ctx.base.items, ctx.thresholds("task_flips"), tau=ctx.tau)
