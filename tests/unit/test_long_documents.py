"""Long-context documents (suite perplexity.long_documents, app/corpus.join_long): the corpus's
documents joined in order until each fills its window, so the late position buckets are scored."""

from __future__ import annotations

import json

import pytest
from app.corpus import CorpusError, SampleIn, join_long
from vocabulary.suite import LONG_CHARS_PER_TOKEN

from tests.unit.test_cli import GOOD, run_cli, write  # noqa: F401 - run_cli is a fixture


def docs(*sizes: int) -> list[SampleIn]:
    return [SampleIn(f"d{i}", "x" * n, cluster=f"c{i}") for i, n in enumerate(sizes)]


def test_documents_join_in_order_until_each_fills_its_window():
    # window 10 → 60 characters each; a separator counts 2: d0+d1 = 32 + 32 = 64 ≥ 60, d2 alone is 70,
    # then d3+d4 = 22 + 22 = 44 < 60 and d5 (30) makes 76; the remainder d6 (10) is too short: it joins d3+d4+d5
    assert LONG_CHARS_PER_TOKEN == 6
    joined = join_long(docs(30, 30, 70, 20, 20, 28, 10), window=10, max_chars=1000)
    assert [(s.key, s.cluster, len(s.text)) for s in joined] == [("d0+1", "d0+1", 62), ("d2", "d2", 70),
                                                                  ("d3+3", "d3+3", 84)]
    assert joined[0].text == "x" * 30 + "\n\n" + "x" * 30  # a blank line between documents
    assert join_long(docs(10), window=10, max_chars=1000)[0].key == "d0"  # one short document stays one


def test_a_joined_document_stays_within_the_character_limit():
    # max 100, target 60: d0+d1 = 42 + 42 = 84 ≥ 60, full; d2 (50) + d3 (90) would pass 100, so d2 ends there,
    # shorter than the target (the limit wins), and d3 stands alone
    joined = join_long(docs(40, 40, 50, 90), window=10, max_chars=100)
    assert [(s.key, len(s.text)) for s in joined] == [("d0+1", 82), ("d2", 50), ("d3", 90)]


def test_parts_of_one_source_keep_one_cluster_and_keys_stay_unique():
    # a source split into parts (one cluster, as the built-in corpus's "stdlib:aifc#n" parts are) that lands
    # in two joined documents: both get one cluster, so the bootstrap resamples them together
    parts = [SampleIn(f"aifc#{i}", "x" * 30, cluster="aifc") for i in range(4)]
    joined = join_long([*parts, SampleIn("zlib", "x" * 70, cluster="zlib")], window=10, max_chars=1000)
    assert [(s.key, s.cluster) for s in joined] == [("aifc#0+1", "aifc#0+1"), ("aifc#2+1", "aifc#0+1"),
                                                    ("zlib", "zlib")]
    # a document whose own key reads like a joined one's ("a+1" alone, after a and b joined): made unique
    clash = [SampleIn("a", "x" * 30), SampleIn("b", "x" * 30), SampleIn("a+1", "x" * 70)]
    assert [s.key for s in join_long(clash, window=10, max_chars=1000)] == ["a+1", "a+1~1"]


def test_rag_items_and_a_window_past_the_limit_are_refused_naming_the_field():
    rag = [SampleIn("q0", "question", reference="answer", contexts=["a passage"])]
    with pytest.raises(CorpusError, match=r"perplexity.long_documents: the corpus's documents carry references or "
                                          r"contexts \(RAG items\)"):
        join_long(rag, window=10, max_chars=1000)
    with pytest.raises(CorpusError, match=r"suites\[0\].perplexity.long_documents: a window of 1024 tokens needs "
                                          r"documents of 6144 characters, above the limit of 5000"):
        join_long(docs(10), window=1024, max_chars=5000, field="suites[0].perplexity.long_documents")


@pytest.mark.integration
def test_long_documents_score_the_late_buckets_a_kv_fault_shows_in(run_cli, tmp_path):  # noqa: F811
    """Through `canary run --json` as a user runs it: the built-in corpus's short documents (median
    ~180 tokens) mostly never reach slot 128 of a 256-token window, so a KV fault from slot 128 is
    scored on few of them; joined into long documents, every document fills its window and the
    fault shows in 128–255 on all of them, while 0–127 stays exactly the baseline's."""
    fault = {"kind": "kv-corrupt", "layers": 6, "sigma": 2.0, "from_slot": 128}
    configs = [{"name": "fp32", "baseline": True, "engine": "reference", "weights": "fp32"},
               {"name": "kv-late", "engine": "reference", "weights": "fp32", "engine_options": {"fault": fault}}]

    def by_position(long_documents: bool) -> dict[str, dict]:
        suite = {"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 16, "scorers": ["perplexity"],
                 "perplexity": {"window": 256, "long_documents": long_documents}}
        data = {**GOOD, "configs": configs, "suites": [suite], "schedules": [], "channels": [], "thresholds": {}}
        r = run_cli("run", "-f", write(tmp_path, data), "--json")
        assert r.returncode in (0, 1), r.stderr  # 1: the run fails, as the fault should make it
        comparisons = json.loads(r.stdout)["comparisons"]
        # the perplexity windows are the canary's own scoring, not requests a server holds: no KV use
        # (a lossy cache filling its whole window read 100 %, critical, beside a lossless baseline with none)
        assert not [c for c in comparisons if c["metric"] == "kv_cache_usage"]
        [ratio] = [c for c in comparisons if c["metric"] == "ppl_ratio"]
        return {b["positions"]: b for b in ratio["details"]["by_position"]}

    short, long = by_position(False), by_position(True)
    assert short["128–255"]["n"] < 16  # documents that never reach slot 128
    assert long["128–255"]["n"] == 16 and long["128–255"]["tokens"] > 2 * short["128–255"]["tokens"]
    assert long["0–127"]["estimate"] == 1.0 and long["0–127"]["verdict"] == "ok"
    assert long["128–255"]["ci_low"] > 1.3 and long["128–255"]["verdict"] == "critical"
