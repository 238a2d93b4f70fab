"""Generation's decode loops reused per batch bucket (engines/reference/engine.py pooled_decoder):
where decode steps are captured as CUDA graphs, the capture is paid once per bucket, not per
batch. On this CPU the pool is switched on by hand (graphs stay off): a loop that served an
earlier, longer sequence must serve the next one exactly as a fresh loop would, whatever the
earlier one left in its cache, for every KV format. GPU: tests/kernels/test_decode_graphs.py."""

import pytest
from engines.protocol import GenerationRequest
from engines.reference.engine import DECODER_POOL, ReferenceEngine
from engines.spec import OptimizationSpec
from engines.zoo import ARTIFACTS, resolve_model_path
from engines.zoo.corpus import read_jsonl

TARGET = str(resolve_model_path("builtin:pydoc-target"))
NO_EOS = ((0, -100.0),)


def engine_for(kv: str, reuse: bool, concurrency: int = 1) -> ReferenceEngine:
    engine = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", kv_cache=kv,
                                                      engine_options={"device": "cpu", "concurrency": concurrency}))
    engine.reuse_decoders = reuse
    return engine


def batches() -> list[list[GenerationRequest]]:
    """A long sequence first (150 new tokens: past KIVI's first key group), then shorter ones in
    the same bucket, a single row, and two rows of different lengths (left padding)."""
    texts = [" ".join(d.text.split()[:w]) for d, w in zip(read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl")[:6],
                                                          (30, 12, 20, 8, 25, 16), strict=True)]
    r = [GenerationRequest(f"r{i}", t, max_new_tokens=n, logit_bias=NO_EOS, logprobs=0)
         for i, (t, n) in enumerate(zip(texts, (150, 40, 100, 20, 60, 30), strict=True))]
    return [[r[0]], [r[1]], [r[2]], [r[3], r[4]], [r[5]]]


def outputs(engine: ReferenceEngine) -> list[tuple]:
    out = []
    for batch in batches():
        engine.concurrency = len(batch)
        out += [(g.token_ids, [lp for lp, _ in g.token_logprobs]) for g in engine.generate(batch)]
    return out


@pytest.mark.parametrize("kv", ["fp32", "fp8", "kivi-2", "turbo-3"])
@pytest.mark.integration  # slow for the quick tier's budget: the whole suite runs it
def test_a_reused_decode_loop_decodes_as_a_fresh_one(kv):
    pooled, fresh = engine_for(kv, True), engine_for(kv, False)
    got, want = outputs(pooled), outputs(fresh)
    for (ids, lps), (want_ids, want_lps) in zip(got, want, strict=True):
        assert ids == want_ids
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 1e-4
    # 5 batches, the 2 most recently used loops kept: (1 row, 256 slots) built for the first,
    # (1, 128) for the second, (1, 256) reused by the third, (2 rows, 128, padded) built for the
    # fourth (dropping (1, 128)), (1, 128) built again for the fifth (dropping (1, 256))
    assert (pooled.batches_decoded, fresh.batches_decoded) == (5, 5)
    assert pooled.decoders_built == 4 and fresh.decoders_built == 5
    assert len(pooled._decoders) == DECODER_POOL
    assert list(pooled._decoders) == [(2, 128, True), (1, 128, False)]
    assert "decode loops: 4 built for 5 batches" in " ".join(pooled.describe().notes)


def test_a_pooled_loop_keeps_its_bucket_and_refuses_nothing_that_fits():
    engine = engine_for("fp32", True)
    d = engine.pooled_decoder(1, 129, False)
    assert d.slots == 256 and engine.pooled_decoder(1, 200, False) is d
    assert engine.pooled_decoder(1, 1024, False).slots == 1024  # the context caps the bucket
    assert engine.pooled_decoder(1, 100, False).slots == 128
    assert engine.pooled_decoder(1, 200, False) is not d  # dropped: the two most recent are kept


def test_buckets_by_hand():
    from engines.reference.engine import slots_bucket

    assert [slots_bucket(n, 32768) for n in (1, 128, 129, 4096, 4097, 8193, 32768)] == \
        [128, 128, 256, 4096, 8192, 12288, 32768]
    assert slots_bucket(1000, 1024) == 1024 and slots_bucket(100, 64) == 100  # the context caps, never below slots


def test_a_loop_whose_step_was_not_captured_is_not_kept_and_reset_peaks_empties_the_pool():
    engine = engine_for("fp32", True)
    d = engine.pooled_decoder(1, 100, False)
    d.graphs_reason = "capture failed, decoding eagerly: RuntimeError: x"  # as a failed capture leaves it
    assert engine.pooled_decoder(1, 100, False) is not d
    assert engine.pooled_decoder(1, 100, False) is not d and (1, 128, False) not in engine._decoders
    engine.pooled_decoder(1, 300, False)
    assert engine._decoders
    engine.reset_peaks()
    assert not engine._decoders and engine.peak_kv_bytes == 0

