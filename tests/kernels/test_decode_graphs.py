"""On CUDA the reference engine's decode step replays a CUDA graph (engines/reference/decode.py)
and picks the same tokens as eager decoding. GPU only: `make gpu-report` runs it."""

import pytest
import torch
from engines.protocol import GenerationRequest
from engines.zoo import resolve_model_path

# as test_engine_dispatch.py: without pydantic (the stock GPU image) the module is skipped, not a collection error
pytest.importorskip("pydantic", reason="ReferenceEngine needs engines.spec (pydantic): docs/benchmarks.md 'GPU report'")
from engines.reference.engine import ReferenceEngine
from engines.spec import OptimizationSpec

TARGET = str(resolve_model_path("builtin:pydoc-target"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run it with make gpu-report")
@pytest.mark.parametrize("kv_cache", ["fp16", "fp8", "turbo-3"])
def test_cuda_graph_replay_matches_eager_decoding(kv_cache):
    spec = lambda graphs: OptimizationSpec(engine="reference", weights="fp16", kv_cache=kv_cache,  # noqa: E731
                                           engine_options={"device": "cuda", "cuda_graphs": graphs})
    req = [GenerationRequest("g", "os.path.join(a, *p)\n\nJoin two", max_new_tokens=16)]
    eager = ReferenceEngine(TARGET, spec(False))
    graphed = ReferenceEngine(TARGET, spec(True))
    want = eager.generate(req)[0].token_ids
    got = graphed.generate(req)[0].token_ids
    assert graphed.decode_graphs == "captured", graphed.decode_graphs
    assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run it with make gpu-report")
def test_kivi_steps_replay_as_a_cuda_graph_across_a_key_flush():
    # KIVI's codes are written by before_step outside the graph (decode.Decoder); the decode runs
    # past a multiple of 128, where a whole key group leaves the full-precision window
    spec = lambda graphs: OptimizationSpec(engine="reference", weights="fp16", kv_cache="kivi-2",  # noqa: E731
                                           engine_options={"device": "cuda", "cuda_graphs": graphs})
    eager = ReferenceEngine(TARGET, spec(False))
    prompt = "os.path.join(a, *p)\n\nJoin two or more pathname components, inserting '/' as needed. " * 4
    n_prompt = len(eager.tokenizer(prompt)["input_ids"])
    new = 128 - n_prompt % 128 + 6
    req = [GenerationRequest("g", prompt, max_new_tokens=new)]
    graphed = ReferenceEngine(TARGET, spec(True))
    want = eager.generate(req)[0].token_ids
    got = graphed.generate(req)[0].token_ids
    assert graphed.decode_graphs == "captured", graphed.decode_graphs
    assert len(got) == new and got == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run it with make gpu-report")
@pytest.mark.parametrize("kv_cache", ["fp16", "turbo-3", "kivi-2"])
def test_one_captured_step_serves_every_request_of_its_bucket(kv_cache):
    # the engine keeps the decode loop (its cache and graph, one shared memory pool) per batch
    # bucket: requests alternate between two buckets (A, B, A), and padded pairs reuse their own
    spec = lambda graphs: OptimizationSpec(engine="reference", weights="fp16", kv_cache=kv_cache,  # noqa: E731
                                           engine_options={"device": "cuda", "cuda_graphs": graphs})
    no_eos = ((0, -100.0),)
    a = GenerationRequest("a", "os.path.join(a, *p)\n\nJoin two or more pathname components, inserting",
                          max_new_tokens=150, logit_bias=no_eos)
    b = GenerationRequest("b", "json.dumps(obj)\n\nSerialize", max_new_tokens=40, logit_bias=no_eos)
    a2 = GenerationRequest("a2", "json.dumps(obj)\n\nSerialize", max_new_tokens=140, logit_bias=no_eos)
    pair = [GenerationRequest("p1", "import os", max_new_tokens=30),
            GenerationRequest("p2", "Return the absolute value of the argument.", max_new_tokens=30)]
    batches = [[a], [b], [a2], pair, pair[::-1]]  # buckets (1, 256), (1, 128), (1, 256), (2, 128, padded) twice
    eager = ReferenceEngine(TARGET, spec(False))
    graphed = ReferenceEngine(TARGET, spec(True))
    assert graphed.reuse_decoders and not eager.reuse_decoders
    reasons = []
    for batch in batches:
        eager.concurrency = graphed.concurrency = len(batch)
        want = [g.token_ids for g in eager.generate(batch)]
        got = [g.token_ids for g in graphed.generate(batch)]
        assert got == want, [r.request_id for r in batch]
        reasons.append(graphed.decode_graphs)
    assert reasons[:3] == ["captured"] * 3, reasons
    # KIVI's padded steps cannot be captured (its groups re-encode on the host): that bucket is not
    # kept, so its second pair gets a loop of its own
    padded_captured = kv_cache != "kivi-2"
    assert (reasons[3] == "captured") == padded_captured, reasons
    assert (graphed.decoders_built, graphed.batches_decoded) == (3 if padded_captured else 4, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run it with make gpu-report")
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_the_speculative_verify_pass_replays_as_a_cuda_graph(method):
    # speculative_verify.StaticVerify: one width (k + 1) per request, captured once, replayed per verification
    speculative = ({"method": "ngram", "k": 4, "prompt_lookup_max": 3} if method == "ngram"
                   else {"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 3})
    spec = lambda graphs: OptimizationSpec.model_validate(  # noqa: E731
        {"engine": "reference", "weights": "fp16", "speculative": speculative,
         "engine_options": {"device": "cuda", "cuda_graphs": graphs}})
    req = [GenerationRequest("g", "os.path.join(a, *p)\n\nJoin two or more pathname components", max_new_tokens=48)]
    eager, graphed = ReferenceEngine(TARGET, spec(False)), ReferenceEngine(TARGET, spec(True))
    want, got = eager.generate(req)[0], graphed.generate(req)[0]
    assert graphed.verify_graphs == "captured", graphed.verify_graphs
    assert eager.verify_graphs.startswith("off")
    assert (got.token_ids, got.spec) == (want.token_ids, want.spec)
