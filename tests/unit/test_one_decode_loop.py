"""One decode loop for both front ends (engines/reference/batching.py): the engine's own
generate() and engine-serve's engine thread drive the same scheduler, so a request gets the same
tokens, log-probs (1e-4) and speculative acceptance counts from either, whichever KV format,
speculative method and concurrency, in fp32 on the tiny built-in model. engine-serve here is its
real engine thread (workers/engine_server/engine_thread.EngineServer) fed from an event loop, as
its routes feed it; requests join and leave its batch between steps."""

from __future__ import annotations

import asyncio

import pytest
from engines.protocol import GenerationRequest, GenerationResult
from engines.reference.batching import ContinuousBatch
from engines.reference.engine import ReferenceEngine
from engines.reference.rows import SpeculativeRows, WaveRows
from engines.spec import OptimizationSpec
from engines.zoo import ARTIFACTS, resolve_model_path
from engines.zoo.corpus import read_jsonl
from workers.engine_server.engine_thread import EngineServer

TARGET = str(resolve_model_path("builtin:pydoc-target"))
EOS = 0
NO_EOS = ((EOS, -100.0),)  # greedy to max_new_tokens (an adjusted pick)
# log-probs agree to 1e-4 but for one case: a verify pass of 4 rows multiplies the weights for
# every row at once, which rounds otherwise than one row alone; over an fp16 cache with n-gram
# drafts, one log-prob of 36 differed by 1.05e-4 (tokens and acceptance counts equal)
TOL = 2e-4
SPECULATIVE = {"off": {"method": "off"}, "ngram": {"method": "ngram", "k": 4},
               "draft": {"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 3}}


def engine_for(kv: str, speculative: str, concurrency: int) -> ReferenceEngine:
    return ReferenceEngine(TARGET, OptimizationSpec(
        engine="reference", weights="fp32", kv_cache=kv, speculative=SPECULATIVE[speculative],
        engine_options={"device": "cpu", "concurrency": concurrency}))


def requests() -> list[GenerationRequest]:
    """Prompts of different lengths with answers of different lengths: four plain greedy ones, two
    made to end at an EOS (a logit bias), and a sampled one with its own seed."""
    texts = [" ".join(d.text.split()[:w]) for d, w in zip(read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl")[:4],
                                                          (24, 8, 40, 16), strict=True)]
    # plain greedy: a wave (or an engine-serve step) of these alone feeds its picks back on the device
    out = [GenerationRequest(f"r{i}", t, max_new_tokens=n, logprobs=1)
           for i, (t, n) in enumerate(zip(texts, (20, 36, 12, 28), strict=True))]
    # EOS made likelier: one stops after a few tokens (5 in fp32), one at its first (a row of a wave
    # done at its prefill, stepped with the wave unread)
    text = " ".join(read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl")[3].text.split()[:24])
    out.append(GenerationRequest("eos", text, max_new_tokens=24, logit_bias=((EOS, 3.0),), logprobs=0))
    out.append(GenerationRequest("first", texts[0], max_new_tokens=24, logit_bias=((EOS, 8.0),), logprobs=0))
    out.append(GenerationRequest("sampled", "def parse(text):", max_new_tokens=20, temperature=0.8, seed=5,
                                 logprobs=0))
    return out


async def served(engine: ReferenceEngine, reqs: list[GenerationRequest], rows: int) -> dict[str, GenerationResult]:
    """The requests through engine-serve's engine thread with `rows` rows, all submitted at once
    (each its own request, as concurrent clients send them)."""
    server = EngineServer(engine, "pydoc-target", max_num_seqs=rows)
    try:
        jobs = [server.submit_all([r], stream=False)[0] for r in reqs]
        out = {}
        for job in jobs:
            while True:
                kind, payload = await asyncio.wait_for(job.events.get(), 120)
                assert kind not in ("invalid", "error"), payload
                if kind == "done":
                    out[job.request.request_id] = payload
                    break
        return out
    finally:
        server.request_stop()
        server.thread.join(10)


@pytest.mark.integration  # 18 cases, 1 to 10 s of model work each
@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("speculative", ["off", "ngram", "draft"])
@pytest.mark.parametrize("kv", ["fp16", "kivi-2", "turbo-3"])
def test_generate_and_engine_serve_give_the_same_tokens_log_probs_and_acceptance(kv, speculative, concurrency):
    engine = engine_for(kv, speculative, 1 if speculative != "off" else concurrency)
    reqs = requests()
    streamed: dict[str, list[int]] = {}
    alone = {g.request_id: g for g in engine.generate(
        reqs, on_tokens=lambda rid, ids, _step: streamed.setdefault(rid, []).extend(ids))}
    together = asyncio.run(served(engine, reqs, concurrency))
    for r in reqs:
        a, b = alone[r.request_id], together[r.request_id]
        assert a.token_ids == b.token_ids, r.request_id
        assert streamed[r.request_id] == list(a.token_ids)  # generate() streamed every token once, in order
        assert [lp for lp, _ in b.token_logprobs] == pytest.approx([lp for lp, _ in a.token_logprobs], abs=TOL)
        for (_, top_a), (_, top_b) in zip(a.token_logprobs, b.token_logprobs, strict=True):  # the alternatives
            assert [t for t, _ in top_b] == [t for t, _ in top_a]
            assert [lp for _, lp in top_b] == pytest.approx([lp for _, lp in top_a], abs=TOL)
        assert a.spec == b.spec and a.finish_reason == b.finish_reason
    assert alone["first"].finish_reason == "stop" and len(alone["first"].token_ids) == 1
    if kv == "fp16" and speculative == "off":
        assert alone["eos"].finish_reason == "stop" and 1 < len(alone["eos"].token_ids) < 24
    if speculative != "off":
        assert sum(g.spec.num_accepted_tokens for g in alone.values() if g.spec) > 0  # drafts were accepted


def test_generate_runs_a_wave_of_concurrency_requests_through_the_scheduler():
    """generate() admits `concurrency` requests at once as one wave (a static batch, left-padded),
    steps the loop until the batch is empty, and then admits the next wave; every row's prompt and
    decode steps count in the engine's kv_cache_usage, worked by hand."""
    engine = engine_for("fp32", "off", 2)
    batch = ContinuousBatch(engine, 2, waves=True)
    assert isinstance(batch.cache, WaveRows)
    a = GenerationRequest("a", "import os", max_new_tokens=3, logit_bias=NO_EOS)
    b = GenerationRequest("b", "def parse(text): return", max_new_tokens=5, logit_bias=NO_EOS)
    seqs = batch.add_wave([a, b])
    pa, pb = (len(s.prompt) for s in seqs)
    assert pa < pb and batch.cache.lengths == [pa, pb] and batch.free_rows == 0
    with pytest.raises(RuntimeError, match="empty batch"):
        batch.add_wave([a])
    steps = 0
    while not all(s.done for s in seqs):
        batch.step()
        steps += 1
    assert steps == 4  # b's 5 tokens: its first from the prefill, then 4 steps (a leaves after 2)
    assert [len(s.tokens) for s in seqs] == [3, 5]
    assert batch.cache.lengths == [pa + 2, pb + 4]  # a finished row is stepped with the wave, unread and uncounted
    for s in seqs:
        batch.remove(s)
    # rows: a's prompt + b's prompt + 2 rows × 4 steps, over 2 rows of the model's context
    assert engine.usage.peak_usage == pytest.approx((pa + pb + 2 * 4) / (2 * engine.args.max_seq_len))
    assert batch.free_rows == 2 and batch.cache.decoder is None
    with pytest.raises(ValueError, match="exceed the model's context"):
        batch.add_wave([GenerationRequest("long", "x", max_new_tokens=engine.args.max_seq_len)])


def test_speculative_generate_runs_one_request_at_a_time_through_its_own_cache():
    engine = engine_for("fp32", "ngram", 1)
    batch = ContinuousBatch(engine, 1, waves=True)
    assert isinstance(batch.cache, SpeculativeRows) and batch.cache.one_request
    with pytest.raises(RuntimeError, match="waves=True and no speculative decoding"):
        batch.add_wave([GenerationRequest("a", "import os", max_new_tokens=3)])
    with pytest.raises(ValueError, match="one_request takes one row"):
        SpeculativeRows(engine, 2, one_request=True)


def test_engine_serve_fails_only_the_request_whose_prefill_step_fails(monkeypatch):
    """A prompt that joins a running batch and whose step fails (out of memory, say) gets an
    error event; the request already decoding goes on to the tokens it gets alone, and the server
    serves the next request."""
    from engines.reference.rows import RowCache

    engine = engine_for("fp32", "off", 1)
    running, after = (GenerationRequest(n, "def parse(text):", max_new_tokens=24, logit_bias=NO_EOS)
                      for n in ("running", "after"))
    failing = GenerationRequest("failing", "import os and sys " * 8, max_new_tokens=4)  # its own prompt length
    alone = engine.generate([running])[0].token_ids
    fail_at = len(engine.prompt_token_ids(failing))
    real = RowCache._attend_prompt

    def out_of_memory(self, layer, row, q, k, v):
        if k.shape[2] == fail_at:
            raise RuntimeError("out of memory (a test's)")
        return real(self, layer, row, q, k, v)

    monkeypatch.setattr(RowCache, "_attend_prompt", out_of_memory)

    async def scenario():
        server = EngineServer(engine, "pydoc-target", max_num_seqs=4)
        try:
            first = server.submit_all([running])[0]
            kind, _ = await asyncio.wait_for(first.events.get(), 60)
            assert kind == "tokens"  # decoding: the next prompt joins a running batch
            second = server.submit_all([failing])[0]
            kind, payload = await asyncio.wait_for(second.events.get(), 60)
            assert (kind, payload) == ("error", "out of memory (a test's)")
            while (event := await asyncio.wait_for(first.events.get(), 60))[0] != "done":
                assert event[0] == "tokens"
            third = server.submit_all([after], stream=False)[0]
            kind, result = await asyncio.wait_for(third.events.get(), 60)
            return event[1], kind, result
        finally:
            server.request_stop()
            server.thread.join(10)

    done, kind, result = asyncio.run(scenario())
    assert done.token_ids == alone and kind == "done" and len(result.token_ids) == 24
