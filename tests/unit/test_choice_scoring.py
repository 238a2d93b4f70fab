"""Multiple-choice items scored over one pass of their prompt (engines/reference/scoring.py `choices`,
the reference engine's loglikelihood_choices): each choice's score is, to float rounding, what the
rolling pass over prompt + choice gives it (vocabulary/labelled.py continuation_loglikelihood), the
definition the labelled scorer used before; on a real forward pass of the tiny model, for a
lossless cache, for weights and KV formats that store each slot on its own, and for a speculative
config (its target scores), and for KIVI where the tree fits its full-precision window (every slot
read raw, wherever it lies). KIVI past its window (a slot is read by its place), a KV-corruption
drill, and an item longer than one window are left to the rolling pass (None)."""

from __future__ import annotations

import pytest
from engines.protocol import ChoiceRequest, RollingRequest, ScoresChoices, WindowSpec
from engines.registry import load_engine
from engines.spec import OptimizationSpec
from engines.zoo import ARTIFACTS
from vocabulary.labelled import builtin_items, continuation_loglikelihood

WINDOW = WindowSpec(max_length=256, stride=256)


def requests() -> list[ChoiceRequest]:
    items = builtin_items("pydoc-next-word")[:6]
    return [ChoiceRequest(item.key, item.prompt, item.choices, WINDOW) for item in items] + [
        # choices of several tokens that share their first ones (the tree parts after them), one
        # that is a prefix of another, and a choice with no space before it
        ChoiceRequest("hand", "Return the value of the", (" dictionary", " dictionary keys", " dict", "ionary")),
    ]


def rolling(engine, reqs: list[ChoiceRequest]) -> list[tuple[float, ...]]:
    out = []
    for req in reqs:
        results = engine.loglikelihood_rolling([RollingRequest(f"{req.item_id}#{j}", req.prompt + choice, req.window)
                                                for j, choice in enumerate(req.choices)])
        out.append(tuple(continuation_loglikelihood(r, len(req.prompt)) for r in results))
    return out


@pytest.mark.parametrize("spec", [
    {}, {"weights": "rtn-int4"}, {"kv_cache": "fp8"}, {"kv_cache": "turbo-3.5"}, {"kv_cache": "int2"},
    {"speculative": {"method": "ngram", "k": 2}},
], ids=["fp16", "int4", "kv-fp8", "turbo-3.5", "kv-int2", "ngram"])
def test_each_choice_scores_what_the_rolling_pass_over_prompt_and_choice_gives_it(spec):
    engine = load_engine(str(ARTIFACTS / "pydoc-target"), OptimizationSpec(engine="reference", **spec))
    assert isinstance(engine, ScoresChoices)
    reqs = requests()
    shared = engine.loglikelihood_choices(reqs)
    assert all(row is not None for row in shared)
    for got, want, req in zip(shared, rolling(engine, reqs), reqs, strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-4), req.item_id
    # the hand-made item's choices are told apart as the rolling pass tells them apart
    hand = shared[-1]
    assert hand is not None and len(set(hand)) == 4


def test_kivi_past_its_window_a_kv_drill_and_an_item_longer_than_a_window_are_left_to_the_rolling_pass():
    kivi = load_engine(str(ARTIFACTS / "pydoc-target"), OptimizationSpec(engine="reference", kv_cache="kivi-2"))
    # a prompt of about 150 tokens: its tree is wider than KIVI's 128-slot window, so the first
    # keys would be read compressed, by their place; within one rolling window (256) all the same
    wide = ChoiceRequest("wide", "the value of the option " * 30, (" name", " value"), WINDOW)
    reqs = [wide, *requests()]
    shared = kivi.loglikelihood_choices(reqs)
    assert shared[0] is None and sum(row is not None for row in shared) >= 5
    for got, want, req in zip(shared, rolling(kivi, reqs), reqs, strict=True):
        assert got is None or got == pytest.approx(want, rel=1e-5, abs=1e-4), req.item_id
    fp8 = load_engine(str(ARTIFACTS / "pydoc-target"), OptimizationSpec(engine="reference", kv_cache="fp8"))
    assert fp8.loglikelihood_choices([wide])[0] is not None
    # a KV-corruption drill draws its noise per slot: the tree's slots are not the rolling pass's
    drill = load_engine(str(ARTIFACTS / "pydoc-target"), OptimizationSpec(
        engine="reference", kv_cache="fp8", engine_options={"fault": {"kind": "kv-corrupt", "layers": 2}}))
    assert drill.loglikelihood_choices(requests()) == [None] * len(requests())
    engine = load_engine(str(ARTIFACTS / "pydoc-target"), OptimizationSpec(engine="reference"))
    long = ChoiceRequest("long", "word " * 40, (" a", " b"), WindowSpec(max_length=16, stride=16))
    short = requests()[-1]
    assert [row is None for row in engine.loglikelihood_choices([long, short])] == [True, False]


def test_the_labelled_producer_maps_shared_and_rolling_scores_back_to_their_items():
    """answer_choices takes what the engine scores over one pass and the rest (here an item longer
    than the window) by the rolling pass, each item's record in its place."""
    from vocabulary.labelled import LabelledItem
    from workers.producers.labelled import answer_choices

    engine = load_engine(str(ARTIFACTS / "pydoc-target"), OptimizationSpec(engine="reference"))
    window = WindowSpec(max_length=24, stride=24)
    short = builtin_items("pydoc-next-word")[:3]
    short = [LabelledItem(i.key, i.prompt[-60:], i.answer, "choice", i.choices) for i in short]  # within 24 tokens
    long = LabelledItem("long", "the value of the option " * 12, " name", "choice", (" name", " value"))
    items = [short[0], long, short[1], short[2]]
    records = answer_choices(engine, items, window)
    want = rolling(engine, [ChoiceRequest(i.key, i.prompt, i.choices, window) for i in items])
    assert [r.sample_key for r in records] == [i.key for i in items]
    for record, scores in zip(records, want, strict=True):
        assert record.scores == pytest.approx(scores, rel=1e-5, abs=1e-4), record.sample_key
    assert engine.loglikelihood_choices([ChoiceRequest(long.key, long.prompt, long.choices, window)]) == [None]
