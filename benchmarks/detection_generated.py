"""The generated half of benchmarks/detection.py: faults and nulls that no test names, drawn at
random from a seed drawn fresh at each run (and printed, so that a run can be repeated), through
the same field-like servers as the field half (perturbing proxies, tests/http/perturb.py, in front
of one real `canary engine-serve`), at the suite's defaults: no max_samples, so an undecided run
tops itself up as a user's would.

Fault families, each at a rate drawn from 5–40 % of answers:
  confident-flip  the answer flips at its most confident token, early or late in the answer (a lossless config)
  truncation      the answer cut to a share of its tokens: early (10–30 % kept) or late (55–85 %), finish stop
  token-loop      from a position on (early or late), one token repeated up to max_tokens
  phrase-loop     a phrase of 2–8 of the answer's own tokens repeated back to back from a position (early or late)
                  on, at least three times
  empty           no text at all
  unrelated       the answer to an unrelated prompt in its place
  swap            another concurrent request's answer (only under concurrency by nature)
Sides: candidate only; only under concurrency (the fault shows only for a request that shared the
server with another); baseline only (the candidate plain); both (the same fault on both sides, each
drawing its own answers). The truth: a candidate or concurrency fault is a regression; a baseline
or both-sided one is not a regression of the candidate (a flag on it is a false alarm).
Nulls: near-tie nondeterminism (greedy answers flip at their nearest near-tie, each request drawn
anew, where that tie's top two are within a drawn 0.05–0.25 nats) in 10–90 % of answers, on the candidate only (a deterministic baseline), on both sides, or on
the candidate only under concurrency; and plain proxies.

The runs of one trial (one draw): a deterministic baseline with the candidate and concurrency faults,
the one-sided and concurrency-only nulls and the plain nulls; a nondeterministic baseline with the
both-sided nulls and candidate faults; and `faulty_baselines` runs whose baseline carries a fault,
each with a plain candidate and one carrying the same fault.

"At or above threshold", from what the proxy did in that run: the share of the prompts answered
whose answers it changed is at least 10 % (the field half's FIELD_SIZE_AT_THRESHOLD); for a
truncation, the share cut to under half their tokens is at least 10 %, or the whole length fell to
output_length_ratio's warn (0.90) or below.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("confident-flip", "truncation", "token-loop", "phrase-loop", "empty", "unrelated", "swap")
POSITIONED = ("confident-flip", "truncation", "token-loop", "phrase-loop")
RATES = (0.05, 0.40)  # a fault's share of answers
NULL_RATES = (0.10, 0.90)  # a null's share of answers that flip at a near-tie
# the largest top-1/top-2 log-prob gap a null may flip, nats: a draw up to vLLM's greedy_atol (0.25), the
# suite's default near_tie_nats; a "nondeterminism" that flips a token the model preferred by more is a
# confident divergence by the product's definition, not a null
NULL_GAPS = (0.05, 0.25)
AT_THRESHOLD = 0.10  # the share of answers changed from which a fault counts as at or above threshold


@dataclass(frozen=True)
class Case:
    """One config of a generated run: what its proxy does, and the truth about it."""

    name: str
    family: str  # a FAMILIES entry; "nondeterminism" or "plain" for a null
    side: str  # candidate, concurrency, baseline, both; the null's: candidate, concurrency, both, plain
    rate: float
    position: str | None = None  # early / late, for the POSITIONED families
    lossless: bool = False
    seed: int = 0
    params: dict[str, Any] = field(default_factory=dict, compare=False)
    # False: this config's proxy plays nothing (the plain candidate beside a faulty baseline)
    plays: bool = True

    @property
    def regression(self) -> bool:
        """The truth: a fault on the candidate's side (alone, or only under concurrency)."""
        return self.family in FAMILIES and self.side in ("candidate", "concurrency")

    def describe(self) -> dict[str, Any]:
        return {"config": self.name, "family": self.family, "side": self.side, "rate": self.rate,
                "position": self.position, "lossless": self.lossless, "seed": self.seed, **self.params}


@dataclass
class GeneratedRun:
    """One run: its baseline's behaviour (None: the upstream's own answers) and its candidates."""

    label: str
    baseline: Case | None
    cases: list[Case]


def fault_params(rng: random.Random, family: str, position: str | None, max_tokens: int) -> dict[str, Any]:
    """The drawn shape of one fault: where in the answer it starts, and how much it keeps or loops."""
    early = position == "early"
    if family == "confident-flip":
        return {"window": (0.0, 0.5) if early else (0.5, 1.0)}
    if family == "truncation":
        return {"keep": round(rng.uniform(0.10, 0.30) if early else rng.uniform(0.55, 0.85), 3)}
    if family == "token-loop":
        return {"after": rng.randint(0, max_tokens // 4) if early else rng.randint(max_tokens // 2, 3 * max_tokens // 4)}
    if family == "phrase-loop":
        n = rng.randint(2, min(8, max_tokens // 3))
        lo, hi = n, max(n, max_tokens - 2 * n)  # the head ends with the phrase; two more copies at least
        mid = (lo + hi) // 2
        return {"phrase_tokens": n, "after": rng.randint(lo, mid) if early else rng.randint(mid, hi)}
    return {}


def draw_fault(rng: random.Random, name: str, side: str, max_tokens: int, family: str | None = None) -> Case:
    family = family or rng.choice(FAMILIES)
    if family == "swap":  # answers swapped between concurrent requests: only under concurrency by nature
        side = "concurrency" if side == "candidate" else side
    position = rng.choice(("early", "late")) if family in POSITIONED else None
    return Case(name, family, side, round(rng.uniform(*RATES), 3), position,
                lossless=family == "confident-flip" or rng.random() < 0.5, seed=rng.randrange(1 << 30),
                params=fault_params(rng, family, position, max_tokens))


def draw_null(rng: random.Random, name: str, side: str) -> Case:
    """A null: near-tie nondeterminism in a drawn share of answers, flipping only tokens whose top two
    are within a drawn gap (NULL_GAPS: numerics that are not batch-invariant move near-ties, not
    tokens the model is sure of); or a plain proxy."""
    if side == "plain":
        return Case(name, "plain", "plain", 0.0, lossless=True)
    return Case(name, "nondeterminism", side, round(rng.uniform(*NULL_RATES), 3), lossless=True,
                seed=rng.randrange(1 << 30), params={"max_gap": round(rng.uniform(*NULL_GAPS), 3)})


def draw(seed: int, max_tokens: int, faults: int = 8, one_sided: int = 8, concurrency_nulls: int = 6,
         both_nulls: int = 6, plain: int = 2, nondet_faults: int = 3, faulty_baselines: int = 1) -> list[GeneratedRun]:
    """One trial's runs, every fault and null drawn from `seed`. The candidate-side faults cycle through
    the families (each at least once when `faults` ≥ 7) in a drawn order; the rest is drawn freely."""
    rng = random.Random(seed)
    order = list(FAMILIES)
    rng.shuffle(order)
    det: list[Case] = []
    for i in range(faults):
        det.append(draw_fault(rng, f"g{seed % 10000}-f{i}", rng.choice(("candidate", "concurrency")), max_tokens,
                              order[i % len(order)]))
    det += [draw_null(rng, f"g{seed % 10000}-n1-{i}", "candidate") for i in range(one_sided)]
    det += [draw_null(rng, f"g{seed % 10000}-nc-{i}", "concurrency") for i in range(concurrency_nulls)]
    det += [draw_null(rng, f"g{seed % 10000}-np-{i}", "plain") for i in range(plain)]
    runs = [GeneratedRun("deterministic baseline", None, det)]
    nondet_base = draw_null(rng, f"g{seed % 10000}-b-nondet", "both")
    nondet = [draw_null(rng, f"g{seed % 10000}-nb-{i}", "both") for i in range(both_nulls)]
    nondet += [draw_fault(rng, f"g{seed % 10000}-fn{i}", "candidate", max_tokens) for i in range(nondet_faults)]
    runs.append(GeneratedRun("nondeterministic baseline", nondet_base, nondet))
    for j in range(faulty_baselines):
        base = draw_fault(rng, f"g{seed % 10000}-b{j}", "baseline", max_tokens)
        if base.family == "swap":
            base = Case(base.name, base.family, "baseline", base.rate, lossless=base.lossless, seed=base.seed)
        plain_candidate = Case(f"g{seed % 10000}-fb{j}-plain", base.family, "baseline", base.rate, base.position,
                               base.lossless, 0, dict(base.params), plays=False)
        same = Case(f"g{seed % 10000}-fb{j}-both", base.family, "both", base.rate, base.position, base.lossless,
                    rng.randrange(1 << 30), dict(base.params))
        runs.append(GeneratedRun(f"faulty baseline ({base.family})", base, [plain_candidate, same]))
    return runs


def behaviour(case: Case) -> Any:
    """The proxy behaviour (tests/http/perturb.py) that plays `case` on its side of the comparison;
    None for a plain proxy (and for the plain candidate of a faulty-baseline run)."""
    from tests.http import perturb

    if case.family == "plain" or not case.plays:
        return None
    p = case.params
    made: Any
    if case.family == "nondeterminism":
        made = perturb.NearTieFlips(case.rate, case.seed, per_request=True, max_gap=p.get("max_gap"))
    elif case.family == "confident-flip":
        made = perturb.ConfidentFlips(case.rate, case.seed, window=tuple(p["window"]))
    elif case.family == "truncation":
        made = perturb.Truncation(case.rate, case.seed, keep=p["keep"])
    elif case.family == "token-loop":
        made = perturb.Loops(case.rate, case.seed, after=p["after"])
    elif case.family == "phrase-loop":
        made = perturb.PhraseLoops(case.rate, case.seed, n=p["phrase_tokens"], after=p["after"])
    elif case.family == "empty":
        made = perturb.EmptyAnswers(case.rate, case.seed)
    elif case.family == "unrelated":
        made = perturb.UnrelatedText(case.rate, case.seed)
    elif case.family == "swap":
        return perturb.CorruptWhenBatched(case.seed, case.rate)
    else:
        raise ValueError(f"unknown family {case.family!r}")
    return perturb.WhenBatched(made) if case.side == "concurrency" else made


def realized(made: Any) -> dict[str, float | None]:
    """What a behaviour did in the run just ended: the share of the prompts answered whose answers it
    changed, the length ratio of what it answered to the upstream's answers, and the share of prompts
    it cut to under half their tokens (of answers of at least 8 tokens: early_stops' definition)."""
    if made is None:
        return {"share": 0.0, "length_ratio": 1.0, "cut_under_half": 0.0}
    lengths = made.lengths
    affected = set(made.affected)
    cut = sum(1 for key, (g, a) in lengths.items() if key in affected and g >= 8 and 0 < a < g / 2)
    return {"share": made.share(), "length_ratio": made.length_ratio(),
            "cut_under_half": cut / len(lengths) if lengths else None}


def at_or_above(case: Case, done: dict[str, float | None], length_warn: float = 0.90) -> bool:
    """Whether a regression's realized size reached its threshold (the module's docstring)."""
    if not case.regression:
        return False
    if case.family == "truncation":
        ratio = done.get("length_ratio")
        return (done.get("cut_under_half") or 0.0) >= AT_THRESHOLD or (ratio is not None and ratio <= length_warn)
    return (done.get("share") or 0.0) >= AT_THRESHOLD


def summarize(cases: dict[str, Case], trials: dict[str, dict]) -> dict[str, Any]:
    """The half's figures, apart from the named halves': faults at or above threshold and how many were
    flagged, every miss and every false alarm with its parameters, and the false-alarm rate over the
    nulls (and apart, over the baseline-side faults)."""
    misses, alarms, side_alarms, rows = [], [], [], []
    above = flagged_above = null_trials = one_sided = 0
    for name, case in cases.items():
        t = trials.get(name)
        if t is None:
            continue
        row = case.describe() | {"flagged": t["flagged"], "by": t["by"], "n": t["n"], "status": t["status"],
                                 "inconclusive": t["inconclusive"], **{k: t.get(k) for k in ("share", "length_ratio",
                                                                                              "cut_under_half")}}
        if case.regression:
            hit = at_or_above(case, t)
            row["at_or_above_threshold"] = hit
            above += hit
            flagged_above += hit and t["flagged"]
            if hit and not t["flagged"]:
                misses.append(row)
        elif case.family in ("nondeterminism", "plain"):
            null_trials += 1
            one_sided += case.side in ("candidate", "concurrency")
            if t["flagged"] or t["status"] != "succeeded":
                alarms.append(row)
        elif t["flagged"] and any(not b.endswith("measurement_error") for b in t["by"]):
            side_alarms.append(row)  # a baseline-side fault: the candidate is not worse than its baseline
        rows.append(row)
    side_trials = sum(1 for c in cases.values() if c.family in FAMILIES and not c.regression and c.name in trials)
    return {
        "faults_at_or_above_threshold": above, "flagged_at_or_above_threshold": flagged_above,
        "missed_at_or_above_threshold": len(misses), "misses": misses,
        "faults_below_threshold": sum(1 for r in rows if r.get("at_or_above_threshold") is False),
        "faults_below_threshold_flagged": sum(1 for r in rows if r.get("at_or_above_threshold") is False and r["flagged"]),
        "null_trials": null_trials, "null_trials_one_sided_or_concurrency": one_sided,
        "false_alarms": len(alarms), "false_alarm_rate": round(len(alarms) / null_trials, 4) if null_trials else None,
        "false_alarm_list": alarms,
        "baseline_side_trials": side_trials, "baseline_side_false_alarms": side_alarms,
        "rows": rows,
    }
