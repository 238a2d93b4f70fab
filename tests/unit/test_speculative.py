"""Speculative decoding: lossless at temperature 0, the target's distribution when sampling,
and counters with vLLM's definitions."""

import json
import math
import shutil
from dataclasses import replace

import pytest
import torch
from engines.protocol import GenerationRequest, SpeculativeStats
from engines.reference.engine import ReferenceEngine
from engines.reference.speculative import NgramProposer, SpeculativeCounters, sample_step
from engines.reference.speculative_verify import accept
from engines.spec import OptimizationSpec
from engines.zoo import ARTIFACTS, resolve_model_path
from engines.zoo.corpus import read_jsonl

TARGET = str(resolve_model_path("builtin:pydoc-target"))
PROMPTS = [" ".join(d.text.split()[:20]) for d in read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl")[:4]]


def engine(speculative=None, **kw):
    return ReferenceEngine(TARGET, OptimizationSpec.model_validate(
        {"engine": "reference", "weights": "fp32", "speculative": speculative or {"method": "off"}, **kw}))


@pytest.fixture(scope="module")
def plain_outputs():
    reqs = [GenerationRequest(str(i), p, max_new_tokens=24) for i, p in enumerate(PROMPTS)]
    return reqs, [g.token_ids for g in engine().generate(reqs)]


@pytest.mark.parametrize("speculative", [
    {"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 1},
    {"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 3},
    {"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 6},
    {"method": "ngram", "k": 2, "prompt_lookup_max": 3},
    {"method": "ngram", "k": 5, "prompt_lookup_max": 2},
])
def test_greedy_speculative_equals_plain_decoding(plain_outputs, speculative):
    reqs, expected = plain_outputs
    got = engine(speculative).generate(reqs)
    assert [g.token_ids for g in got] == expected  # token for token
    stats = [g.spec for g in got]
    assert sum(s.num_draft_tokens for s in stats) > 0
    for s in stats:
        assert 0 <= s.num_accepted_tokens <= s.num_draft_tokens
        assert sum(s.accepted_per_position) == s.num_accepted_tokens


def test_rejection_sampling_reproduces_the_target_distribution():
    # Small vocabulary: p is the target, q a quite different draft. Draw x ~ q, run the accept /
    # residual rule, and test the emitted tokens against p with a chi-square test (df = 3).
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    draws = torch.multinomial(q, n, replacement=True, generator=gen).tolist()
    counts = torch.zeros(4)
    accepted = 0
    for x in draws:
        ok, t = sample_step(p, q, x, gen)
        counts[t] += 1
        accepted += ok
    chi2 = (((counts - n * p) ** 2) / (n * p)).sum().item()
    assert chi2 < 16.27  # the 0.999 quantile of χ²(3): a wrong rule fails by hundreds
    # acceptance probability Σ min(p, q) = 0.1 + 0.2 + 0.2 + 0.1 = 0.6
    assert abs(accepted / n - 0.6) < 0.015


def test_sampling_mode_runs_and_is_seeded():
    e = engine({"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 3})
    req = GenerationRequest("s", PROMPTS[0], max_new_tokens=16, temperature=0.8, seed=5)
    a, b = e.generate([req])[0], e.generate([req])[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) >= 1


def test_counters_by_hand():
    c = SpeculativeCounters()
    c.record(4, 2, 4)  # 4 drafted, first 2 accepted
    c.record(4, 4, 4)
    c.record(3, 0, 4)
    c.record(0, 0, 4)  # no proposal: not a draft
    s = SpeculativeStats(c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, tuple(c.accepted_per_position))
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 11, 6)
    assert s.accepted_per_position == (2, 2, 1, 1)
    assert s.acceptance_rate == pytest.approx(6 / 11)
    assert s.mean_acceptance_length == pytest.approx(1 + 6 / 3)


def test_one_verification_step_by_hand():
    # 10 tokens, EOS 3; the target's argmax after each draft prefix: 4, 3, 6, then the bonus 8
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([4, 3, 6, 8]):
        logits[i, t] = 5.0
    gen = torch.Generator().manual_seed(0)
    req = GenerationRequest("r", "", max_new_tokens=10, logprobs=0)
    c = SpeculativeCounters()
    step = accept(logits, [4, 3, 6], None, req, [1, 2], gen, c, 4, eos=3)
    # all three drafts match, so 4, 3, 6 and the bonus 8 come out, cut after the EOS
    assert step.tokens == [4, 3]
    assert step.step == SpeculativeStats(1, 3, 3, (1, 1, 1, 0))
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (1, 3, 3)
    # log p of a logit 5 among nine at -5: -log(1 + 9 e^-10)
    assert [lp for lp, _ in step.scored] == pytest.approx([-math.log1p(9 * math.exp(-10))] * 2, abs=1e-6)  # float32 log_softmax
    # the second draft rejected (the target says 9): the correction ends the step
    logits[1] = -5.0
    logits[1, 9] = 5.0
    step = accept(logits, [4, 3, 6], None, req, [1, 2], gen, SpeculativeCounters(), 4, eos=3)
    assert step.tokens == [4, 9] and step.step == SpeculativeStats(1, 3, 1, (1, 0, 0, 0))
    # two tokens left of max_new_tokens: the accepted tokens are cut to them
    assert accept(logits, [4], None, replace(req, max_new_tokens=3), [1, 2], gen, SpeculativeCounters(), 4, 3).tokens == [4]
    # nothing drafted: a plain step, no counts
    step = accept(logits[:1], [], None, req, [1, 2], gen, c, 4, eos=3)
    assert step.tokens == [4] and step.step is None and c.num_drafts == 1


def test_ngram_lookup_by_hand():
    prop = NgramProposer(k=3, n_max=2, n_min=1)
    # the last two tokens (7, 8) occurred earlier, followed by 9, 1, 7
    assert prop.propose([7, 8, 9, 1, 7, 8], 0.0, None) == ([9, 1, 7], None)
    assert prop.propose([1, 2, 3], 0.0, None) == ([], None)


def test_draft_with_another_tokenizer_is_refused(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(resolve_model_path("builtin:pydoc-draft"), draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {f"x{v}": v for v in tok["model"]["vocab"].values()}
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"speculative.draft_model: .* different tokenizer"):
        engine({"method": "draft", "draft_model": str(draft), "k": 2})
    # and at config validation, before any engine loads
    from app.services import check_config_fits_model

    with pytest.raises(ValueError, match=r"configs\[1\]\.speculative.draft_model: .* different tokenizer"):
        check_config_fits_model({"speculative": {"method": "draft", "draft_model": str(draft)}}, "builtin:pydoc-target", "configs[1]")


@pytest.mark.integration
def test_speculative_sampling_end_to_end_matches_plain_sampling_with_a_forced_proposer():
    # Through the engine's own verification loop, on the real target: a forced proposer (a test
    # instrument) always drafts the same token T with q one-hot on T. The rule must accept T with
    # probability p(T) and otherwise sample the residual, so token 2 keeps the target's law; a
    # broken rule (always accept, or never resample) piles token 2 onto T. Two-sample χ² against
    # plain sampling, 300 seeded draws each.
    from collections import Counter

    class ForcedProposer:  # the proposers' interface (speculative.NgramProposer)
        k = 1

        def fresh(self):
            return self

        def reset(self, total_slots):
            pass

        def propose(self, seq, temperature, gen):
            return [T], None

        def accept(self, seq_len):
            pass

    plain = engine()
    spec = engine({"method": "ngram", "k": 1})
    spec.proposer = ForcedProposer()
    prompt = "Return the"
    T = plain.tokenizer(" value", add_special_tokens=False)["input_ids"][0]
    n = 300
    reqs = [GenerationRequest(str(s), prompt, max_new_tokens=3, temperature=1.0, seed=s) for s in range(n)]
    a = Counter(g.token_ids[1] for g in plain.generate(reqs))
    b = Counter(g.token_ids[1] for g in spec.generate(reqs))
    assert b[T] < n / 2  # T is one plausible token among many, not the answer every time
    common = [t for t, _ in (a + b).most_common(8)]
    bins_a = [a[t] for t in common] + [n - sum(a[t] for t in common)]
    bins_b = [b[t] for t in common] + [n - sum(b[t] for t in common)]
    chi2 = sum((x - y) ** 2 / (x + y) for x, y in zip(bins_a, bins_b, strict=False) if x + y)  # equal sample sizes
    assert chi2 < 27.88  # 0.999 quantile of χ²(8)


@pytest.mark.integration  # four engine loads and decodes each way: about 25 s of the quick tier's 240
@pytest.mark.parametrize(("speculative", "kv"), [
    ({"method": "ngram", "k": 4, "prompt_lookup_max": 3}, "fp32"),
    ({"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 3}, "fp32"),
    ({"method": "ngram", "k": 3, "prompt_lookup_max": 2}, "turbo-3"),
    ({"method": "ngram", "k": 3, "prompt_lookup_max": 2}, "fp8"),
])
def test_a_static_verify_pass_gives_what_the_eager_one_gives(speculative, kv):
    # CUDA's verify pass (speculative_verify.StaticVerify, captured there) at one width, fewer drafts
    # padded, switched on here by hand: the same tokens, counters and log-probs, greedy and sampled
    reqs = [GenerationRequest(str(i), p, max_new_tokens=40, logprobs=0, temperature=t, seed=i)
            for i, p in enumerate(PROMPTS) for t in (0.0, 0.8)]
    eager, static = engine(speculative, kv_cache=kv), engine(speculative, kv_cache=kv)
    static.static_verify = True
    want, got = eager.generate(reqs), static.generate(reqs)
    assert static.verify_graphs == "CUDA graphs need a CUDA device"  # the static pass ran, uncaptured
    assert eager.verify_graphs.startswith("off")
    for w, g in zip(want, got, strict=True):
        assert (g.token_ids, g.spec) == (w.token_ids, w.spec)
        assert max(abs(a - b) for (a, _), (b, _) in zip(g.token_logprobs, w.token_logprobs, strict=True)) < 1e-4
    assert sum(g.spec.num_draft_tokens for g in got) > sum(g.spec.num_drafts for g in got)  # drafts of several tokens
    assert any(g.spec.num_accepted_tokens < g.spec.num_draft_tokens for g in got)  # rejections: padded re-writes


def test_kivi_verifies_at_the_drafts_width_even_where_static_passes_are_on():
    # KIVI re-encodes whole token groups: padded drafts would move its group boundaries
    e = engine({"method": "ngram", "k": 3}, kv_cache="kivi-2")
    e.static_verify = True
    e.generate([GenerationRequest("0", PROMPTS[0], max_new_tokens=8)])
    assert e.verify_graphs.startswith("off")
