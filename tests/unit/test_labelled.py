"""Labelled items (vocabulary/labelled.py) and their comparisons (evals/flips.py), worked by hand."""

import json
import math

import pytest
from evals.flips import flips_comparison, recovery_comparison
from evals.records import ItemRecord
from evals.stats import Thresholds, wilson_interval
from vocabulary.labelled import (
    ItemError,
    builtin_items,
    choice_correct,
    from_lm_eval_sample,
    generated_correct,
    parse_item,
    parse_items,
)


def test_an_item_parses_with_its_match_and_answer_checked():
    mc = parse_item({"id": 1, "prompt": "2 + 2 =", "choices": [" 3", " 4"], "answer": 1}, "t")
    assert (mc.key, mc.match, mc.answer, mc.answer_index) == ("1", "choice", " 4", 1)  # an index becomes its text
    assert parse_item({"id": "a", "question": "q", "choices": ["x", "y"], "answer": "y"}, "t").answer_index == 1
    assert parse_item({"id": "n", "prompt": "q", "answer": 42, "match": "number"}, "t").answer == "42"
    assert parse_item({"id": "e", "prompt": "q", "answer": "yes"}, "t").match == "exact"  # no choices: exact
    bad = [({"prompt": "q", "answer": "a"}, "give each item an 'id'"),
           ({"id": "x", "answer": "a"}, "has no string 'prompt'"),
           ({"id": "x", "prompt": "q", "choices": ["a"], "answer": 0}, "at least 2 'choices'"),
           ({"id": "x", "prompt": "q", "choices": ["a", "b"], "answer": 2}, "outside its 2 choices"),
           ({"id": "x", "prompt": "q", "choices": ["a", "b"], "answer": "c"}, "right choice's index or its text"),
           ({"id": "x", "prompt": "q", "choices": ["a", "a"], "answer": 0}, "its choices repeat"),
           ({"id": "x", "prompt": "q", "answer": "a", "match": "fuzzy"}, "unknown match 'fuzzy'"),
           ({"id": "x", "prompt": "q", "answer": "a", "match": "regex"}, "needs a 'pattern'"),
           ({"id": "x", "prompt": "q", "answer": "a", "match": "regex", "pattern": "("}, "not a regular expression"),
           ({"id": "x", "prompt": "q", "answer": "many", "match": "number"}, "numeric 'answer'"),
           ({"id": "x", "prompt": "q"}, "has no 'answer'")]
    for row, message in bad:
        with pytest.raises(ItemError, match=message):
            parse_item(row, "items.jsonl line 1")


def test_items_from_lines_name_the_line_and_refuse_duplicates():
    lines = ['{"id": "a", "prompt": "q", "answer": "x"}', "", '{"id": "b", "prompt": "q", "answer": "y"}']
    assert [i.key for i in parse_items(lines, "f.jsonl")] == ["a", "b"]
    with pytest.raises(ItemError, match=r"f\.jsonl line 2 is not JSON"):
        parse_items(['{"id": "a", "prompt": "q", "answer": "x"}', "{nope"], "f.jsonl")
    with pytest.raises(ItemError, match=r"f\.jsonl line 2: duplicate item id 'a'"):
        parse_items([lines[0], lines[0]], "f.jsonl")
    with pytest.raises(ItemError, match="has no items"):
        parse_items(["", " "], "f.jsonl")


def test_generated_answers_by_hand():
    exact = parse_item({"id": 1, "prompt": "q", "answer": " Paris "}, "t")
    assert generated_correct(exact, "Paris\n") == (True, "Paris")
    assert generated_correct(exact, "paris") == (False, "paris")  # case counts, as in lm-eval's default
    number = parse_item({"id": 2, "prompt": "q", "answer": "1234", "match": "number"}, "t")
    assert generated_correct(number, "3 apples, so 1,234 in all") == (True, "1234")  # the last number
    assert generated_correct(number, "1234 then 5") == (False, "5")
    assert generated_correct(number, "no idea") == (False, None)
    assert generated_correct(parse_item({"id": 3, "prompt": "q", "answer": "0.5", "match": "number"}, "t"), "= .50")[0]
    regex = parse_item({"id": 4, "prompt": "q", "answer": "B", "match": "regex", "pattern": r"answer is \(?([A-D])"},
                       "t")
    assert generated_correct(regex, "so the answer is (B).") == (True, "B")
    assert generated_correct(regex, "B") == (False, None)


def test_multiple_choice_takes_the_highest_loglikelihood_first_on_a_tie():
    item = parse_item({"id": 1, "prompt": "q", "choices": ["a", "b", "c"], "answer": 2}, "t")
    assert choice_correct(item, [-3.0, -2.5, -1.0]) == (True, 2)
    assert choice_correct(item, [-1.0, -1.0, -1.0]) == (False, 0)
    with pytest.raises(ValueError, match="2 scores for 3 choices"):
        choice_correct(item, [-1.0, -2.0])


def _records(flags: list[bool]) -> dict[str, ItemRecord]:
    return {f"i{k}": ItemRecord(f"i{k}", ok, None) for k, ok in enumerate(flags)}


def test_recovery_and_flips_at_equal_accuracy_by_hand():
    """200 items; 5 % flip each way (10 right→wrong, 10 wrong→right): accuracy 0.55 on both sides,
    recovery exactly 1 with a CI across 0.95 (inconclusive), flips 20/200 = 0.10 with a Wilson
    interval wholly above warn 0.05 (flagged), McNemar p 1."""
    base = [True] * 100 + [True] * 10 + [False] * 10 + [False] * 80
    cand = [True] * 100 + [False] * 10 + [True] * 10 + [False] * 80
    b, c = _records(base), _records(cand)
    rec = recovery_comparison(c, b, Thresholds.seed("task_recovery"), seed=0)
    assert rec is not None and rec.estimate == 1.0 and rec.n == 200
    assert rec.ci_low < 0.95 < 1.0 < rec.ci_high and rec.verdict == "inconclusive"
    assert (rec.baseline_value, rec.candidate_value) == (0.55, 0.55)
    assert rec.details["right_to_wrong"] == 10 and rec.details["wrong_to_right"] == 10 and rec.details["mcnemar_p"] == 1
    flips = flips_comparison(c, b, Thresholds.seed("task_flips"))
    assert flips is not None and flips.estimate == pytest.approx(0.10)
    lo, hi = wilson_interval(20, 200)
    assert (flips.ci_low, flips.ci_high) == (lo, hi) and 0.05 < lo < 0.15  # 0.0661
    assert flips.verdict == "warn" and "10 right→wrong, 10 wrong→right of 200" in flips.rule


def test_a_lossless_candidate_and_a_broken_one():
    base = [True] * 60 + [False] * 40
    same = recovery_comparison(_records(base), _records(base), Thresholds.seed("task_recovery"))
    assert same is not None and (same.estimate, same.ci_low, same.ci_high, same.verdict) == (1.0, 1.0, 1.0, "ok")
    none = flips_comparison(_records(base), _records(base), Thresholds.seed("task_flips"))
    assert none is not None and none.estimate == 0 and none.verdict == "ok"  # Wilson top 0.037 < 0.05
    broken = [True] * 30 + [False] * 70  # 30 right→wrong: recovery 30/60 = 0.5
    r = recovery_comparison(_records(broken), _records(base), Thresholds.seed("task_recovery"))
    assert r is not None and r.estimate == 0.5 and r.verdict == "critical"
    assert r.details["mcnemar_p"] == pytest.approx(2 / 2**30)
    nothing = recovery_comparison(_records([False] * 30), _records([False] * 30), Thresholds.seed("task_recovery"))
    assert nothing is not None and math.isnan(nothing.estimate) and "baseline answered no item right" in nothing.rule


def test_lm_eval_samples_become_items():
    mc = {"doc_id": 7, "target": 1, "arguments": {"gen_args_0": {"arg_0": "Q: 2+2?\nA:", "arg_1": " 3"},
                                                  "gen_args_1": {"arg_0": "Q: 2+2?\nA:", "arg_1": " 4"}},
          "acc": 1.0}
    item = parse_item(from_lm_eval_sample(mc, "arith"), "t")  # as lm-eval's tracker writes a sample
    assert (item.key, item.prompt, item.choices, item.answer) == ("arith#7", "Q: 2+2?\nA:", (" 3", " 4"), " 4")
    many = {"doc_id": 1, "target": 10, "arguments": {f"gen_args_{i}": {"arg_0": "c", "arg_1": f" {i}"} for i in range(12)}}
    assert from_lm_eval_sample(many, "t")["choices"][10] == " 10"  # gen_args_10 after gen_args_9, not after _1
    listed = {"doc_id": 0, "target": "0", "arguments": [["ctx", " a"], ["ctx", " b"]]}
    assert from_lm_eval_sample(listed, "t")["answer"] == 0
    gen = {"doc_id": 3, "target": " Paris", "arguments": [["Capital of France?", {"until": ["\n"]}]]}
    assert from_lm_eval_sample(gen, "geo") == {"id": "geo#3", "prompt": "Capital of France?", "answer": "Paris",
                                               "match": "exact"}
    with pytest.raises(ItemError, match="run lm_eval with --log_samples"):
        from_lm_eval_sample({"results": {}}, "t")


def test_the_builtin_task_is_fixed_and_well_formed():
    items = builtin_items("pydoc-next-word")
    assert len(items) == len({i.key for i in items}) > 200
    assert all(i.prompt and i.match == "choice" and len(i.choices) == 4 and i.answer in i.choices for i in items)
    first = items[0]  # the first held-out docstring, cut before the word its id's hash picked
    assert first.prompt == "_collections_abc\n\nAbstract Base Classes (ABCs) for collections,"
    assert first.answer == " according" and first.choices == (" collections", " tests", " PEP", " according")
    assert json.dumps([i.to_json() for i in items]) == json.dumps([i.to_json() for i in builtin_items("pydoc-next-word")])
    with pytest.raises(ItemError, match="unknown built-in task 'nope'"):
        builtin_items("nope")


def test_a_corpus_and_an_items_file_name_a_line_that_is_not_json_alike(tmp_path):
    from app.corpus import CorpusError, load_corpus, load_items

    corpus, items = tmp_path / "c.jsonl", tmp_path / "i.jsonl"
    corpus.write_text('{"id": "a", "text": "x"}\n\n{bad\n')
    items.write_text('{"id": "a", "prompt": "q", "answer": "x"}\n{bad\n')
    with pytest.raises(CorpusError, match=r"^corpus: .*c\.jsonl line 3 is not JSON"):
        load_corpus(str(corpus))
    with pytest.raises(CorpusError, match=r"^labelled\.items: i\.jsonl line 2 is not JSON"):
        load_items(str(items))
    with pytest.raises(CorpusError, match=r"is not a \.jsonl file"):
        load_items(str(tmp_path))


def test_the_run_page_lists_each_candidate_s_task_figures():
    """200 items, 10 flipped each way: 55.0% → 55.0%, recovery 1.000 [0.930, 1.075] inconclusive,
    flips warn: the row's verdict is the worse, warn."""
    from dashboard.views.run_detail import task_rows

    details = {"items": 200, "baseline_accuracy": 0.55, "candidate_accuracy": 0.55, "right_to_wrong": 10,
               "wrong_to_right": 10, "mcnemar_p": 1.0}
    run = {"comparisons": [
        {"config": "int4", "metric": "task_recovery", "estimate": 1.0, "ci_low": 0.93, "ci_high": 1.075,
         "verdict": "inconclusive", "details": details},
        {"config": "int4", "metric": "task_flips", "estimate": 0.1, "verdict": "warn",
         "details": details | {"near_tie_flips": 3}},
        {"config": "int8", "metric": "ppl_ratio", "estimate": 1.01, "verdict": "ok", "details": {}}]}
    assert task_rows(run) == [{"config": "int4", "items": 200, "accuracy": "55.0% → 55.0%",
                               "recovery [95% CI]": "1.000 [0.930, 1.075]", "right→wrong": 10, "wrong→right": 10,
                               "of them at a near-tie": 3, "McNemar p": "1", "verdict": "warn"}]


def test_flips_at_a_near_tie_are_counted_apart():
    """Two flipped items: on one the baseline's choice led by 0.1 nats (≤ τ 0.25: a near-tie any
    server's nondeterminism can flip), on the other both sides led by 2 nats; generated answers have
    no margin and never count as near-ties."""
    from evals.flips import margin, near_tie_flips

    base = {"a": ItemRecord("a", True, "0", (-1.0, -1.1)), "b": ItemRecord("b", True, "0", (-1.0, -3.0)),
            "c": ItemRecord("c", True, "0", (-1.0, -1.05)), "g": ItemRecord("g", True, "x")}
    cand = {"a": ItemRecord("a", False, "1", (-1.3, -1.0)), "b": ItemRecord("b", False, "1", (-3.0, -1.0)),
            "c": ItemRecord("c", True, "0", (-1.0, -1.05)), "g": ItemRecord("g", False, "y")}
    assert margin(base["a"]) == pytest.approx(0.1) and margin(base["g"]) is None
    assert near_tie_flips(cand, base, 0.25) == 1  # a only: c did not flip, b and g are not near-ties
    assert near_tie_flips(cand, base, 0.05) == 0
    flips = flips_comparison(cand, base, Thresholds.seed("task_flips"), tau=0.25)
    assert flips is not None and flips.details["near_tie_flips"] == 1 and flips.details["near_tie_nats"] == 0.25
