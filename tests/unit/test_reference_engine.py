"""The reference decoder on the real tiny model, against transformers."""

import pytest
from engines.hf import TransformersEngine
from engines.protocol import GenerationRequest, RollingRequest, WindowSpec
from engines.reference.engine import ReferenceEngine
from engines.reference.model import ModelArgs
from engines.registry import load_engine
from engines.spec import OptimizationSpec
from engines.zoo import resolve_model_path

TARGET = str(resolve_model_path("builtin:pydoc-target"))
TEXT = "json.dumps()\n\nSerialize obj to a JSON formatted str using this conversion table. " * 4


def ref(**kw):
    return ReferenceEngine(TARGET, OptimizationSpec(engine="reference", **kw))


@pytest.fixture(scope="module")
def fp32():
    return ref(weights="fp32")


def test_logprobs_match_transformers_fp32(fp32):
    # Stated tolerance: 1e-3 nats per token in fp32. Measured ≈ 3e-6 in a plain process; under the
    # test runner with 2 threads we have seen up to 3.3e-4 (thread-order-dependent reductions).
    hf = TransformersEngine(TARGET, OptimizationSpec(weights="fp32"))
    reqs = [RollingRequest("a", TEXT, WindowSpec(64, 32)), RollingRequest("b", TEXT[:90], WindowSpec(64, 64))]
    for r, h in zip(fp32.loglikelihood_rolling(reqs), hf.loglikelihood_rolling(reqs), strict=False):
        assert r.token_ids == h.token_ids
        assert r.logprobs == pytest.approx(h.logprobs, abs=1e-3)
        assert r.greedy_ids == h.greedy_ids
    g = GenerationRequest("g", "json.dumps()\n\nSerialize", max_new_tokens=16)
    assert fp32.generate([g])[0].token_ids == hf.generate([g])[0].token_ids
    assert isinstance(load_engine(TARGET, OptimizationSpec(engine="reference")), ReferenceEngine)


def test_batched_generation_equals_one_at_a_time():
    reqs = [GenerationRequest(str(i), p, max_new_tokens=10) for i, p in
            enumerate(["os.path", "json.dumps()\n\nSerialize obj to a", "class"])]
    one = ref(weights="fp32").generate(reqs)
    batched = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", engine_options={"concurrency": 3})).generate(reqs)
    assert [r.token_ids for r in one] == [r.token_ids for r in batched]  # left padding is invisible
    assert all(b.ttft_ms > 0 and len(b.itl_ms) == len(b.token_ids) - 1 for b in batched)


def test_kivi_is_lossless_until_keys_leave_the_residual(fp32):
    # KIVI keeps up to 128 keys in full precision and flushes them 128 at a time: a 128-token
    # window never reads a compressed key; in a 256-token window the query at position 128
    # (129 cached tokens) is the first to read 128 compressed keys.
    kivi = ref(weights="fp32", kv_cache="kivi-2")
    short = [RollingRequest("s", TEXT, WindowSpec(128, 128))]
    long = [RollingRequest("l", TEXT * 3, WindowSpec(256, 256))]
    assert kivi.loglikelihood_rolling(short)[0].logprobs == pytest.approx(fp32.loglikelihood_rolling(short)[0].logprobs, abs=1e-5)
    a, b = kivi.loglikelihood_rolling(long)[0].logprobs, fp32.loglikelihood_rolling(long)[0].logprobs
    assert a[:128] == pytest.approx(b[:128], abs=1e-5)
    assert abs(a[128] - b[128]) > 1e-4


def test_lossy_kv_scores_do_not_depend_on_other_requests():
    e = ref(weights="fp32", kv_cache="turbo-2.5")
    a, b = RollingRequest("a", TEXT, WindowSpec(64, 64)), RollingRequest("b", TEXT[40:] + TEXT, WindowSpec(64, 64))
    alone = e.loglikelihood_rolling([b])[0].nll
    e.loglikelihood_rolling([a])
    assert e.loglikelihood_rolling([b])[0].nll == pytest.approx(alone, abs=1e-6)


@pytest.mark.parametrize(("kv", "lengths"), [
    ("fp8", (3, 5, 8, 13, 21, 6)), ("turbo-2.5", (3, 5, 8, 13, 21, 6)), ("kivi-2", (3, 5, 8, 13, 21, 6)),
    ("turbo-3.5", (40, 90, 12, 70, 25)), ("kivi-2", (40, 90, 12, 70, 25)),
], ids=["fp8", "turbo-2.5", "kivi-2", "turbo-3.5-longer", "kivi-2-past-its-window"])
def test_a_lossy_pass_packs_short_windows_end_to_end_and_scores_each_as_alone(kv, lengths):
    """Windows of a few to about 200 tokens in one rolling call: a format whose slots encode on
    their own lays several end to end in a cache row (first-fit decreasing into the widest
    window's width), KIVI one per row (its window reads a slot by its place; past 128 tokens some
    keys and values are read compressed). Either way each document scores as it does alone, and
    the packed pass holds fewer rows."""
    from engines.reference import scoring

    e = ref(weights="fp32", kv_cache=kv)
    words = (TEXT * 3).split()
    docs = [RollingRequest(str(n), " ".join(words[:n]), WindowSpec(256, 256)) for n in lengths]
    together = e.loglikelihood_rolling(docs)
    for doc, got in zip(docs, together, strict=True):
        [alone] = e.loglikelihood_rolling([doc])
        # packed, the products have other shapes and their sums another order: on an AVX2-only
        # CPU one log-prob in 15 moved 1.05e-5 (fp8), within float reassociation of a 64-wide sum
        assert got.logprobs == pytest.approx(alone.logprobs, abs=5e-5)
        assert got.greedy_ids == alone.greedy_ids
    jobs, _, _ = scoring.windows(e, docs)
    rows = [row for batch in scoring._batches(e, jobs) for row in batch]
    assert sorted(j for row in rows for j in row) == list(range(len(jobs)))
    widest = max(len(job[1]) for job in jobs)
    assert all(sum(len(jobs[j][1]) for j in row) <= widest for row in rows)
    assert (len(rows) < len(jobs)) == (kv != "kivi-2")
    if max(lengths) == 90:  # the longest window is past KIVI's 128 raw slots: its lossy path runs
        assert widest > 128


def test_an_uncalibrated_fractional_turbo_format_does_not_pack():
    """Fractional TurboQuant picks its outlier channels from the weights once calibrated (as every
    engine does); before, from each call's own keys, so a slot's code would depend on the pass."""
    from engines.reference.kv.turbo import TurboKV

    assert not TurboKV(3.5).slots_on_their_own and TurboKV(3).slots_on_their_own
    assert ref(weights="fp32", kv_cache="turbo-3.5").kv.slots_on_their_own  # the engine calibrated it


def test_pack_rows_is_first_fit_decreasing():
    from engines.reference.scoring import pack_rows

    # by hand, longest first: 10 fills row 0; 9 opens row 1 (room 1); 7 row 2 (room 3); 5 row 3
    # (room 5); 3 → row 2, the first with room (room 0); 2 → row 3 (room 3); 1 → row 1 (room 0)
    assert pack_rows([3, 9, 1, 7, 5, 2, 10], 10) == [[6], [1, 2], [3, 0], [4, 5]]
    assert pack_rows([], 10) == []
    assert pack_rows([12], 10) == [[0]]


def test_greedy_speculative_and_batching_hold_under_a_lossy_kv_cache():
    reqs = [GenerationRequest(str(i), p, max_new_tokens=10) for i, p in enumerate(["os.path", "json.dumps()\n\nSerialize obj"])]
    plain = [g.token_ids for g in ref(weights="fp32", kv_cache="int8").generate(reqs)]
    batched = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", kv_cache="int8",
                                                       engine_options={"concurrency": 2})).generate(reqs)
    spec = ReferenceEngine(TARGET, OptimizationSpec.model_validate({"engine": "reference", "weights": "fp32", "kv_cache": "int8",
                                                                    "speculative": {"method": "ngram", "k": 3}})).generate(reqs)
    assert [g.token_ids for g in batched] == plain == [g.token_ids for g in spec]


def test_compressed_kv_changes_scores_and_memory(fp32):
    req = [RollingRequest("d", TEXT, WindowSpec(64, 64))]
    base = fp32.loglikelihood_rolling(req)[0].nll
    turbo2, turbo4 = ref(weights="fp32", kv_cache="turbo-2"), ref(weights="fp32", kv_cache="turbo-4")
    d2 = turbo2.loglikelihood_rolling(req)[0].nll - base
    d4 = turbo4.loglikelihood_rolling(req)[0].nll - base
    assert abs(d2) > abs(d4) > 0
    # KV bytes per token: 6 layers · 2 kv heads · 32 dims · (k + v bits) / 8
    assert ref(kv_cache="fp16").describe().kv_bytes_per_token == 6 * 2 * 32 * 32 // 8
    assert turbo2.describe().kv_bytes_per_token == 6 * 2 * 32 * 5 // 8  # 2 + 16/32 bits each for k and v


def test_unsupported_architectures_are_refused():
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        ModelArgs.from_hf({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        ModelArgs.from_hf({"model_type": "llama", "rope_scaling": {"rope_type": "yarn"}, "num_attention_heads": 4,
                           "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, "intermediate_size": 8})


def test_memory_figures_are_measured_from_what_the_engine_holds():
    e = ref(weights="rtn-int4", kv_cache="int8")
    e.loglikelihood_rolling([RollingRequest("d", TEXT, WindowSpec(64, 64))])
    d = e.describe()
    # on CPU the engine keeps a dequantized copy in its compute type (fp16 where the CPU has half
    # matmul, else fp32): 2 or 4 bytes per parameter, while the int4 storage format it models is smaller
    import torch

    size = torch.finfo(getattr(torch, d.compute_dtype)).bits // 8
    assert d.resident_weight_bytes == size * d.parameters > d.weight_bytes
    # TEXT is 89 tokens → windows of 64 and 25 tokens, batched as 2 rows of width 64; the compressed
    # kq, vq buffers in the compute type and no raw copy beside them (int8 reads only what it stores):
    # 2 × 6 layers × 2 rows × 2 kv heads × 64 × 32 dims × size
    assert len(e.tokenizer(TEXT, add_special_tokens=False)["input_ids"]) == 89
    assert d.peak_kv_cache_bytes == 2 * 6 * 2 * 2 * 64 * 32 * size


def test_kv_cache_usage_is_the_peak_share_of_a_full_context_cache_holding_tokens():
    # the tiny model's context is 1024 positions: a server reserves that much per sequence
    e = ref(weights="fp32", kv_cache="int8")
    assert e.args.max_seq_len == 1024
    assert e.describe().kv_cache_usage is None  # no cache has held a token yet
    # perplexity windows are the canary's own scoring, not requests a server holds: they count nothing
    # (TEXT is 89 tokens → two full windows of 64 through the int8 cache; a lossless config scores them
    # with no cache at all, so counting them would judge the lossy one alone)
    e.loglikelihood_rolling([RollingRequest("d", TEXT, WindowSpec(64, 64))])
    e.loglikelihood_decode([RollingRequest("d", TEXT, WindowSpec(64, 64))])
    assert e.describe().kv_cache_usage is None and e.describe().peak_kv_cache_bytes > 0  # its memory counts
    # generation: a 12-token prompt (BOS included) and 8 new tokens; the prompt fills 12 positions,
    # each of the 7 decode steps one more (the 8th token is never written): 19 / 1024
    g = e.generate([GenerationRequest("g", "json.dumps()\n\nSerialize", max_new_tokens=8)])[0]
    assert (g.prompt_tokens, len(g.token_ids)) == (12, 8)
    assert e.describe().kv_cache_usage == 19 / 1024
    e.generate([GenerationRequest("g", "os.path", max_new_tokens=8)])
    assert e.describe().kv_cache_usage == 19 / 1024  # the peak over both caches (4 + 7 = 11 the second)
    # the engine is cached across config-runs: each run's window starts from nothing
    e.reset_peaks()
    assert e.describe().kv_cache_usage is None and e.describe().peak_kv_cache_bytes == 0
    e.generate([GenerationRequest("g", "os.path", max_new_tokens=8)])
    assert e.describe().kv_cache_usage == 11 / 1024  # this window's peak, not the earlier 19 / 1024
    # a batch of two: prompts of 4 and 12 tokens left-padded to 12, max_new_tokens 6 and 4; 5 decode
    # steps write one position per row each (padding holds no token): (4 + 12 + 2 × 5) / (2 × 1024)
    b = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", engine_options={"concurrency": 2}))
    out = b.generate([GenerationRequest("a", "os.path", max_new_tokens=6),
                      GenerationRequest("b", "json.dumps()\n\nSerialize", max_new_tokens=4)])
    assert [(r.prompt_tokens, len(r.token_ids)) for r in out] == [(4, 6), (12, 4)]
    assert b.describe().kv_cache_usage == 26 / 2048


def test_an_openai_config_labelled_awq_loads_without_calibration():
    # the server runs AWQ itself: calibration text is only for the engine that quantizes
    from engines.openai import EndpointError, OpenAIEngine

    spec = OptimizationSpec(engine="openai", weights="awq-int4", engine_options={"base_url": "http://vllm.invalid:8000/v1"})
    # the constructor gets as far as asking the (unresolvable) server, not a TypeError on calibration=
    with pytest.raises(EndpointError, match="unreachable"):
        load_engine("served-model", spec, calibration=["text"])
    assert OpenAIEngine.__init__.__kwdefaults__ is not None and "calibration" not in OpenAIEngine.__init__.__kwdefaults__


def test_rope_frequencies_stay_fp32_when_the_weights_are_cast():
    # cast to fp16 they drift by 0.3 rad at position 2K (the engine casts with model.to(dtype))
    import torch
    from engines.reference.model import load_model, rope_inv_freq

    model = load_model(TARGET, torch.float32).to(torch.float16)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float16
    assert model.inv_freq.dtype == torch.float32
    assert torch.equal(model.inv_freq, rope_inv_freq(model.args))


def test_a_temperature_too_small_to_divide_by_samples_greedily():
    # 3e-300 and 5e-324 overflow logits / T to ±inf (softmax NaN, a 500 at engine-serve before):
    # below vLLM's 1e-5 the engine picks the argmax, the limit of softmax(x / T) as T → 0
    e = ref(weights="fp32")
    greedy = e.generate([GenerationRequest("g", "json.dumps()", max_new_tokens=6)])[0].token_ids
    for t in (3e-300, 5e-324, 9e-6):
        assert e.generate([GenerationRequest("g", "json.dumps()", max_new_tokens=6, temperature=t)])[0].token_ids == greedy


def test_half_precision_weights_compute_in_fp32_on_a_cpu_without_half_matmul(fp32, monkeypatch):
    """fp16 weights on such a CPU: every weight and every cached key/value keeps its fp16 rounding,
    the arithmetic runs in fp32, and the figures say so. On a GPU the half type computes."""
    import torch
    from engines.reference import engine as reference

    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)  # what this test asserts is the fallback
    assert reference.compute_dtype_for(torch.float16, torch.device("cpu")) == torch.float32
    assert reference.compute_dtype_for(torch.float32, torch.device("cpu")) == torch.float32
    assert reference.compute_dtype_for(torch.float16, torch.device("cuda")) == torch.float16
    half = ref(weights="fp16")
    weights = [p for p in half.model.parameters()]
    assert {p.dtype for p in weights} == {torch.float32}
    assert all(torch.equal(p, p.half().float()) for p in weights)  # the stored values are fp16 values
    # "auto" KV is the weights' fp16: reported as 16 bits, held in the fp32 cache like every other
    # activation; an fp16 cache for fp32 weights still rounds each value as it is stored
    assert half.kv.name == "fp16" and not half.kv.lossy
    assert half.describe().kv_bytes_per_token == ref(weights="fp32", kv_cache="fp16").describe().kv_bytes_per_token
    narrower = ref(weights="fp32", kv_cache="fp16").kv
    k = torch.tensor([1.0 + 2 ** -13])  # between two fp16 values: rounds to 1.0 when stored
    assert narrower.lossy and narrower.encode(k, k, None)[0].item() == 1.0
    d = half.describe()
    assert d.compute_dtype == "float32" and any("computed in float32" in n for n in d.notes)
    assert d.weight_bytes < fp32.describe().weight_bytes  # the footprint reported is the fp16 one
    # the rounding shows: close to the fp32 model, not equal to it
    req = [RollingRequest("a", TEXT, WindowSpec(64, 32))]
    a, b = half.loglikelihood_rolling(req)[0].logprobs, fp32.loglikelihood_rolling(req)[0].logprobs
    assert a == pytest.approx(b, abs=5e-2) and a != b
