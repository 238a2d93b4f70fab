"""Continuous batching (engines/reference/batching.py) with lossy KV formats: requests that join a
running batch between steps and leave it when done must pick, token for token, what each picks
alone through the engine's own generate(), in fp32 on the tiny built-in model. Each row of a
lossy format is its own Decoder (with speculative decoding, its own KVCache as generate() keeps
its one request's): its codes (KIVI's token groups, TurboQuant's rotated codes, fp8)
are written and read as a request alone writes and reads them."""

import pytest
import torch
from engines.protocol import GenerationRequest
from engines.reference.batching import ContinuousBatch, DecoderRows, SpeculativeRows, unbatchable
from engines.reference.engine import ReferenceEngine
from engines.spec import OptimizationSpec
from engines.zoo import ARTIFACTS, resolve_model_path
from engines.zoo.corpus import read_jsonl

TARGET = str(resolve_model_path("builtin:pydoc-target"))
EOS = 0
NO_EOS = ((EOS, -100.0),)  # greedy to max_new_tokens (an adjusted pick, as an API's logit_bias gives it)


def engine_for(kv: str, **options) -> ReferenceEngine:
    return ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", kv_cache=kv,
                                                    engine_options={"device": "cpu", **options}))


def requests() -> list[GenerationRequest]:
    """Five prompts of different lengths; the second runs 150 tokens, past KIVI's first key group
    of 128 slots (its codes are written at a group boundary while other rows decode beside it)."""
    texts = [" ".join(d.text.split()[:w]) for d, w in zip(read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl")[:5],
                                                          (24, 8, 40, 16, 30), strict=True)]
    lengths = (20, 150, 12, 30, 25)
    return [GenerationRequest(f"r{i}", t, max_new_tokens=n, logit_bias=NO_EOS, logprobs=0)
            for i, (t, n) in enumerate(zip(texts, lengths, strict=True))]


def batched(engine: ReferenceEngine, reqs: list[GenerationRequest], rows: int) -> dict[str, tuple]:
    """The requests through a ContinuousBatch of `rows` rows: the first `rows` join at once, each
    later one as soon as a row frees (between steps), as engine-serve schedules them. Per request:
    (token ids, log-probs, speculative counts or None)."""
    batch = ContinuousBatch(engine, rows)
    waiting, out = list(reqs), {}
    running = []
    while waiting or running:
        while waiting and batch.free_rows:
            running.append(batch.add(waiting.pop(0)))
        batch.step()
        for seq in [s for s in running if s.done]:
            result = batch.result(seq)
            out[result.request_id] = (result.token_ids, [lp for lp, _ in result.token_logprobs], result.spec)
            batch.remove(seq)
            running.remove(seq)
    assert batch.held() == 0 and batch.free_rows == rows
    return out


@pytest.mark.parametrize("kv", ["fp8", "kivi-2", "turbo-3"])
def test_a_lossy_kv_batch_picks_what_each_request_picks_alone(kv):
    engine = engine_for(kv)
    assert engine.kv.lossy and unbatchable(engine) is None
    reqs = requests()
    alone = {}
    for r in reqs:
        [g] = engine.generate([r])
        alone[r.request_id] = (g.token_ids, [lp for lp, _ in g.token_logprobs])
    together = batched(engine, reqs, rows=3)  # 3 rows for 5 requests: two join a running batch
    for r in reqs:
        ids, lps, _ = together[r.request_id]
        assert ids == alone[r.request_id][0], r.request_id
        assert len(ids) == r.max_new_tokens
        assert max(abs(a - b) for a, b in zip(lps, alone[r.request_id][1], strict=True)) < 1e-4
    # the lossy cache changes what the model picks: the batch kept each row's own codes, not fp32 keys
    lossless = engine_for("fp32")
    assert any(lossless.generate([r])[0].token_ids != alone[r.request_id][0] for r in reqs)


def test_a_lossy_format_gets_a_decoder_per_row_and_frees_it():
    engine = engine_for("kivi-2")
    batch = ContinuousBatch(engine, 2)
    assert isinstance(batch.cache, DecoderRows)
    seq = batch.add(requests()[0])
    prompt = len(seq.prompt)
    assert batch.cache.lengths == [prompt, 0] and batch.held() == prompt
    for _ in range(3):
        batch.step()
    assert batch.cache.lengths[0] == prompt + 3 and batch.held() == prompt + 3
    decoder = batch.cache.decoders[0]
    assert decoder is not None and decoder.slots == prompt + 20 and decoder.next_slot == prompt + 3
    assert batch.cache.nbytes() == decoder.cache.nbytes() > 0
    second = batch.add(requests()[2])  # a second row: the engine's peak counts both caches together
    both = batch.cache.nbytes()
    assert both > decoder.cache.nbytes() and engine.peak_kv_bytes == both
    batch.remove(second)
    batch.remove(seq)
    assert batch.cache.decoders == [None, None] and batch.held() == 0 and batch.free_rows == 2


def test_a_speculative_lossy_format_gets_a_cache_per_row_and_frees_it():
    engine = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", kv_cache="turbo-3",
                                                      speculative={"method": "ngram", "k": 4},
                                                      engine_options={"device": "cpu"}))
    batch = ContinuousBatch(engine, 2)
    assert isinstance(batch.cache, SpeculativeRows)
    seq = batch.add(requests()[0])  # max_new_tokens 20
    prompt = len(seq.prompt)
    cache = batch.cache.caches[0]
    # the cache generate() makes for its one request: prompt + max_new_tokens + k + 1 slots
    assert cache is not None and cache.k.shape[3] == prompt + 20 + 5
    assert batch.cache.lengths == [prompt, 0] and len(seq.tokens) == 1
    batch.step()
    # the row holds its prompt and every token but the newest (the next pass writes that one)
    assert batch.cache.lengths[0] == prompt + len(seq.tokens) - 1 == batch.held()
    second = batch.add(requests()[2])  # the engine's peak counts both rows' caches together
    assert engine.peak_kv_bytes == batch.cache.nbytes() > cache.nbytes()
    batch.remove(second)
    batch.remove(seq)
    assert batch.cache.caches == [None, None] and batch.held() == 0 and batch.free_rows == 2


@pytest.mark.parametrize(("speculative", "kv"), [
    ({"method": "ngram", "k": 4}, "fp32"),
    ({"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 3}, "fp32"),
    # over a lossy KV format each row is its own cache (SpeculativeRows); the 150-token request crosses
    # KIVI's first key group while other rows verify beside it
    ({"method": "ngram", "k": 4}, "kivi-2"),
    ({"method": "ngram", "k": 4}, "turbo-3"),
    ({"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 3}, "fp8"),
])
def test_a_speculative_batch_picks_and_counts_what_each_request_does_alone(speculative, kv):
    """Rows that draft different numbers of tokens (an n-gram row often none) verified in one pass,
    joining and leaving between steps: each request's tokens, log-probs and acceptance counts are
    those of the engine's generate() (one request at a time), a sampled request (its own seeded generator) included."""
    engine = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", kv_cache=kv,
                                                      speculative=speculative, engine_options={"device": "cpu"}))
    assert unbatchable(engine) is None
    # the 150-token request only where KIVI's group boundary needs it: time
    reqs = [r for i, r in enumerate(requests()) if i != 1 or kv == "kivi-2"]
    reqs.append(GenerationRequest("sampled", "def parse(text):", max_new_tokens=24, temperature=0.8, seed=5,
                                  logprobs=0))
    alone = {}
    for r in reqs:
        [g] = engine.generate([r])
        alone[r.request_id] = (g.token_ids, [lp for lp, _ in g.token_logprobs], g.spec)
    out = batched(engine, reqs, rows=3)
    for r in reqs:
        (ids, lps, spec), (b_ids, b_lps, b_spec) = alone[r.request_id], out[r.request_id]
        assert b_ids == ids and b_spec == spec, r.request_id
        assert b_lps == pytest.approx(lps, abs=1e-4)
    assert sum(s.num_drafts for _, _, s in out.values()) > 0  # drafts were verified, not only plain steps
    assert sum(s.num_accepted_tokens for _, _, s in out.values()) > 0
    if kv != "fp32":  # the rows kept their own lossy caches: the lossless engine answers otherwise
        lossless = engine_for("fp32")
        assert any(lossless.generate([r])[0].token_ids != alone[r.request_id][0] for r in reqs)


@torch.inference_mode()
def test_a_full_row_cache_is_refused_not_overrun():
    engine = engine_for("fp8")
    batch = ContinuousBatch(engine, 1)
    seq = batch.add(GenerationRequest("r", "import os", max_new_tokens=2, logit_bias=NO_EOS))
    decoder = batch.cache.decoders[0]
    batch.step()  # the second token: the row's last slot is now written
    assert seq.done and decoder.next_slot == decoder.slots - 1
    batch.cache.decode(engine.model, torch.tensor([[1]]), [0])  # the last slot, as the row allows
    with pytest.raises(ValueError, match=r"cache of \d+ slots is full"):
        batch.cache.decode(engine.model, torch.tensor([[1]]), [0])


def test_rows_that_join_are_prefilled_in_the_running_rows_decode_step_and_pick_what_they_pick_alone(monkeypatch):
    """engine-serve's admission (ContinuousBatch.join) over the lossless RowCache: a joining
    row's prompt goes through the same forward as the running rows' next tokens (one forward per
    step, no prefill pass of its own), at most MIXED_PROMPT_TOKENS prompt tokens a step (the
    oldest first, the first whatever its length), and every request's tokens and log-probs are
    those of generate() alone; a row whose client leaves before its prefill frees its row."""
    import engines.reference.batching as batching

    engine = engine_for("fp32")
    reqs = requests()
    alone = {g.request_id: g for g in (engine.generate([r])[0] for r in reqs)}
    forwards = []
    real = type(engine.model).forward
    monkeypatch.setattr(type(engine.model), "forward", lambda self, ids, *a, **k: forwards.append(ids.shape)
                        or real(self, ids, *a, **k))
    monkeypatch.setattr(batching, "MIXED_PROMPT_TOKENS", 50)  # the prompts are 15 to 65 tokens
    batch = ContinuousBatch(engine, 3)
    first = [batch.join(r) for r in (reqs[0], reqs[1], reqs[3])]
    lengths = [len(s.prompt) for s in first]
    assert not any(s.tokens for s in first) and batch.free_rows == 0 and batch.cache.lengths == [0, 0, 0]
    # the first two are over the budget together: the first goes alone, the next two a step later
    assert lengths[0] + lengths[1] > 50 >= lengths[1] + lengths[2]
    assert batch.step() == first[:1] and forwards[-1] == (1, lengths[0])
    stepped = batch.step()  # row 0's second token beside rows 1 and 2's prompts: one forward
    assert stepped == first and forwards[-1] == (1, 1 + lengths[1] + lengths[2])
    assert batch.cache.lengths == [lengths[0] + 1, lengths[1], lengths[2]]
    done: dict[str, tuple] = {}
    waiting = [reqs[2], reqs[4]]  # reqs[2]'s prompt alone is over the budget: it goes all the same
    assert len(batch.engine.prompt_token_ids(reqs[2])) > 50
    running = list(first)
    while waiting or running:
        for seq in [s for s in running if s.done]:
            result = batch.result(seq)
            done[result.request_id] = (result.token_ids, [lp for lp, _ in result.token_logprobs])
            batch.remove(seq)
            running.remove(seq)
        while waiting and batch.free_rows:  # later requests join rows that are decoding
            running.append(batch.join(waiting.pop(0)))
        n = len(forwards)
        batch.step()
        assert len(forwards) <= n + 1
    for r in reqs:
        ids, lps = done[r.request_id]
        assert ids == alone[r.request_id].token_ids, r.request_id
        assert lps == pytest.approx([lp for lp, _ in alone[r.request_id].token_logprobs], abs=1e-4)
    # a row whose client leaves before its prefill: its row is free, and no step prefills it
    left = batch.join(reqs[0])
    batch.remove(left)
    assert batch.step() == [] and batch.free_rows == 3 and batch.held() == 0


def test_a_failed_prefill_step_fails_only_the_joining_rows_and_the_running_rows_go_on(monkeypatch):
    """A step that prefills joining prompts and fails (a long prompt out of memory, say) raises
    PrefillFailed naming those rows, frees their rows, and leaves the running rows as before the
    step: their next steps give what they give alone."""
    from engines.reference.batching import PrefillFailed
    from engines.reference.rows import RowCache

    engine = engine_for("fp32")
    reqs = requests()
    alone = engine.generate([reqs[0]])[0].token_ids
    batch = ContinuousBatch(engine, 3)
    running = batch.join(reqs[0])
    batch.step()
    batch.step()
    held = list(batch.cache.lengths)
    joiner = batch.join(reqs[2])
    real = RowCache._attend_prompt

    def out_of_memory(self, layer, row, q, k, v):
        if layer == 3:
            raise RuntimeError("out of memory (a test's)")
        return real(self, layer, row, q, k, v)

    monkeypatch.setattr(RowCache, "_attend_prompt", out_of_memory)
    with pytest.raises(PrefillFailed, match="out of memory") as failed:
        batch.step()
    assert failed.value.seqs == [joiner]
    assert batch.cache.lengths == held and batch.free_rows == 2 and len(running.tokens) == 2
    monkeypatch.setattr(RowCache, "_attend_prompt", real)
    while not running.done:
        batch.step()
    assert tuple(running.tokens) == alone
