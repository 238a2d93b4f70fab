"""Canary drills (engine_options.fault, engines/reference/faults.py) on the real tiny model: each
fault does exactly what it says, of exactly its size, and a config without one is unchanged."""

import math

import pytest
import torch
from app.config_file import ConfigFileError, parse_config
from engines.protocol import GenerationRequest, RollingRequest, WindowSpec
from engines.reference.engine import ReferenceEngine
from engines.reference.faults import CorruptedKV
from engines.spec import ConfigNotAvailable, OptimizationSpec
from engines.zoo import resolve_model_path

TARGET = str(resolve_model_path("builtin:pydoc-target"))
TEXT = "json.dumps()\n\nSerialize obj to a JSON formatted str using this conversion table. " * 2
DOC = [RollingRequest("doc", TEXT, WindowSpec(64, 64))]
PROMPT = GenerationRequest("p0", "os.path.join(a, *p)\n\nJoin two or more", max_new_tokens=12)


def engine(fault=None, **kw) -> ReferenceEngine:
    options = {"device": "cpu", **({"fault": fault} if fault is not None else {})}
    return ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", engine_options=options, **kw))


@pytest.fixture(scope="module")
def clean():
    e = engine()
    return e, e.loglikelihood_rolling(DOC)[0], e.generate([PROMPT])[0]


def test_no_fault_is_no_hook(clean):
    e, _, _ = clean
    assert e.fault.fault is None and not isinstance(e.kv, CorruptedKV)
    assert not any("canary drill" in note for note in e.describe().notes)


def test_logprob_shift_lowers_every_prompt_logprob_by_s(clean):
    _, doc, generation = clean
    s = 0.25
    shifted = engine({"kind": "logprob-shift", "nats": s})
    got = shifted.loglikelihood_rolling(DOC)[0]
    # every token: log p − s, so NLL + s × tokens and a perplexity ratio of exactly e^s
    assert got.logprobs == tuple(x - s for x in doc.logprobs)
    n = len(doc.token_ids)
    assert got.nll == pytest.approx(doc.nll + s * n, abs=1e-9)
    assert math.exp((got.nll - doc.nll) / n) == pytest.approx(math.exp(s), abs=1e-12)
    ids = [shifted.start_id, *doc.token_ids[:10]]
    assert shifted.prompt_logprobs(ids).logprobs == pytest.approx([x - s for x in doc.logprobs[:10]], abs=1e-5)
    assert shifted.generate([PROMPT])[0].token_ids == generation.token_ids  # generation untouched
    assert any("canary drill: fault logprob-shift (nats=0.25)" in note for note in shifted.describe().notes)


def test_kv_corrupt_on_k_layers_changes_logprobs_and_k0_changes_nothing(clean):
    _, doc, generation = clean
    none = engine({"kind": "kv-corrupt", "layers": 0})
    assert none.loglikelihood_rolling(DOC)[0].logprobs == doc.logprobs
    assert none.generate([PROMPT])[0].token_ids == generation.token_ids
    two = engine({"kind": "kv-corrupt", "layers": 2, "sigma": 1.0})
    got = two.loglikelihood_rolling(DOC)[0]
    assert got.nll - doc.nll > 1.0  # nats over the document: well beyond float noise
    # the store, by hand: a layer below k holds encode(k) + σ·std(k)·z at each written slot, the others encode(k)
    cache = two.new_cache(1, 3)
    a = two.args
    k = torch.arange(1 * a.n_kv_heads * 3 * a.head_dim, dtype=torch.float32).reshape(1, a.n_kv_heads, 3, a.head_dim)
    v = -k
    slots = torch.tensor([0, 1, 2])
    for layer in (0, 1, 2):
        cache.store.write(layer, k, v, slots, cache.seq_start)
    z = two.kv.noise  # [k layers, (k, v), Hkv, context, D]
    for layer in (0, 1):
        assert torch.allclose(cache.store.kq[layer], k + 1.0 * k.std() * z[layer, 0, :, :3], atol=1e-4)
        assert torch.allclose(cache.store.vq[layer], v + 1.0 * v.std() * z[layer, 1, :, :3], atol=1e-4)
    assert torch.equal(cache.store.kq[2], k) and torch.equal(cache.store.vq[2], v)


def test_kv_corrupt_layers_beyond_the_model_are_refused():
    with pytest.raises(ValueError, match=r"engine_options.fault.layers: 9 exceeds this model's 6 layers"):
        engine({"kind": "kv-corrupt", "layers": 9})
    with pytest.raises(ValueError, match=r"engine_options.fault.from_slot: 1024 is past this model's context of 1024 "
                                         r"slots; use 0 to 1023"):
        engine({"kind": "kv-corrupt", "layers": 1, "from_slot": 1024})


def test_token_corrupt_p0_leaves_outputs_and_p1_replaces_every_token(clean):
    _, _, generation = clean
    assert engine({"kind": "token-corrupt", "rate": 0.0}).generate([PROMPT])[0].token_ids == generation.token_ids
    every = engine({"kind": "token-corrupt", "rate": 1.0, "seed": 3})
    streamed: list[int] = []
    got = every.generate([PROMPT], on_tokens=lambda rid, ids, spec: streamed.extend(ids))[0]
    assert len(got.token_ids) == len(generation.token_ids)
    assert all(a != b for a, b in zip(got.token_ids, generation.token_ids, strict=True))
    assert got.text == every.tokenizer.decode(list(got.token_ids), skip_special_tokens=True)
    assert streamed == list(got.token_ids)  # the stream carries the ids as emitted
    assert every.generate([PROMPT])[0].token_ids == got.token_ids  # seeded per (seed, request, position)
    assert every.loglikelihood_rolling(DOC)[0].logprobs == clean[1].logprobs  # scoring untouched


def test_ttft_delay_adds_at_least_d_ms(clean):
    delayed = engine({"kind": "ttft-delay", "delay_ms": 60})
    got = delayed.generate([PROMPT])[0]
    assert got.ttft_ms >= 60 and got.total_ms >= 60
    assert got.token_ids == clean[2].token_ids


def test_weight_noise_has_sigma_times_each_matrix_std(clean):
    e, doc, _ = clean
    sigma = 0.05
    noised = engine({"kind": "weight-noise", "sigma": sigma, "seed": 1})
    qkv_clean = e.model.model.layers[0].self_attn.qkv_proj.weight
    qkv_noised = noised.model.model.layers[0].self_attn.qkv_proj.weight
    rows = e.args.n_heads * e.args.head_dim  # q_proj's rows of the fused q, k, v weight
    q, dq = qkv_clean[:rows], qkv_noised[:rows] - qkv_clean[:rows]
    assert (dq.std() / q.std()).item() == pytest.approx(sigma, rel=0.05)  # 65k draws: within 1 %
    assert noised.loglikelihood_rolling(DOC)[0].logprobs != doc.logprobs
    zero = engine({"kind": "weight-noise", "sigma": 0.0})
    assert zero.loglikelihood_rolling(DOC)[0].logprobs == doc.logprobs


def test_a_bad_fault_is_refused_at_the_door_naming_the_field():
    with pytest.raises(ConfigNotAvailable, match=r"^engine_options.fault.kind: unknown fault 'kv-corupt'; "
                                                  r"did you mean 'kv-corrupt'\? choose one of: weight-noise"):
        OptimizationSpec(engine="reference", engine_options={"fault": {"kind": "kv-corupt"}}).check_available()
    with pytest.raises(ConfigNotAvailable, match=r"^engine_options.fault.rate: input should be less than or equal"):
        OptimizationSpec(engine="reference", engine_options={"fault": {"kind": "token-corrupt", "rate": 2}}
                         ).check_available()
    with pytest.raises(ConfigNotAvailable, match=r"engine_options.fault.kind: 'kv-corrupt' runs on a KV format"):
        OptimizationSpec(engine="reference", kv_cache="kivi-2",
                         engine_options={"fault": {"kind": "kv-corrupt", "layers": 1}}).check_available()
    with pytest.raises(ConfigNotAvailable, match=r"engine_options.fault: unknown option for engine 'openai'"):
        OptimizationSpec(engine="openai", engine_options={"base_url": "http://x/v1", "fault": {}}).check_available()
    config = {"project": "p", "model": {"name": "m", "path": "builtin:pydoc-target"},
              "configs": [{"name": "base", "baseline": True, "engine": "reference", "weights": "fp32"},
                          {"name": "drill", "engine": "reference", "weights": "fp32",
                           "engine_options": {"fault": {"kind": "sampler-bug"}}}],
              "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout"}]}
    with pytest.raises(ConfigFileError, match=r"configs\[1\]\.engine_options\.fault\.kind: unknown fault 'sampler-"):
        parse_config(config)


def test_a_kv_fault_from_slot_n_shows_only_in_the_position_buckets_past_n():
    """kv-corrupt from slot 128 on 256-token windows: the tokens predicted from slots 0–127 read
    only clean slots (their log-probs equal the fault-free lossy pass's), those from 128–255 read
    noise; ppl_ratio_by_position (evals/compare.py) flags 128–255 and leaves 0–127 at 1.0."""
    from evals.compare import ppl_ratio_by_position
    from evals.positions import position_nll, token_positions
    from evals.records import DocRecord
    from evals.stats import Thresholds

    window = WindowSpec(256, 256)
    text = " ".join(["Serialize obj to a JSON formatted str using this conversion table, as json.dumps does."] * 40)
    docs = [RollingRequest(f"d{i}", f"{i} " + text, window) for i in range(4)]
    fault = {"kind": "kv-corrupt", "layers": 6, "sigma": 2.0, "from_slot": 128}
    clean_lossy = engine({"kind": "kv-corrupt", "layers": 6, "sigma": 2.0, "from_slot": 1000})  # past every window: no noise
    base, bad = clean_lossy.loglikelihood_rolling(docs), engine(fault).loglikelihood_rolling(docs)
    for b, c in zip(base, bad, strict=True):
        assert len(b.token_ids) > 512  # several windows, each with both buckets
        pos = token_positions(len(b.token_ids), window)
        early = [i for i, p in enumerate(pos) if p < 128]
        assert [c.logprobs[i] for i in early] == [b.logprobs[i] for i in early]
        assert sum(c.logprobs) < sum(b.logprobs) - 1.0
    records = lambda results: {r.doc_id: DocRecord.from_result(r, None, False, None, position_nll(r.logprobs, window))  # noqa: E731
                               for r in results}
    rows = ppl_ratio_by_position(records(bad), records(base), Thresholds(1.02, 1.05, "above", min_n=4))
    assert [(r["positions"], r["n"]) for r in rows] == [("0–127", 4), ("128–255", 4)]
    assert rows[0]["estimate"] == 1.0 and rows[0]["verdict"] == "ok"
    assert rows[1]["estimate"] > 1.05 and rows[1]["ci_low"] > 1.05 and rows[1]["verdict"] == "critical"


@pytest.mark.integration  # slow for the quick tier's budget: the whole suite runs it
def test_a_kv_fault_late_in_the_answers_shows_only_in_gen_nll_ratio_s_late_buckets():
    """kv-corrupt from 16 slots past the longest prompt: every answer's first 16 tokens are
    predicted from clean slots, the rest read noise. Scored by the clean model as a run scores
    them (workers/generation.BaselineScorer), gen_nll_ratio's bucket of answer tokens 0–15 is the
    baseline's and ok, the later ones critical (e.g. ×10 on this model)."""
    from dataclasses import replace

    from evals.compare_targets import CompareContext, gen_nll_ratio
    from evals.records import ConfigRecords, GenerationRecord
    from evals.stats import Thresholds
    from workers.generation import BaselineScorer

    names = ["json.dumps", "os.path.join", "re.compile", "shutil.copy", "time.sleep", "math.floor", "glob.glob",
             "csv.reader", "copy.deepcopy", "random.choice"]
    prompts = {f"p{i}": f"{name}()\n\n" for i, name in enumerate(names)}
    requests = [GenerationRequest(k, p, max_new_tokens=48) for k, p in prompts.items()]
    fault = {"kind": "kv-corrupt", "layers": 6, "sigma": 2.0}
    clean = engine({**fault, "from_slot": 1000})  # the same lossy cache, past every slot: no noise
    base = clean.generate(requests)
    longest = max(g.prompt_tokens for g in base)
    mine = engine({**fault, "from_slot": longest + 16}).generate(requests)
    judge = BaselineScorer(clean)

    def records(generations) -> ConfigRecords:
        rows = {g.request_id: replace(GenerationRecord.from_result(g, prompts[g.request_id], False), baseline_nll=nll,
                                      baseline_nll_tokens=n, scored=read)
                for g, (nll, n, read) in zip(generations, judge.score(generations, prompts, WindowSpec(256, 256)),
                                             strict=True)}
        return replace(ConfigRecords.empty(), generations=rows)

    c = gen_nll_ratio(CompareContext(mine=records(mine), base=records(base), thresholds=Thresholds.seed))
    assert c is not None and c.estimate is not None
    rows = {b["positions"]: b for b in c.details["by_position"]}
    assert list(rows) == ["0–15", "16–63"] and rows["0–15"]["n"] == 10
    assert rows["0–15"]["verdict"] == "ok"
    assert rows["16–63"]["ci_low"] > 1.3 and rows["16–63"]["verdict"] == "critical"
    assert rows["0–15"]["estimate"] == pytest.approx(1.0, abs=1e-9)  # the same tokens: clean slots, same answers
