"""The labelled scorer in a whole run on the embedded default (SQLite + in-process tasks, the real
tiny model): items stored with the suite, answered by every config, compared item by item."""

import json

import pytest
from app import repo
from app.config_file import parse_config
from app.corpus import CorpusError
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.schemas import jsonable
from app.services import apply_config_file, run_summary, start_run
from engines.zoo import resolve_corpus_path
from vocabulary.labelled import builtin_items

pytestmark = pytest.mark.integration


def _config(items: str, n: int, configs=None) -> dict:
    return {
        "project": "lab",
        "model": {"name": "tiny", "path": "builtin:pydoc-target"},
        # fp32: on a CPU fp16 runs about 5× slower, and every item costs a pass per choice
        "configs": configs or [{"name": "fp32", "baseline": True, "weights": "fp32"},
                               {"name": "int2", "weights": "rtn-int2"}],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 2, "seed": 1,
                    "scorers": ["perplexity", "labelled"], "labelled": {"items": items, "max_items": n},
                    "perplexity": {"window": 128}}],
    }


def _run(config: dict) -> dict:
    with session_scope() as s:
        apply_config_file(s, parse_config(config))
    run_id, _ = start_run("lab", "s", None, InlineDispatcher())
    with session_scope() as s:
        run = repo.get_run(s, repo.get_project(s, "lab"), run_id)
        return jsonable(run_summary(s, run)) | {"_items": {
            cr.config.name: {r.sample_key: r for r in repo.sample_results(s, run_id, cr.config_id, "item")}
            for cr in run.config_runs}}


def test_a_builtin_task_is_answered_by_both_configs_and_compared_item_by_item(sqlite_env):
    summary = _run(_config("builtin:pydoc-next-word", 40))
    assert summary["status"] == "done"
    items = summary["_items"]
    expected = [item.key for item in builtin_items("pydoc-next-word")[:40]]
    assert list(items["fp32"]) == list(items["int2"]) == expected  # the first max_items, in file order
    base = {k: r.value == 1.0 for k, r in items["fp32"].items()}
    cand = {k: r.value == 1.0 for k, r in items["int2"].items()}
    assert all(len(r.extra["scores"]) == 4 and r.extra["answer"] in "0123" for r in items["fp32"].values())
    assert sum(base.values()) > 10  # the tiny model beats chance (25 % of 40 = 10) on its own domain
    comparisons = {c["metric"]: c for c in summary["comparisons"] if c["config"] == "int2"}
    recovery, flips = comparisons["task_recovery"], comparisons["task_flips"]
    # the figures recompute from the stored per-item rows, by hand
    assert recovery["n"] == flips["n"] == 40
    assert recovery["estimate"] == pytest.approx(sum(cand.values()) / sum(base.values()))
    r2w = sum(1 for k in base if base[k] and not cand[k])
    w2r = sum(1 for k in base if cand[k] and not base[k])
    assert (recovery["details"]["right_to_wrong"], recovery["details"]["wrong_to_right"]) == (r2w, w2r)
    assert flips["estimate"] == pytest.approx((r2w + w2r) / 40)
    assert recovery["baseline_value"] == pytest.approx(sum(base.values()) / 40)
    # the documents stay documents: the items are not drawn as samples, nor counted as documents
    assert {c["metric"]: c for c in summary["comparisons"] if c["config"] == "int2"}["ppl_ratio"]["n"] == 2
    with session_scope() as s:
        suite = repo.get_suite(s, repo.get_project(s, "lab"), "s")
        n_corpus = len(resolve_corpus_path("builtin:pydoc-heldout").read_text().splitlines())
        assert suite.n_documents == n_corpus
        stored = repo.suite_samples(s, suite.id, suite.version, items=True)
        assert len(stored) == len(builtin_items("pydoc-next-word")) and stored[0].kind == "item"


def test_a_lossless_config_agrees_on_every_item(sqlite_env):
    """No flip in 80 items: the Wilson interval's top, 3.84 / (80 + 3.84) = 0.046, is under warn 0.05
    (with 72 items or fewer it would not be, and the verdict would be inconclusive)."""
    lossless = {"name": "spec", "engine": "reference", "weights": "fp32",  # the same weights
                "speculative": {"method": "ngram", "k": 4}}
    summary = _run(_config("builtin:pydoc-next-word", 80, [{"name": "fp32", "baseline": True, "weights": "fp32"},
                                                         lossless]))
    comparisons = {c["metric"]: c for c in summary["comparisons"] if c["config"] == "spec"}
    flips = comparisons["task_flips"]
    assert flips["estimate"] == 0 and flips["ci_high"] == pytest.approx(0.0458, abs=1e-4) and flips["verdict"] == "ok"
    assert comparisons["task_recovery"]["estimate"] == 1.0 and comparisons["task_recovery"]["verdict"] == "ok"


def test_items_from_a_file_are_scored_by_generation_too(sqlite_env, tmp_path):
    path = tmp_path / "items.jsonl"
    rows = [{"id": f"g{i}", "prompt": "The function", "answer": "never said", "match": "exact"} for i in range(3)]
    rows.append({"id": "n", "prompt": "Return the number", "answer": "7", "match": "number"})
    rows.append({"id": "c", "prompt": "Return the", "choices": [" value", " zzzq"], "answer": 0})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    summary = _run(_config(str(path), 100, [{"name": "fp32", "baseline": True, "weights": "fp32"},
                                            {"name": "int8", "weights": "int8"}]))
    items = summary["_items"]["fp32"]
    assert list(items) == ["g0", "g1", "g2", "n", "c"]
    assert items["g0"].extra["output"] and items["g0"].value == 0.0  # a real greedy answer, not what was asked
    assert items["c"].value == 1.0 and items["c"].extra["answer"] == "0"  # " value" is far likelier than " zzzq"
    recovery = next(c for c in summary["comparisons"] if c["config"] == "int8" and c["metric"] == "task_recovery")
    assert recovery["n"] == 5 and recovery["verdict"] == "inconclusive" and "min_n" in recovery["rule"]


def test_a_wrong_item_is_refused_naming_the_line_and_nothing_is_stored(sqlite_env, tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text('{"id": "a", "prompt": "q", "answer": "x"}\n{"id": "b", "prompt": "q", "choices": ["x"], "answer": 0}\n')
    with pytest.raises(CorpusError, match=r"suites\[0\].labelled.items: items.jsonl line 2: item 'b': a multiple-choice "
                                          r"item needs at least 2 'choices'"):
        with session_scope() as s:
            apply_config_file(s, parse_config(_config(str(path), 10)))
    with session_scope() as s:
        assert repo.list_suites(s, repo.get_or_create_project(s, "lab")) == []
    with pytest.raises(ValueError, match=r"labelled: the labelled scorer needs labelled\.items"):
        parse_config(_config("", 10))
