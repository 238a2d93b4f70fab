"""The metric table: one row per comparison metric, the one place a metric's identity lives
(in the manner of lm-eval's `register_metric`: a metric describes itself).

Everything else derives from it: the thresholds a canary.yaml accepts and their defaults
(app/config_file.py), the alert rules the API accepts, the Prometheus gauges (app/prometheus.py),
the API's catalogue (GET /api/v1/metrics) that the dashboard reads for its columns, the
Prometheus alerting rules file (`canary alert-rules`), and the verdict order used by the
statistics, the aggregation and the exporters.

Torch-free and numpy-free: app/ imports it (the API image stays small).

Adding a metric: its row here, naming its compare target (evals/compare_targets.py, which the
aggregation calls for every row), its producer (the engine or scorer that measures it) and its test.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

Direction = Literal["above", "below"]  # the side of the threshold that is bad
# how a candidate is compared:
#   paired_ratio       candidate / baseline over paired samples (CI by paired bootstrap)
#   paired_difference  candidate − baseline over paired samples (CI by paired bootstrap)
#   rate               Σ successes / Σ trials of the candidate alone (CI by bootstrap or Wilson)
#   mean               mean of per-sample scores of the candidate alone (clustered bootstrap CI)
#   percentile         a percentile of the candidate's per-request values (bootstrap CI)
#   peak               the largest value seen during the candidate's config-run (no CI: one reading)
Aspect = Literal["quality", "speed"]
ComparisonKind = Literal["paired_ratio", "paired_difference", "rate", "mean", "percentile", "peak"]

# verdicts from best to worst; a run's verdict is its worst gated comparison's. measurement_error:
# the figure cannot be right (evals/sanity.py), so it decides nothing but keeps the run from passing
VERDICTS = ("ok", "inconclusive", "warn", "measurement_error", "critical")
VERDICT_ORDER = {v: i for i, v in enumerate(VERDICTS)}
RUN_VERDICT = {"ok": "pass", "inconclusive": "inconclusive", "warn": "warn", "measurement_error": "incomplete",
               "critical": "fail"}
NO_DATA_VERDICTS = ("inconclusive", "measurement_error")  # an alert's state stays as it was
# the number each verdict exports as (canary_verdict): stable, a new verdict takes the next number
VERDICT_CODES = {"ok": 0, "inconclusive": 1, "warn": 2, "critical": 3, "measurement_error": 4}


@dataclass(frozen=True)
class Metric:
    name: str
    label: str  # short column heading (dashboard, summaries)
    unit: str  # "ratio", "fraction", "ms", "points"
    direction: Direction
    comparison: ComparisonKind
    producer: str  # the suite scorer that measures it (perplexity, generation, judge, faithfulness, agreement)
    definition: str  # one line, with its source
    gated: bool = True  # False: reported with its CI, no threshold, no say in the verdict
    warn: float | None = None  # seed thresholds (docs/design.md §Defaults from the field)
    critical: float | None = None
    min_n: int = 10  # fewer paired samples than this → inconclusive
    fmt: str = ".4f"  # display format of the estimate
    baseline_compared: bool = False  # also computed for the baseline against its own absolute thresholds
    alert: str = ""  # the Prometheus alert on its seed warn threshold (canary alert-rules); default from the name
    # the range a correct measurement falls in; an estimate outside it is a measurement_error (evals/sanity.py)
    valid: tuple[float | None, float | None] = (None, None)
    # what the canary.yaml must use for anything to produce it beyond its producer scorer: "speculative" (a
    # config decoding speculatively), "lossless" (a candidate lossless against the baseline, with a greedy suite),
    # "perplexity.terms" (a suite listing domain terms); a threshold on it is refused otherwise (app/config_file.py)
    requires: str = ""
    # what a breach says of the config: its answers got worse ("quality"), or it serves more slowly or
    # with more memory than the baseline ("speed"); the verdict summary groups configs by it (app/summary.py)
    aspect: Aspect = "quality"
    # the function that compares a config on it, as "module:function" (imported when first used, so app/ reads
    # the table without numpy or torch): CompareContext → Comparison | None (evals/compare_targets.py). The
    # aggregation calls each row's target; "" for a row nothing compares (yet)
    compare: str = ""

    def __post_init__(self) -> None:
        if self.gated and self.warn is None:
            raise ValueError(f"metric {self.name}: a gated metric needs a seed warn threshold")
        if self.warn is not None and self.critical is not None:
            bad = self.critical < self.warn if self.direction == "above" else self.critical > self.warn
            if bad:
                raise ValueError(f"metric {self.name}: critical {self.critical} is on the good side of warn "
                                 f"{self.warn}")

        if not self.alert:
            camel = "".join(part.capitalize() for part in self.name.split("_"))
            object.__setattr__(self, "alert", f"Canary{camel}{'High' if self.direction == 'above' else 'Low'}")

    def compare_target(self) -> Callable[[Any], Any]:
        """The row's compare function, imported (a wrong target is an error naming the row)."""
        module, _, function = self.compare.partition(":")
        try:
            return getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError) as err:
            raise LookupError(f"metric {self.name}: compare target '{self.compare}' cannot be imported: {err}") from err

    @property
    def higher_is_better(self) -> bool:
        return self.direction == "below"

    def as_dict(self) -> dict:
        return {**asdict(self), "higher_is_better": self.higher_is_better}


METRICS: dict[str, Metric] = {}
_ROWS = "evals.compare_targets:"  # where the table's own compare targets live


def register_metric(metric: Metric) -> Metric:
    if metric.name in METRICS:
        raise ValueError(f"metric {metric.name} is registered twice")
    METRICS[metric.name] = metric
    return metric


register_metric(Metric(
    "ppl_ratio", "ppl ratio", "ratio", "above", "paired_ratio", "perplexity",
    "exp(ΣNLL_c/Σtokens) ÷ exp(ΣNLL_b/Σtokens) over the same documents; CI by paired bootstrap over documents "
    "(docs/reference.md §4; lm-eval's token perplexity)",
    warn=1.15, critical=1.30, alert="CanaryPerplexityRatioHigh",
    # compressing a model does not make it 10 % better at its own baseline's text: below that, a side is broken
    valid=(0.9, None),
    compare=_ROWS + "ppl_ratio"))
register_metric(Metric(
    "decode_nll_ratio", "decode ppl", "ratio", "above", "paired_ratio", "perplexity",
    "ppl_ratio over the suite's first perplexity.decode_samples documents, a lossy-KV config scoring each token "
    "one per decode step through its compressed cache; the prefill-vs-decode gap in its details "
    "(docs/concepts.md)",
    gated=False, valid=(0.9, None),
    compare=_ROWS + "decode_nll_ratio"))
register_metric(Metric(
    "kld_mean", "KLD", "nats", "above", "mean", "perplexity",
    "mean KL(baseline ‖ candidate) of the next-token distributions over every token of the suite's first "
    "perplexity.distribution_samples documents, with KLD and Δp percentiles, same top p and bounds from the "
    "baseline's top 20 in its details (llama-perplexity --kl-divergence; docs/concepts.md)",
    gated=False, fmt=".5f", min_n=4, valid=(-1e-9, None),
    compare=_ROWS + "kld_mean"))
register_metric(Metric(
    "spec_acceptance_rate", "accept", "fraction", "below", "rate", "generation",
    "Σ accepted draft tokens ÷ Σ draft tokens over the prompts (vLLM spec_decode_num_accepted_tokens / "
    "num_draft_tokens); CI by bootstrap over prompts",
    warn=0.50, critical=0.30, fmt=".2f", baseline_compared=True, alert="CanarySpecAcceptanceLow", valid=(0, 1),
    requires="speculative", aspect="speed",
    compare=_ROWS + "spec_acceptance_rate"))
register_metric(Metric(
    "ttft_ms", "TTFT p50 ms", "ms", "above", "percentile", "generation",
    "median time to first token of the candidate's prompts (lower median for even n), against an absolute service "
    "budget (the baseline is not judged on it; ttft_ratio compares the two); "
    "CI by bootstrap over prompts (vLLM time_to_first_token_seconds)",
    warn=2000, critical=5000, fmt=".1f", alert="CanaryTTFTHigh", valid=(0, None), aspect="speed",
    compare=_ROWS + "ttft_ms"))
register_metric(Metric(
    "ttft_ratio", "TTFT ratio", "ratio", "above", "paired_ratio", "generation",
    "geometric mean over prompts of the candidate's time to first token ÷ the baseline's, both timed on the same "
    "prompt back to back in alternating order within the candidate's run, so host load cancels out; "
    "paired bootstrap CI",
    warn=1.25, critical=1.5, valid=(0, None), alert="CanaryTTFTRatioHigh", aspect="speed",
    compare=_ROWS + "ttft_ratio"))
register_metric(Metric(
    "tpot_ratio", "TPOT ratio", "ratio", "above", "paired_ratio", "generation",
    "geometric mean over prompts of the candidate's time per output token (mean time between tokens after the "
    "first) ÷ the baseline's, timed as for ttft_ratio; paired bootstrap CI",
    warn=1.25, critical=1.5, valid=(0, None), alert="CanaryTPOTRatioHigh", aspect="speed",
    compare=_ROWS + "tpot_ratio"))
register_metric(Metric(
    "kv_cache_usage", "KV use", "fraction", "above", "peak", "generation",
    "peak fraction of the allocated KV cache in use during the config-run: the reference engine's tokens held for "
    "its requests (not the perplexity windows) ÷ slots allocated, or the highest vllm:kv_cache_usage_perc an "
    "OpenAI-compatible server reported",
    warn=0.85, critical=0.95, min_n=1, fmt=".2f", baseline_compared=True, valid=(0, 1), aspect="speed",
    compare=_ROWS + "kv_cache_usage"))
register_metric(Metric(
    "faithfulness", "faithful", "fraction", "below", "mean", "faithfulness",
    "share of an answer's statements supported by its contexts, averaged over RAG items (RAGAS faithfulness); "
    "clustered bootstrap CI",
    warn=0.80, fmt=".2f", baseline_compared=True, valid=(0, 1),
    compare=_ROWS + "faithfulness"))
register_metric(Metric(
    "judge_win_rate", "judge win", "fraction", "below", "mean", "judge",
    "candidate wins + ½ ties against the baseline, a win counted only when both answer orders agree "
    "(MT-Bench pairwise with position swap); 0.5 = parity",
    warn=0.40, critical=0.30, fmt=".2f", valid=(0, 1),
    compare=_ROWS + "judge_win_rate"))
register_metric(Metric(
    "judge_score_delta", "judge Δ", "points", "below", "paired_difference", "judge",
    "rubric score (1–5) of the candidate minus the baseline's on the same prompts (MT-Bench single-answer grading); "
    "paired bootstrap CI",
    warn=-0.5, critical=-1.0, fmt="+.2f", valid=(-4, 4),
    compare=_ROWS + "judge_score_delta"))
register_metric(Metric(
    "gen_nll_ratio", "gen NLL ratio", "ratio", "above", "paired_ratio", "generation",
    "perplexity of the candidate's outputs ÷ that of the baseline's own outputs, both scored teacher-forced by the "
    "baseline model after the same prompts: exp(ΣNLL_c/Σtokens_c − ΣNLL_b/Σtokens_b); paired bootstrap over prompts. "
    "Garbled or off-distribution text fails it while prompt log-probs stay exact",
    warn=1.15, critical=1.30, valid=(0.5, None), alert="CanaryGenerationNLLRatioHigh",
    compare=_ROWS + "gen_nll_ratio"))
register_metric(Metric(
    "term_nll_ratio", "term NLL ratio", "ratio", "above", "paired_ratio", "perplexity",
    "the perplexity ratio over only the tokens that overlap the suite's domain terms (perplexity.terms): "
    "exp((ΣNLL_c − ΣNLL_b) / Σterm tokens) over the same documents; a loss on rare domain tokens that "
    "whole-document perplexity averages away (a model that stops citing 'IFRS 9.3.1.1' and says 'IFRS 9'); "
    "paired bootstrap over documents",
    warn=1.15, critical=1.30, valid=(0.9, None), alert="CanaryDomainTermNLLRatioHigh", requires="perplexity.terms",
    compare=_ROWS + "term_nll_ratio"))
register_metric(Metric(
    "lossless_exact_match", "lossless EM", "fraction", "below", "rate", "generation",
    "for a config that keeps the baseline's weights and KV cache (engines.spec.lossless_against), the share of "
    "greedy outputs equal to the baseline's token for token up to near-ties (a divergence where the baseline "
    "model's log-prob gap is within near_tie_nats is counted and shown, never gated); any confident divergence is "
    "at least warn, critical when the Wilson interval's top is at or below critical",
    warn=1.0, critical=0.9, fmt=".2f", valid=(0, 1), alert="CanaryLosslessDiverged", requires="lossless",
    compare=_ROWS + "lossless_exact_match"))
register_metric(Metric(
    "confident_divergence", "confident div.", "fraction", "above", "paired_difference", "generation",
    "for a lossless config: the share of prompts whose greedy output departs from the baseline's at a token the "
    "baseline model was sure of (its log-prob gap between the two tokens, teacher-forced after the shared prefix, "
    "above the suite's near_tie_nats τ, default vLLM's greedy_atol 0.25), or that parts at a near-tie and later "
    "leaves the baseline model's greedy path by more than τ (each token read back against the model's top token), "
    "minus the same share for the baseline's own "
    "second pass (the noise floor); near-tie departures are reported, not judged; paired bootstrap over prompts",
    warn=0.01, critical=0.10, fmt="+.3f", valid=(-1, 1), alert="CanaryConfidentDivergence", requires="lossless",
    compare=_ROWS + "confident_divergence"))
register_metric(Metric(
    "batch_divergence", "batch div.", "fraction", "above", "paired_difference", "generation",
    "the share of probe prompts whose output sent alone departs at a confident token from the same config's output "
    "inside a full batch, minus the baseline's own share (its solo-vs-batched floor): a batching bug; paired "
    "bootstrap over the probe prompts",
    warn=0.01, critical=0.25, min_n=8, fmt="+.3f", valid=(-1, 1), alert="CanaryBatchDivergence",
    compare=_ROWS + "batch_divergence"))
register_metric(Metric(
    "empty_answers", "empty", "fraction", "above", "paired_difference", "generation",
    "share of the candidate's answers with no visible text minus the baseline's on the same prompts; paired "
    "bootstrap over prompts",
    warn=0.02, critical=0.10, fmt="+.3f", valid=(-1, 1), alert="CanaryEmptyAnswers",
    compare=_ROWS + "empty_answers"))
register_metric(Metric(
    "degenerate_answers", "degenerate", "fraction", "above", "paired_difference", "generation",
    "share of the candidate's answers that loop (a tail unit of ≤ 32 characters repeated over at least half the "
    "answer, or anywhere a phrase of ≤ 8 words repeated back to back ≥ 3 times over ≥ 6 words) or collapse "
    "(≥ 10 words, at most a fifth distinct), minus the baseline's on the same prompts "
    "(evals/health.py); paired bootstrap over prompts",
    warn=0.03, critical=0.10, fmt="+.3f", valid=(-1, 1), alert="CanaryDegenerateAnswers",
    compare=_ROWS + "degenerate_answers"))
register_metric(Metric(
    "max_tokens_hits", "hit max_tokens", "fraction", "above", "paired_difference", "generation",
    "share of the candidate's answers that ended at max_tokens (finish_reason length) minus the baseline's on the "
    "same prompts; paired bootstrap over prompts",
    warn=0.05, critical=0.15, fmt="+.3f", valid=(-1, 1), alert="CanaryMaxTokensHits",
    compare=_ROWS + "max_tokens_hits"))
register_metric(Metric(
    "early_stops", "stopped early", "fraction", "above", "paired_difference", "generation",
    "share of the candidate's answers that end of their own accord (finish_reason stop, not empty) with under half "
    "the tokens of the baseline's answer to the same prompt (≥ 8 tokens), minus the baseline's second pass's share "
    "against its first (evals/field.py); paired bootstrap over prompts",
    warn=0.02, critical=0.10, fmt="+.3f", valid=(-1, 1), alert="CanaryEarlyStops",
    compare=_ROWS + "early_stops"))
register_metric(Metric(
    "output_length_ratio", "length ratio", "ratio", "below", "paired_ratio", "generation",
    "Σ output tokens of the candidate ÷ Σ output tokens of the baseline over the same prompts: answers cut short; "
    "paired bootstrap over prompts",
    warn=0.90, critical=0.75, valid=(0, None), alert="CanaryOutputLengthLow",
    compare=_ROWS + "output_length_ratio"))
register_metric(Metric(
    "task_recovery", "recovery", "ratio", "below", "paired_ratio", "labelled",
    "the candidate's right answers ÷ the baseline's on the suite's labelled items (llm-compressor's accuracy "
    "recovery, gated at 0.95 there); accuracies with Wilson CIs, flips and McNemar's exact p in its details; "
    "paired bootstrap over items (evals/flips.py)",
    warn=0.95, critical=0.90, min_n=20, fmt=".3f", valid=(0, None), alert="CanaryTaskRecoveryLow",
    compare=_ROWS + "task_recovery"))
register_metric(Metric(
    "task_flips", "flips", "fraction", "above", "rate", "labelled",
    "share of labelled items answered right by one side and wrong by the other, either way: flips at equal "
    "accuracy (Dutta et al. 2024) that recovery cannot see; Wilson interval; each way and McNemar's p in its details",
    warn=0.05, critical=0.15, min_n=20, fmt=".3f", valid=(0, 1), alert="CanaryTaskFlips",
    compare=_ROWS + "task_flips"))
register_metric(Metric(
    "exact_match", "exact match", "fraction", "below", "rate", "agreement",
    "share of prompts whose greedy output equals the baseline's token for token; Wilson interval",
    gated=False, fmt=".2f", valid=(0, 1),
    compare=_ROWS + "exact_match"))
register_metric(Metric(
    "top1_agreement", "top-1 agree", "fraction", "below", "mean", "agreement",
    "share of document positions where the candidate's argmax token equals the baseline's; clustered bootstrap CI",
    gated=False, fmt=".3f", valid=(0, 1),
    compare=_ROWS + "top1_agreement"))
register_metric(Metric(
    "layer_drift", "layer drift", "fraction", "above", "mean", "layers",
    "relative error of the candidate's hidden state after the last layer against the baseline's on the same window "
    "(in-process engines); where the drift starts (the first layer and site past 1e-3: keys, values, attention, "
    "hidden) and its growth per layer in its details; bootstrap CI over documents (evals/layer_drift.py)",
    gated=False, fmt=".4f", valid=(0, None),
    compare="evals.layer_drift:layer_drift_comparison"))


# What a comparison's n counts when it is not the run's documents: the suite setting that sets it
# (vocabulary/suite.py). Asking for more documents (`--samples`) leaves these counts as they are; a top-up
# scales the prompts with the documents it adds (workers/job.py), and nothing else.
COUNTED_BY = {"generation": "generation.prompts", "agreement": "generation.prompts",
              "judge": "generation.prompts", "faithfulness": "generation.prompts",
              "labelled": "labelled.max_items"}
COUNTED_BY_METRIC = {"decode_nll_ratio": "perplexity.decode_samples",
                     "kld_mean": "perplexity.distribution_samples", "batch_divergence": "generation.solo_probes"}


def counted_by(metric: str) -> str | None:
    """The suite setting that counts a metric's samples; None for the run's documents."""
    return COUNTED_BY_METRIC.get(metric) or COUNTED_BY.get(METRICS[metric].producer)


def grows_with_samples(metric: str) -> bool:
    """Whether more documents drawn give a metric more paired samples: the run's documents, the
    prompts (a top-up scales them with the documents), or the prompts also sent alone (a top-up
    adds as many per prompt as the first pass had: workers/producers/generation.py)."""
    return counted_by(metric) in (None, "generation.prompts", "generation.solo_probes")


def rule_samples(rule: str | None, min_n_first: bool = False) -> int | None:
    """The paired samples an inconclusive rule of evals.stats.decide says would decide it: about so
    many at the current effect, or the CI's verdict at min_n. min_n_first: a rule below min_n gives
    its min_n (the firm need: an effect read off fewer samples is too unsure to project). None
    where it says none of these."""
    below = re.search(r"< min_n=(\d+)", rule or "")
    if min_n_first and below:
        return int(below.group(1))
    found = re.search(r"about (\d+) at this effect|\((\d+) samples decide it\)", rule or "")
    return int(found.group(1) or found.group(2)) if found else None


def gated_metrics() -> dict[str, Metric]:
    """The metrics that take thresholds (canary.yaml `thresholds`, alert rules) and decide verdicts."""
    return {name: m for name, m in METRICS.items() if m.gated}


def get_metric(name: str) -> Metric:
    """The row for `name`; an unknown name is a KeyError that lists the known ones (with a guess)."""
    if name in METRICS:
        return METRICS[name]
    from difflib import get_close_matches

    guess = get_close_matches(name, METRICS, n=1)
    hint = f"did you mean '{guess[0]}'? " if guess else ""
    raise KeyError(f"unknown metric '{name}'; {hint}known metrics: {', '.join(METRICS)}")


def _signed(x: float, digits: int) -> str:
    text = f"{x:+.{digits}f}"
    return "+" + text[1:] if text.startswith("-") and float(text) == 0 else text  # no "-0.00"


def format_estimate(metric: Metric, estimate: float | None, low: float | None = None, high: float | None = None,
                    digits: int = 2) -> str:
    """A comparison in its reader's unit with its 95% CI in the same unit: a ratio as its % change
    (1.045 [1.024, 1.066] → "+4.50% [+2.40, +6.60]"), a fraction as a percentage, milliseconds
    and points as themselves. The gate's summary writes it (the dashboard has its own copy)."""
    if estimate is None:
        return "—"
    if metric.unit == "ratio":
        show = lambda x: _signed((x - 1) * 100, digits)  # noqa: E731
        text = f"{show(estimate)}%"
    elif metric.unit == "fraction":
        show = lambda x: f"{x * 100:.1f}"  # noqa: E731
        text = f"{show(estimate)}%"
    elif metric.unit == "ms":
        show = lambda x: f"{x:.0f}"  # noqa: E731
        text = f"{show(estimate)} ms"
    else:
        show = lambda x: format(x, metric.fmt)  # noqa: E731
        text = show(estimate)
    return text if low is None or high is None else f"{text} [{show(low)}, {show(high)}]"


class Judged(Protocol):
    """What informational() reads of a comparison: vocabulary.comparison.Comparison, the stored row
    (app/models.py) and the API's ComparisonOut all have both."""

    @property
    def metric(self) -> str: ...

    @property
    def gated(self) -> bool: ...


def informational(c: Judged) -> bool:
    """A comparison that has no say in the verdict: its metric is not gated (the table's row), or
    its producer reported it without judging it (`gated` false)."""
    return not METRICS[c.metric].gated or not c.gated


def worst_verdict(verdicts: Iterable[str]) -> str:
    return max(verdicts, key=VERDICT_ORDER.__getitem__, default="ok")
