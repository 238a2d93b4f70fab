"""Generation health and the noise floor (evals/health.py, evals/field.py), each figure worked out
by hand from a tiny input."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
from evals.field import (
    HEALTH_CHECKS,
    batch_divergence_comparison,
    confident_divergence_comparison,
    health_share,
    output_length_comparison,
)
from evals.health import Scored, divergence, is_degenerate, is_empty, leaves_greedy, periodic_tail
from evals.records import GenerationRecord, RepeatRecord, RunRecords, SoloRecord
from evals.stats import Thresholds


def gen(key: str, text: str, ids=(), lps=(), finish="length", n=None, kind=GenerationRecord) -> GenerationRecord:
    scored = Scored(tuple(ids), tuple(lps)) if ids or lps else Scored((), ())
    return kind(key, 10.0, "p", text, len(text.split()) if n is None else n, 3, finish_reason=finish, scored=scored)


def seed_thresholds(metric: str) -> Thresholds:
    return Thresholds.seed(metric)


def test_empty_and_degenerate_answers():
    assert is_empty("") and is_empty(" \n ") and not is_empty(" x")
    # " not" repeated: the unit covers the last 12 of 14 characters
    assert periodic_tail("ab not not not") == (4, 12)
    assert periodic_tail("abcdefgh") == (0, 0)
    assert is_degenerate(" and 'b' is not not not not not not not not")
    assert is_degenerate("_INE_INE_INE_INE_IN_IN_IN_IN_IN_IN_")
    assert is_degenerate("the the a the a a the the a the")  # 10 words, 2 distinct: a collapse
    assert not is_degenerate("The default value is a string, and the file is not used.")
    assert not is_degenerate("ok ok ok")  # too short to call a loop
    assert not is_degenerate("")
    assert is_degenerate("\n" * 16) and is_empty("\n" * 16)  # a loop of newlines: both


def test_divergence_is_a_near_tie_or_confident_by_the_baseline_models_gap():
    a = Scored((1, 2, 3), (-0.1, -0.5, -0.2))
    assert divergence(a, a) is None
    tie = divergence(a, Scored((1, 2, 4), (-0.1, -0.5, -0.3)))
    assert (tie.position, round(tie.gap, 6), tie.near_tie) == (2, 0.1, True)
    sure = divergence(a, Scored((1, 5), (-0.1, -2.0)))
    assert (sure.position, round(sure.gap, 6), sure.near_tie) == (1, 1.5, False)
    # one output a prefix of the other: only the longer side's token is scored; p = e^-0.5 = 0.6065,
    # so the ending had at most 0.3935: gap ≥ −0.5 − ln 0.3935 = 0.43275 > τ, confident
    prefix = divergence(Scored((1, 2), (-0.1, -0.5)), Scored((1,), (-0.1,)))
    assert (prefix.position, prefix.gap, prefix.near_tie) == (1, pytest.approx(0.43275, abs=1e-5), False)
    # log p −1: p = 0.3679, the ending could have had 0.6321: bound −1 − ln 0.6321 < 0, a near-tie
    assert divergence(Scored((1, 2), (-0.1, -1.0)), Scored((1,), (-0.1,))).near_tie
    # an empty answer against a token the model was sure of (p = 0.990: the ending had ≤ 0.010) is confident;
    # against an unlikely one (p = 0.05) it may have been the ending's near-tie
    assert divergence(Scored((), ()), Scored((7,), (-0.01,))).near_tie is False
    assert divergence(Scored((), ()), Scored((7,), (-3.0,))).near_tie is True


def _pass(texts_ids_lps, kind=GenerationRecord) -> dict[str, GenerationRecord]:
    return {f"k{i}": gen(f"k{i}", t, ids, lps, kind=kind) for i, (t, ids, lps) in enumerate(texts_ids_lps)}


def test_confident_divergence_is_judged_beyond_the_baseline_against_itself():
    base = [(f"b{i}", (i, 1), (-0.1, -0.1)) for i in range(10)]
    cand = list(base)
    for i in range(3):  # three confident departures (gap 2.9)
        cand[i] = (f"c{i}", (i, 99), (-0.1, -3.0))
    cand[3] = ("c3", (3, 98), (-0.1, -0.2))  # one near-tie (gap 0.1)
    rep = list(base)
    rep[4] = ("r4", (4, 97), (-0.1, -2.0))  # the baseline departs from itself once, confidently
    rep[5] = ("r5", (5, 96), (-0.1, -0.15))  # and once at a near-tie
    c = confident_divergence_comparison(_pass(cand), _pass(base), _pass(rep, RepeatRecord),
                                        seed_thresholds("confident_divergence"))
    # candidate 3/10 confident, floor 1/10: 0.3 − 0.1
    assert c.estimate == pytest.approx(0.2) and c.n == 10
    assert (c.candidate_value, c.baseline_value) == (pytest.approx(0.3), pytest.approx(0.1))
    assert c.details["confident"] == {"candidate": 3, "baseline_repeat": 1}
    assert c.details["near_tie"] == {"candidate": 1, "baseline_repeat": 1}
    assert c.details["baseline_self_agreement"] == pytest.approx(0.8)
    assert c.details["example"]["sample_key"] == "k0" and c.details["example"]["gap"] == pytest.approx(2.9)
    # the floor's own spread: where the second pass parted from the first (k4 and k5 at token 1); equal
    # TTFTs (10 ms each side): ratio 1; no output scored for its NLL here
    assert c.details["baseline_repeat_first_divergence"] == {"k4": 1, "k5": 1}
    assert c.details["baseline_repeat_ttft_ratio"] == 1.0 and c.details["baseline_repeat_gen_nll_ratio"] is None


def test_near_tie_noise_on_both_sides_is_ok_and_a_confident_bug_is_critical():
    base = [(f"b{i}", (i, 1), (-0.1, -0.1)) for i in range(20)]
    noisy = [(f"n{i}", (i, 50), (-0.1, -0.2)) if i % 2 else x for i, x in enumerate(base)]  # half flip at near-ties
    floor = [(f"r{i}", (i, 60), (-0.1, -0.3)) if i % 3 == 0 else x for i, x in enumerate(base)]
    ok = confident_divergence_comparison(_pass(noisy), _pass(base), _pass(floor, RepeatRecord),
                                         seed_thresholds("confident_divergence"))
    assert ok.estimate == 0 and (ok.ci_low, ok.ci_high) == (0, 0) and ok.verdict == "ok"
    bug = [(f"x{i}", (i, 70), (-0.1, -4.0)) if i % 2 else x for i, x in enumerate(base)]  # half flip where sure
    bad = confident_divergence_comparison(_pass(bug), _pass(base), _pass(floor, RepeatRecord),
                                          seed_thresholds("confident_divergence"))
    assert bad.estimate == pytest.approx(0.5) and bad.verdict == "critical"


def test_leaves_greedy_counts_tokens_off_the_models_top_up_to_the_first_one_read_back_otherwise():
    # " b" sits 1.8 nats below the top " x": a departure; "a" and " c" are the top tokens
    assert leaves_greedy(["a", " b", " c"], [-0.1, -2.0, -0.3], ["a", " x", " c"], [-0.1, -0.2, -0.3]) == ((1, 1.8),)
    # a near-tie taken (0.1 below "x") and a later confident one (2.8 below "y"): both, in order
    assert leaves_greedy(["a", "b", "c"], [-0.5, -0.1, -3.0], ["x", "b", "y"], [-0.4, -0.1, -0.2]) == (
        (0, 0.1), (2, 2.8))
    # "ations" is below the top "ation" but its text begins with it: the answer was generated as
    # "ation" + "s"; from there on tokens are read after other tokens than generated, so "," below "."
    # is not a departure
    assert leaves_greedy(["ations", ","], [-1.5, -2.0], ["ation", "."], [-0.2, -0.1]) == ()
    # ... and the other way: "the" read where the top is "there", with "re" next: the same text
    assert leaves_greedy(["the", "re", "x"], [-1.0, -0.1, -5.0], ["there", "re", "y"], [-0.1, -0.1, -0.1]) == ()
    assert leaves_greedy([], [], [], []) == ()


def test_a_confident_flip_after_a_near_tie_is_confident():
    """A server that flips a near-tie early hides a confident flip after it from the first-divergence
    rule: the candidate's own path, checked against the baseline model's top token, shows it."""
    base = GenerationRecord("k", 10.0, "p", "a b c d", 4, 3, scored=Scored((1, 2, 3, 4), (-0.1,) * 4, (), True))
    # parts from the baseline at token 1 by a near-tie (gap 0.1), then leaves the greedy path at
    # token 3 by 3.0 nats
    flipped = Scored((1, 5, 6, 7), (-0.1, -0.2, -0.1, -3.1), ((1, 0.1), (3, 3.0)), True)
    cand = GenerationRecord("k", 10.0, "p", "a e f g", 4, 3, scored=flipped)
    c = confident_divergence_comparison({"k": cand}, {"k": base}, {"k": base}, seed_thresholds("confident_divergence"))
    assert c.details["confident"] == {"candidate": 1, "baseline_repeat": 0}
    assert c.details["example"]["leaves_greedy_at"] == 3 and c.details["example"]["leaves_greedy_gap"] == 3.0
    # the same path with only near-ties off the top: a near-tie departure, not confident
    noisy = GenerationRecord("k", 10.0, "p", "a e f g", 4, 3,
                             scored=Scored((1, 5, 6, 7), (-0.1, -0.2, -0.1, -0.3), ((1, 0.1), (3, 0.2)), True))
    c = confident_divergence_comparison({"k": noisy}, {"k": base}, {"k": base}, seed_thresholds("confident_divergence"))
    assert c.details["confident"] == {"candidate": 0, "baseline_repeat": 0}
    assert c.details["near_tie"] == {"candidate": 1, "baseline_repeat": 0}
    # a departure before the outputs part is the baseline's path as much as the candidate's: not counted
    early = Scored((1, 5, 6, 7), (-0.1, -0.2, -0.1, -0.3), ((0, 3.0), (1, 0.1)), True)
    c = confident_divergence_comparison({"k": replace(noisy, scored=early)}, {"k": base}, {"k": base},
                                        seed_thresholds("confident_divergence"))
    assert c.details["confident"]["candidate"] == 0


def test_without_a_second_pass_the_floor_is_zero_and_said():
    base = [(f"b{i}", (i, 1), (-0.1, -0.1)) for i in range(10)]
    c = confident_divergence_comparison(_pass(base), _pass(base), {}, seed_thresholds("confident_divergence"))
    assert c.estimate == 0 and c.verdict == "ok" and c.details["noise_floor"].startswith("none measured")


def test_lossless_exact_match_is_reported_not_judged_over_a_noisy_floor():
    from evals.compare import lossless_exact_comparison

    base = {f"k{i}": gen(f"k{i}", f"b{i}") for i in range(10)}
    cand = {**base, "k0": gen("k0", "other")}
    exact = lossless_exact_comparison(cand, base, seed_thresholds("lossless_exact_match"), repeats={
        k: gen(k, g.text, kind=RepeatRecord) for k, g in base.items()})
    assert exact.verdict == "warn"  # a deterministic floor: exactness is the claim
    noisy_repeats = {k: gen(k, g.text if k != "k5" else "x", kind=RepeatRecord) for k, g in base.items()}
    reported = lossless_exact_comparison(cand, base, seed_thresholds("lossless_exact_match"), repeats=noisy_repeats)
    assert reported.verdict == "ok" and reported.gated is False
    assert reported.details["baseline_self_agreement"] == pytest.approx(0.9)
    assert "differs on 1 of 10" in reported.rule


def test_batch_divergence_is_solo_against_batched_beyond_the_baselines_own():
    base = _pass([(f"b{i}", (i, 1), (-0.1, -0.1)) for i in range(8)])
    base_solo = _pass([(f"b{i}", (i, 1), (-0.1, -0.1)) for i in range(8)], SoloRecord)
    batched = _pass([(f"z{i}", (i, 80), (-0.1, -5.0)) for i in range(8)])  # every batched answer garbled
    alone = _pass([(f"b{i}", (i, 1), (-0.1, -0.1)) for i in range(8)], SoloRecord)
    c = batch_divergence_comparison(batched, alone, base, base_solo, seed_thresholds("batch_divergence"))
    assert (c.estimate, c.n, c.verdict) == (1.0, 8, "critical")
    assert c.details["confident"] == {"candidate": 8, "baseline": 0} and c.details["example"]["alone"] == "b0"
    same = batch_divergence_comparison(base, base_solo, base, base_solo, seed_thresholds("batch_divergence"))
    assert (same.estimate, same.verdict) == (0.0, "ok")
    assert batch_divergence_comparison(base, {}, base, base_solo, seed_thresholds("batch_divergence")) is None


def test_health_shares_are_paired_against_the_baseline():
    texts = ["a fine answer about files"] * 10
    base = {f"k{i}": gen(f"k{i}", t, n=5) for i, t in enumerate(texts)}
    base["k9"] = gen("k9", "not not not not not not not not", n=8)  # the baseline loops once itself
    cand = dict(base)
    cand["k0"] = gen("k0", "", finish="stop", n=0)
    cand["k1"] = gen("k1", " ", finish="stop", n=1)
    cand["k2"] = gen("k2", "the the the the the the the the the the", n=10)
    found = {m: health_share(m, cand, base, seed_thresholds(m)) for m in HEALTH_CHECKS}
    found["output_length_ratio"] = output_length_comparison(cand, base, seed_thresholds("output_length_ratio"))
    assert found["empty_answers"].estimate == pytest.approx(0.2)  # 2/10 − 0/10
    assert found["empty_answers"].details["example"]["sample_key"] == "k0"
    assert found["degenerate_answers"].estimate == pytest.approx(0.1)  # 2/10 − 1/10
    assert found["max_tokens_hits"].estimate == pytest.approx(-0.2)  # 8/10 − 10/10
    # Σ tokens: baseline 9·5 + 8 = 53; candidate 53 − 5 − 5 + 0 + 1 + (10 − 5) = 49
    assert found["output_length_ratio"].estimate == pytest.approx(49 / 53)
    assert not math.isnan(found["output_length_ratio"].ci_low)


def test_max_tokens_hits_needs_both_sides_finish_reasons():
    base = {f"k{i}": gen(f"k{i}", "x y", finish=None) for i in range(10)}
    assert health_share("max_tokens_hits", base, base, seed_thresholds("max_tokens_hits")) is None
    assert health_share("empty_answers", base, base, seed_thresholds("empty_answers")).estimate == 0
    assert health_share("empty_answers", base, {}, seed_thresholds("empty_answers")) is None  # no prompt in common


def test_gen_nll_ratio_says_what_it_left_out():
    from dataclasses import replace

    from evals.compare import gen_nll_ratio_comparison

    base = {f"k{i}": replace(gen(f"k{i}", "words here"), baseline_nll=2.0, baseline_nll_tokens=2) for i in range(10)}
    cand = {**base, "k0": gen("k0", "", finish="stop", n=0)}  # empty: no tokens to score
    c = gen_nll_ratio_comparison(cand, base, Thresholds.seed("gen_nll_ratio"))
    assert c.n == 9 and c.estimate == pytest.approx(1.0)
    assert c.details["empty_answers_left_out"] == {"candidate": 1, "baseline": 0}
    assert "1 empty candidate" in c.rule and "empty_answers" in c.rule


def test_records_round_trip_through_their_rows():
    g = gen("k0", "hi", (5, 6), (-0.123456789, -1.0), finish="stop")
    for kind in (GenerationRecord, RepeatRecord, SoloRecord):
        record = kind(**{f.name: getattr(g, f.name) for f in fields(g)})
        row = record.to_row()
        table = RunRecords.from_rows([(1, row["metric"], row["sample_key"], row["value"], row["extra"])])
        back = {GenerationRecord: table[1].generations, RepeatRecord: table[1].repeats,
                SoloRecord: table[1].solos}[kind]["k0"]
        assert type(back) is kind and back.finish_reason == "stop"
        assert back.scored == Scored((5, 6), (-0.12346, -1.0))
    # where the greedy path was checked: where the output left it, even nowhere
    for leaves in (((1, 2.5),), ()):
        checked = replace(g, scored=Scored((5, 6), (-0.5, -1.0), leaves, True))
        row = checked.to_row()
        back = RunRecords.from_rows([(1, row["metric"], row["sample_key"], row["value"], row["extra"])])[1]
        assert back.generations["k0"].scored == checked.scored


def test_lossless_exact_match_gates_confident_divergences_and_reports_near_ties_however_served():
    """A server shared with other requests flips answers at near-ties whether or not the canary
    batches its own: a flip at a near-tie (gap 0.1 ≤ τ 0.25) is counted and shown, never gated, on
    a deterministic baseline served one at a time or batched; a confident flip (gap 2.9) is
    judged either way, and the two together count only the confident one."""
    from dataclasses import replace

    from evals.compare import lossless_exact_comparison

    base = _pass([(f"b{i}", (i, 1), (-0.1, -0.1)) for i in range(10)])
    repeats = {k: gen(k, g.text, g.scored.ids, g.scored.logprobs, kind=RepeatRecord) for k, g in base.items()}
    flip = dict(base, k0=gen("k0", "c0", (0, 98), (-0.1, -0.2)))  # near-tie: |-0.1 - -0.2| = 0.1
    sure = dict(base, k0=gen("k0", "c0", (0, 99), (-0.1, -3.0)))  # confident: gap 2.9

    def batched(records, size):
        return {k: replace(g, batch=i // size) for i, (k, g) in enumerate(records.items())}

    t = seed_thresholds("lossless_exact_match")
    for size in (1, 8):
        tie = lossless_exact_comparison(batched(flip, size), batched(base, size), t, repeats)
        assert tie.estimate == 1.0 and tie.verdict == "ok" and tie.gated, (size, tie.rule)
        assert tie.details["matches"] == 9 and tie.details["near_tie"]["count"] == 1 and tie.details["confident"] == 0
        assert tie.details["near_tie"]["examples"][0]["sample_key"] == "k0"
        assert "9 of 10 outputs identical to the baseline's; 1 more diverge at a near-tie" in tie.rule
        judged = lossless_exact_comparison(batched(sure, size), batched(base, size), t, repeats)
        assert judged.estimate == pytest.approx(0.9) and judged.verdict == "warn" and judged.gated
        assert "1 of 10 outputs diverge confidently" in judged.rule
    # one confident and one near-tie flip: 9 of 10 held up to near-ties (Wilson [0.596, 0.982])
    both = dict(sure, k1=gen("k1", "c1", (1, 98), (-0.1, -0.2)))
    c = lossless_exact_comparison(both, base, t, repeats)
    assert c.estimate == pytest.approx(0.9) and c.details["confident"] == 1 and c.details["near_tie"]["count"] == 1
    assert c.ci_low == pytest.approx(0.5958, abs=1e-3) and c.verdict == "warn"
    # half the answers flipped confidently: Wilson high 0.763 ≤ critical 0.9
    half = {**base, **{f"k{i}": gen(f"k{i}", f"c{i}", (i, 99), (-0.1, -3.0)) for i in range(5)}}
    assert lossless_exact_comparison(half, base, t, repeats).verdict == "critical"


def test_a_repeated_phrase_of_up_to_eight_words_anywhere_is_a_loop():
    from evals.health import repeated_phrase

    # (phrase length, copies, first word), worked by hand
    assert repeated_phrase("a b c d c d c d e".split()) == (2, 3, 2)  # "c d" ×3 from word 2, then the answer goes on
    assert repeated_phrase("x y x y".split()) == (0, 0, -1)  # two copies are not a loop
    assert repeated_phrase("very very very good".split()) == (0, 0, -1)  # 3 words: under the 6-word span
    assert repeated_phrase("no no no no no no".split()) == (1, 6, 0)
    eight = "the value of the key is not found".split()  # 8 words, three times, mid-answer
    assert repeated_phrase(["Returns", *eight * 3, "then", "stops."]) == (8, 3, 1)
    assert repeated_phrase(["Returns", *eight * 3]) == (8, 3, 1)
    # the field scenario: six words of answer, then a three-word phrase to the end
    answer = "Return the list of all keys".split() + "in the mapping".split() * 6
    assert repeated_phrase(answer) == (3, 6, 6)
    assert is_degenerate(" ".join(answer))
    # a loop the model broke out of, shorter than half the answer: the tail check alone missed it
    broke_out = "Open the file and read it. " + "and then " * 4 + "close the file when the block ends, as with any context manager."
    assert periodic_tail(broke_out) == (0, 0) and is_degenerate(broke_out)
    # natural text with a repeated word or a two-copy phrase stays fine
    assert not is_degenerate("It is very very very important that the name is set before the call is made.")
    assert not is_degenerate("Return x if x is set, else return y if y is set, else None.")


def test_a_divergence_inside_a_token_read_back_longer_is_not_confident():
    """A server flips " C" + "D" to " C" + "I" at a near-tie and goes on greedily; the baseline model
    reads the flipped answer back as " CI" + "OD", where its top token is " C" (6.7 nats above
    " CI"). The texts part inside " CI", after the top token's text, where these tokens cannot
    tell: not confident. The same gap at a token read as generated is confident."""
    from evals.compare import lossless_exact_comparison
    from evals.health import greedy_reading

    # " CI" is below the top " C" and its text begins with it: read back otherwise, at position 1
    assert greedy_reading([" a", " CI", "OD"], [-0.1, -6.8, -0.2], [" a", " C", "OD"], [-0.1, -0.1, -0.2]) == ((), 1)
    assert greedy_reading([" a", " b"], [-0.1, -2.0], [" a", " x"], [-0.1, -0.2]) == (((1, 1.8),), None)
    base = Scored((5, 7, 8), (-0.1, -0.1, -0.6), (), True)
    merged = Scored((5, 9, 10), (-0.1, -6.8, -0.2), (), True, read_back_at=1)
    d = divergence(base, merged)
    assert (d.position, round(d.gap, 1), d.near_tie, d.read_back) == (1, 6.7, True, True)
    sure = Scored((5, 9, 10), (-0.1, -6.8, -0.2), ((1, 6.7),), True)  # the same gap, read as generated
    assert not divergence(base, sure).near_tie and not divergence(base, sure).read_back
    # a side read back otherwise before the divergence ("2" + "2" read as "22" at 0): the tokens after it
    # are read after other tokens than generated, so a gap there is not the model's choice either
    early = Scored((5, 7, 8), (-0.1, -0.1, -0.6), (), True, read_back_at=0)
    assert divergence(early, sure).read_back and divergence(early, sure).near_tie
    assert not divergence(Scored((5, 7, 8), (-0.1, -0.1, -0.6), (), True, read_back_at=2), sure).near_tie
    # the record keeps it through its row; a row stored before it was kept reads None
    g = GenerationRecord("k", 10.0, "p", " a CIOD", 3, 3, finish_reason="length", scored=merged)
    def back(record: GenerationRecord) -> Scored:
        row = record.to_row()
        return RunRecords.from_rows([(1, row["metric"], row["sample_key"], row["value"], row["extra"])])[1] \
            .generations["k"].scored

    assert back(g) == merged and back(replace(g, scored=sure)).read_back_at is None
    baseline = {f"k{i}": GenerationRecord(f"k{i}", 10.0, "p", " a CD", 3, 3, scored=base) for i in range(10)}
    t = seed_thresholds("lossless_exact_match")
    read_back = lossless_exact_comparison(dict(baseline, k0=g), baseline, t)
    assert read_back.verdict == "ok" and read_back.details["near_tie"]["count"] == 1, read_back.rule
    confident = lossless_exact_comparison(dict(baseline, k0=replace(g, scored=sure)), baseline, t)
    assert confident.verdict == "warn" and confident.details["confident"] == 1
