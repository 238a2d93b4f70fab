"""Comparisons that hold on servers in the field: nondeterministic, batched, and breaking in ways
that keep prompt log-probs exact. Plain records in, a `Comparison` out, as in evals/compare.py.

    metric                comparison          function
    confident_divergence  paired_difference   confident_divergence_comparison
    batch_divergence      paired_difference   batch_divergence_comparison
    empty_answers         paired_difference   health_share
    degenerate_answers    paired_difference   health_share
    max_tokens_hits       paired_difference   health_share
    early_stops           paired_difference   early_stop_share
    output_length_ratio   paired_ratio        output_length_comparison

The noise floor: a GPU server is not batch-invariant, so the same greedy request can come back
different (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025). The baseline's
second pass (RepeatRecord) against its first measures how much; a candidate is judged on the
confident departures beyond that floor, and a departure at a near-tie (evals/health.py) is noise
by vLLM's own rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from evals.health import NEAR_TIE_NATS, Scored, divergence, is_degenerate, is_empty
from evals.records import GenerationRecord
from evals.stats import Thresholds, decide, paired_bootstrap_ci, paired_mean_difference
from vocabulary.comparison import Comparison

EXAMPLE_CHARS = 120  # of an example answer shown in a verdict's reason
# an answer stops early when it ends of its own accord (finish_reason stop) with fewer than this
# share of the tokens the baseline gave the same prompt, the baseline's answer at least this long
EARLY_STOP_SHARE = 0.5
EARLY_STOP_MIN_TOKENS = 8
Records = Mapping[str, GenerationRecord]  # by prompt key


def _example(record: GenerationRecord) -> dict:
    """One answer that shows a finding, for the verdict's reason: its prompt key and text."""
    return {"sample_key": record.sample_key, "text": record.text[:EXAMPLE_CHARS]}


def _scored(record: GenerationRecord) -> Scored | None:
    return record.scored


def _departs(a: GenerationRecord, b: GenerationRecord, tau: float, greedy_path: bool = False
             ) -> tuple[bool, bool, dict | None]:
    """(departs at all, departs at a confident token, the divergence) of two outputs of one prompt.

    Confident: the outputs part at a token whose gap is beyond τ, or (with `greedy_path`, for a
    lossless config only: a lossy one leaves the baseline model's greedy path by design) they part
    at a near-tie and `b` later leaves the baseline model's greedy path by more than τ (Scored.leaves_after: once
    two outputs part, their tokens no longer pair, but each can still be checked against the
    model's own top token). A server that flips a near-tie early would otherwise hide a confident
    flip after it. Where the baseline model did not score both, any difference in text counts as
    confident (the near-tie rule needs its log-probs): the conservative reading."""
    sa, sb = _scored(a), _scored(b)
    if sa is None or sb is None:
        differs = a.text != b.text
        return differs, differs, None
    d = divergence(sa, sb, tau)
    if d is None:
        return a.text != b.text, a.text != b.text, None
    where = {"position": d.position, "gap": round(d.gap, 4), "near_tie": d.near_tie}
    later = sb.leaves_after(d.position + 1, tau) if d.near_tie and greedy_path else None
    if later is not None:
        where |= {"leaves_greedy_at": later[0], "leaves_greedy_gap": later[1]}
    return True, not d.near_tie or later is not None, where


def _paired_shares(metric: str, floor: list[float], mine: list[float], t: Thresholds, seed: int,
                   details: dict) -> Comparison:
    est, lo, hi = paired_mean_difference(floor, mine, seed=seed)
    verdict, rule = decide(est, lo, hi, len(mine), t)
    return Comparison(metric, est, lo, hi, len(mine), verdict, rule, baseline_value=float(np.mean(floor)),
                      candidate_value=float(np.mean(mine)), details=details)


def confident_divergence_comparison(candidate: Records, baseline: Records, repeats: Records, t: Thresholds,
                                    seed: int = 0, tau: float = NEAR_TIE_NATS) -> Comparison | None:
    """A lossless config's confident departures from the baseline beyond the baseline's own
    (its second pass against its first), paired by prompt. Without a second pass the floor is 0
    (a deterministic baseline is assumed and said). None when no prompt has both sides."""
    keys = [k for k in candidate if k in baseline]
    if not keys:
        return None
    floor_known = all(k in repeats for k in keys)
    mine, floor, near = [], [], {"candidate": 0, "baseline_repeat": 0}
    after_tie = {"candidate": 0, "baseline_repeat": 0}  # confident only on the greedy path, after a near-tie
    examples: list[dict] = []
    for k in keys:
        departs, sure, where = _departs(baseline[k], candidate[k], tau, greedy_path=True)
        mine.append(float(sure))
        near["candidate"] += int(departs and not sure)
        after_tie["candidate"] += int(sure and "leaves_greedy_at" in (where or {}))
        if sure and len(examples) < 1:
            examples.append({**_example(candidate[k]), "baseline_text": baseline[k].text[:EXAMPLE_CHARS],
                             **(where or {})})
        if floor_known:
            f_departs, f_sure, f_where = _departs(baseline[k], repeats[k], tau, greedy_path=True)
            floor.append(float(f_sure))
            after_tie["baseline_repeat"] += int(f_sure and "leaves_greedy_at" in (f_where or {}))
            near["baseline_repeat"] += int(f_departs and not f_sure)
        else:
            floor.append(0.0)
    floor_exact = (sum(baseline[k].text == repeats[k].text for k in keys) / len(keys)) if floor_known else None
    details = {"near_tie_nats": tau, "confident": {"candidate": int(sum(mine)), "baseline_repeat": int(sum(floor))},
               "near_tie": near, "confident_after_near_tie": after_tie,
               # answers whose own tokens were checked against the baseline model's top token
               "greedy_path_checked": sum(bool((s := _scored(candidate[k])) and s.greedy_known) for k in keys),
               "baseline_self_agreement": floor_exact,
               **(_floor_spread(baseline, repeats, keys, tau) if floor_known else {}),
               "noise_floor": "the baseline's second pass" if floor_known else
               "none measured: the baseline is taken as deterministic",
               **({"example": examples[0]} if examples else {})}
    return _paired_shares("confident_divergence", floor, mine, t, seed, details)


def _floor_spread(baseline: Records, repeats: Records, keys: list[str], tau: float) -> dict:
    """How the baseline's second pass differs from its first, beyond agreement: where its outputs
    part (the first differing token of each prompt that departs), the perplexity of its outputs
    over the first pass's under the baseline model (exp(ΣNLL_2/Σtokens_2 − ΣNLL_1/Σtokens_1)), and
    the geometric mean of its TTFT over the first pass's."""
    positions = {k: d["position"] for k in keys if (d := _departs(baseline[k], repeats[k], tau)[2]) is not None}
    scored = [k for k in keys if baseline[k].baseline_nll_tokens and repeats[k].baseline_nll_tokens]
    nll = None
    if scored:
        rate = [sum(g[k].baseline_nll or 0.0 for k in scored) / sum(g[k].baseline_nll_tokens or 0 for k in scored)
                for g in (repeats, baseline)]
        nll = round(math.exp(rate[0] - rate[1]), 4)
    timed = [(a, b) for k in keys if (a := repeats[k].ttft_ms) and (b := baseline[k].ttft_ms) and a > 0 and b > 0]
    ttft = round(math.exp(float(np.mean([math.log(a / b) for a, b in timed]))), 4) if timed else None
    return {"baseline_repeat_first_divergence": positions, "baseline_repeat_gen_nll_ratio": nll,
            "baseline_repeat_ttft_ratio": ttft}


def batch_divergence_comparison(candidate: Records, candidate_solo: Records, baseline: Records, baseline_solo: Records,
                                t: Thresholds, seed: int = 0, tau: float = NEAR_TIE_NATS) -> Comparison | None:
    """Each probe prompt's output sent alone against the same config's output inside a full batch,
    confident departures only, beyond the baseline's own solo-vs-batched departures on the same
    prompts. None when the config sent no prompt alone (it ran one request at a time)."""
    keys = [k for k in candidate_solo if k in candidate and k in baseline_solo and k in baseline]
    if not keys:
        return None
    mine, floor = [], []
    examples: list[dict] = []
    for k in keys:
        _, sure, where = _departs(candidate_solo[k], candidate[k], tau)
        mine.append(float(sure))
        floor.append(float(_departs(baseline_solo[k], baseline[k], tau)[1]))
        if sure and not examples:
            alone = candidate_solo[k].text[:EXAMPLE_CHARS]
            examples.append({**_example(candidate[k]), "alone": alone, **(where or {})})
    details = {"probes": len(keys), "near_tie_nats": tau,
               "confident": {"candidate": int(sum(mine)), "baseline": int(sum(floor))},
               **({"example": examples[0]} if examples else {})}
    return _paired_shares("batch_divergence", floor, mine, t, seed, details)


# what each health metric counts in one answer
HEALTH_CHECKS: dict[str, Callable[[GenerationRecord], bool]] = {
    "empty_answers": lambda g: is_empty(g.text),
    "degenerate_answers": lambda g: is_degenerate(g.text),
    "max_tokens_hits": lambda g: g.finish_reason == "length",
}


def health_share(metric: str, candidate: Records, baseline: Records, t: Thresholds, seed: int = 0) -> Comparison | None:
    """One health metric of HEALTH_CHECKS (empty, degenerate or max_tokens answers): the candidate's
    share minus the baseline's, paired by prompt, over the prompts both sides answered; None when
    there are none, or, for max_tokens_hits, when a side did not say why its answers ended."""
    keys = [k for k in candidate if k in baseline]
    if not keys:
        return None
    if metric == "max_tokens_hits" and not all(candidate[k].finish_reason and baseline[k].finish_reason for k in keys):
        return None
    found = HEALTH_CHECKS[metric]
    mine = [float(found(candidate[k])) for k in keys]
    theirs = [float(found(baseline[k])) for k in keys]
    example = next((_example(candidate[k]) for k in keys if found(candidate[k]) and not found(baseline[k])), None)
    details = {"candidate": int(sum(mine)), "baseline": int(sum(theirs)), **({"example": example} if example else {})}
    return _paired_shares(metric, theirs, mine, t, seed, details)


def stopped_early(answer: GenerationRecord, reference: GenerationRecord) -> bool:
    """`answer` ended of its own accord (finish_reason stop) well before `reference`, an answer to
    the same prompt, did: under EARLY_STOP_SHARE of its tokens, `reference` being at least
    EARLY_STOP_MIN_TOKENS long. An empty answer is empty_answers', not this."""
    return (answer.finish_reason == "stop" and not is_empty(answer.text)
            and reference.n_tokens >= EARLY_STOP_MIN_TOKENS and answer.n_tokens < EARLY_STOP_SHARE * reference.n_tokens)


def early_stop_share(candidate: Records, baseline: Records, repeats: Records, t: Thresholds,
                     seed: int = 0) -> Comparison | None:
    """Answers that stop early (an early-EOS bug: a format or kernel that makes the end token
    likely), paired by prompt: the share of the candidate's answers that stopped early against the
    baseline's answer, minus the share of the baseline's second pass (RepeatRecord) that did
    against its first (a server whose answers fork at near-ties can end one sooner by itself; no
    second pass: a floor of 0, said in the details). None when no prompt has both sides, or the
    candidate did not say why its answers ended."""
    keys = [k for k in candidate if k in baseline]
    if not keys or not all(candidate[k].finish_reason for k in keys):
        return None
    mine = [float(stopped_early(candidate[k], baseline[k])) for k in keys]
    floor_known = all(k in repeats and repeats[k].finish_reason for k in keys)
    floor = [float(stopped_early(repeats[k], baseline[k])) for k in keys] if floor_known else [0.0] * len(keys)
    example = next((_example(candidate[k]) | {"tokens": candidate[k].n_tokens, "baseline_tokens": baseline[k].n_tokens}
                    for k, m in zip(keys, mine, strict=True) if m), None)
    details = {"candidate": int(sum(mine)), "baseline_repeat": int(sum(floor)) if floor_known else None,
               "floor": "the baseline's second pass" if floor_known else "none measured: 0 assumed",
               "definition": f"finish_reason stop with < {EARLY_STOP_SHARE:g} of the baseline's tokens "
                             f"(baseline ≥ {EARLY_STOP_MIN_TOKENS} tokens), not empty",
               **({"example": example} if example else {})}
    return _paired_shares("early_stops", floor, mine, t, seed, details)


def output_length_comparison(candidate: Records, baseline: Records, t: Thresholds, seed: int = 0) -> Comparison | None:
    """The output length ratio over the prompts both sides answered (None when there are none)."""
    keys = [k for k in candidate if k in baseline]
    if not keys:
        return None
    return output_length_ratio([candidate[k].n_tokens for k in keys], [baseline[k].n_tokens for k in keys], t, seed)


def output_length_ratio(candidate_tokens: Sequence[int], baseline_tokens: Sequence[int], t: Thresholds,
                        seed: int = 0) -> Comparison:
    """Σ candidate output tokens ÷ Σ baseline output tokens over paired prompts; paired bootstrap CI."""
    c = np.asarray(candidate_tokens, dtype=np.float64)
    b = np.asarray(baseline_tokens, dtype=np.float64)
    if not b.sum():
        return Comparison("output_length_ratio", math.nan, math.nan, math.nan, len(b), "inconclusive",
                          "the baseline's answers are all empty: no length to compare with")
    est = float(c.sum() / b.sum())
    lo, hi = paired_bootstrap_ci(lambda w: (w @ c) / np.maximum(w @ b, 1e-12), len(b), seed=seed)
    verdict, rule = decide(est, lo, hi, len(b), t)
    return Comparison("output_length_ratio", est, lo, hi, len(b), verdict, rule, baseline_value=float(b.mean()),
                      candidate_value=float(c.mean()), details={"unit": "mean output tokens per answer"})
