"""Decode-regime scoring (engines/reference/scoring.py, evals/compare_targets.decode_nll_ratio):
a document's tokens teacher-forced one per decode step through the KV cache."""

from __future__ import annotations

import math

import pytest
from engines.protocol import RollingRequest, WindowSpec
from engines.reference.engine import ReferenceEngine
from engines.spec import OptimizationSpec
from engines.zoo import resolve_model_path
from evals.compare_targets import CompareContext, decode_nll_ratio
from evals.positions import position_nll, token_positions
from evals.records import ConfigRecords, DocRecord
from evals.stats import Thresholds

TARGET = str(resolve_model_path("builtin:pydoc-target"))
TEXT = "Serialize obj to a JSON formatted str using this conversion table, as json.dumps does."


def engine(kv: str, fault: dict | None = None) -> ReferenceEngine:
    options = {"device": "cpu", **({"fault": fault} if fault else {})}
    return ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", kv_cache=kv,
                                                    engine_options=options))


@pytest.mark.integration
@pytest.mark.parametrize("kv", ["fp16", "fp8", "kivi-2"])
def test_decode_scoring_equals_the_rolling_pass_on_the_reference_engine(kv):
    """The reference engine's prefill already reads its lossy cache back as decoding does (every
    slot written first, then read compressed; KIVI's residual window by position), so one token
    per step gives the same log-probs and argmaxes to float rounding: the prefill-vs-decode gap of
    this engine is 1."""
    e = engine(kv)
    assert e.scores_decode  # fp16 too: a cache narrower than the fp32 compute is lossy
    docs = [RollingRequest(f"d{i}", f"{i} " + " ".join([TEXT] * (3 + i)), WindowSpec(48, 32)) for i in range(3)]
    rolled, decoded = e.loglikelihood_rolling(docs), e.loglikelihood_decode(docs)
    for r, d in zip(rolled, decoded, strict=True):
        assert d.token_ids == r.token_ids and len(d.logprobs) == len(r.token_ids) > 48  # strided windows, each token once
        assert d.logprobs == pytest.approx(r.logprobs, abs=1e-4)
        assert d.greedy_ids == r.greedy_ids


@pytest.mark.integration
def test_a_kv_fault_from_slot_n_shows_in_the_decode_buckets_past_n():
    """kv-corrupt from slot 128 on 256-token windows, scored one token per step: the tokens
    predicted from slots 0–127 equal the fault-free pass's, those past it read noise, and
    decode_nll_ratio's by-position table flags 128–255 alone."""
    window = WindowSpec(256, 256)
    docs = [RollingRequest(f"d{i}", f"{i} " + " ".join([TEXT] * 10), window) for i in range(4)]  # ~220 tokens
    clean = engine("fp16", {"kind": "kv-corrupt", "layers": 6, "sigma": 2.0, "from_slot": 1000})  # no noise
    bad = engine("fp16", {"kind": "kv-corrupt", "layers": 6, "sigma": 2.0, "from_slot": 128})
    assert clean.scores_decode  # the fault makes the cache lossy
    base, cand = clean.loglikelihood_decode(docs), bad.loglikelihood_decode(docs)
    for b, c in zip(base, cand, strict=True):
        pos = token_positions(len(b.token_ids), window)
        assert 128 < len(b.token_ids) <= 256  # one window, past the fault's first slot
        early = [i for i, p in enumerate(pos) if p < 128]
        assert [c.logprobs[i] for i in early] == pytest.approx([b.logprobs[i] for i in early], abs=1e-6)
        assert sum(c.logprobs) < sum(b.logprobs) - 1.0

    def records(results) -> ConfigRecords:
        out = ConfigRecords.empty()
        for r in results:  # the rolling figures are the decode ones here: only decode_nll_ratio reads them
            out.add(DocRecord.from_result(r, None, False, None, position_nll(r.logprobs, window),
                                          (r.nll, position_nll(r.logprobs, window))))
        return out

    ctx = CompareContext(mine=records(cand), base=records(base),
                         thresholds=lambda _: Thresholds(1.02, 1.05, "above", min_n=4))
    c = decode_nll_ratio(ctx)
    assert c is not None and c.metric == "decode_nll_ratio" and c.estimate > 1.05
    rows = {r["positions"]: r for r in c.details["by_position"]}
    assert set(rows) == {"0–127", "128–255"}
    assert rows["0–127"]["estimate"] == pytest.approx(1.0, abs=1e-6) and rows["0–127"]["verdict"] == "ok"
    assert rows["128–255"]["verdict"] == "critical"


def doc(key: str, nll: float, decode_nll: float | None) -> DocRecord:
    return DocRecord(key, nll, 10, 8, 40, decode_nll=decode_nll)


def test_decode_nll_ratio_and_the_gap_worked_by_hand():
    """Baseline NLLs 10 and 20 over 10 tokens each; the candidate 11 and 21 in its rolling pass,
    12 and 22 one token per step; a third document it did not decode.
    decode ratio = exp((12 + 22 − 30) / 20) = e^0.2 = 1.2214; prefill on the same two documents
    = exp((11 + 21 − 30) / 20) = e^0.1 = 1.1052; gap = e^0.1 = 1.1052."""
    def records(*docs: DocRecord) -> ConfigRecords:
        out = ConfigRecords.empty()
        for d in docs:
            out.add(d)
        return out

    base = records(doc("a", 10, None), doc("b", 20, None), doc("c", 30, None))
    mine = records(doc("a", 11, 12), doc("b", 21, 22), doc("c", 31, None))
    ctx = CompareContext(mine=mine, base=base, thresholds=lambda _: Thresholds(1.15, 1.30, "above", min_n=2))
    c = decode_nll_ratio(ctx)
    assert c is not None and c.n == 2 and not c.gated  # reported, not judged
    assert c.estimate == pytest.approx(math.exp(0.2))
    assert c.details["prefill_ratio"] == pytest.approx(math.exp(0.1))
    assert c.details["prefill_decode_gap"] == pytest.approx(math.exp(0.1))
    assert "decode ÷ prefill on these documents 1.105" in c.rule
    assert decode_nll_ratio(CompareContext(mine=base, base=base, thresholds=ctx.thresholds)) is None  # nothing decoded
    assert decode_nll_ratio(CompareContext(mine=mine, base=base, thresholds=ctx.thresholds, is_base=True)) is None
