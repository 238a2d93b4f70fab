"""Qwen3 (per-head query and key norms) and Qwen3-MoE (a router over experts) checkpoints through
the reference engine as a config runs them: greedy tokens and perplexity against transformers'
own model in fp32, every KV format, and speculative decoding (n-gram and a draft model) lossless
against plain greedy decoding.

The checkpoints are tiny and random, written by transformers itself (no hub), with the zoo's
tokenizer (4096 tokens) so that prompts and documents are real text."""

import math
import shutil

import pytest
import torch
from engines.protocol import GenerationRequest, RollingRequest, WindowSpec
from engines.reference.engine import ReferenceEngine
from engines.spec import KV_CACHE, OptimizationSpec
from engines.zoo import resolve_model_path

PROMPTS = ["os.path.join(a, *p)\n\nJoin one or more path", "Return the absolute value of the argument.",
           "json.dumps(obj)\n\nSerialize obj to a JSON formatted str"]
DOCUMENT = ("collections.OrderedDict\n\nDictionary that remembers insertion order. The popitem() method "
            "returns and removes a (key, value) pair; pairs are returned in LIFO order if last is true.")
NEW = 12


def _checkpoint(path, family):
    """(path, transformers' model): 2 layers, random norms (a skipped one would show) and router."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True))
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
            elif "embed" in name:
                p.mul_(8.0)  # confident next-token choices: a greedy path not decided by float rounding
    model.save_pretrained(path)
    zoo = resolve_model_path("builtin:pydoc-target")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(zoo / name, path / name)
    return path, model


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def qwen3(request, tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}", request.param)


def _engine(path, **spec):
    return ReferenceEngine(str(path), OptimizationSpec(engine="reference", **{"weights": "fp32", **spec}))


def _greedy(engine):
    return [r.token_ids for r in engine.generate([GenerationRequest(f"p{i}", p, NEW) for i, p in enumerate(PROMPTS)])]


@pytest.fixture(scope="module")
def plain(qwen3):
    return _engine(qwen3[0])


def test_greedy_tokens_and_perplexity_equal_transformers_qwen3(qwen3, plain):
    _, ref = qwen3
    assert plain.model.args.qk_norm
    assert bool(plain.model.args.sparse_layers) == (plain.model.args.model_type == "qwen3_moe")
    for prompt, got in zip(PROMPTS, _greedy(plain), strict=True):
        ids = [plain.start_id] + plain.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        assert list(got) == out[0, len(ids):].tolist()
    [doc] = plain.loglikelihood_rolling([RollingRequest("d", DOCUMENT, WindowSpec(max_length=512))])
    ids = torch.tensor([[plain.start_id, *doc.token_ids]])
    with torch.no_grad():
        logp = torch.log_softmax(ref(ids).logits[0, :-1].double(), -1)
    expected = logp[torch.arange(len(doc.token_ids)), ids[0, 1:]]
    assert torch.allclose(torch.tensor(doc.logprobs, dtype=torch.float64), expected, atol=1e-4), \
        (torch.tensor(doc.logprobs, dtype=torch.float64) - expected).abs().max()


@pytest.mark.parametrize("kv", KV_CACHE)
def test_every_kv_format_runs_a_qwen3_checkpoint(qwen3, plain, kv):
    engine = _engine(qwen3[0], kv_cache=kv)
    tokens = _greedy(engine)
    assert all(len(t) == NEW for t in tokens)
    [doc] = engine.loglikelihood_rolling([RollingRequest("d", DOCUMENT, WindowSpec(max_length=512))])
    [base] = plain.loglikelihood_rolling([RollingRequest("d", DOCUMENT, WindowSpec(max_length=512))])
    assert doc.token_ids == base.token_ids and all(math.isfinite(x) for x in doc.logprobs)
    if kv in ("auto", "fp32"):  # lossless in fp32: the same tokens and log-probs
        assert tokens == _greedy(plain)
        assert max(abs(a - b) for a, b in zip(doc.logprobs, base.logprobs, strict=True)) < 1e-5


def test_fractional_turbo_picks_the_key_channels_qwen3s_key_norm_makes_largest(qwen3):
    engine = _engine(qwen3[0], kv_cache="turbo-3.5")
    D = engine.args.head_dim
    for i, layer in enumerate(engine.model.model.layers):
        w = layer.self_attn.k_norm.weight.detach().float().pow(2)
        strongest = int((w[: D // 2] + w[D // 2 :]).argmax())  # RoPE pairs channel i with i + D/2
        picked = engine.kv.outliers[(i, "k")]
        assert picked.shape == (engine.args.n_kv_heads, D // 4)
        assert all(strongest in row.tolist() and strongest + D // 2 in row.tolist() for row in picked)


@pytest.mark.parametrize("speculative", [{"method": "ngram", "k": 4}, {"method": "draft", "k": 3}])
def test_speculative_decoding_of_a_qwen3_checkpoint_is_lossless(qwen3, plain, speculative):
    if speculative["method"] == "draft":  # the checkpoint drafts for itself: every proposal is accepted
        speculative = {**speculative, "draft_model": str(qwen3[0])}
    engine = _engine(qwen3[0], speculative=speculative)
    results = engine.generate([GenerationRequest(f"p{i}", p, NEW) for i, p in enumerate(PROMPTS)])
    assert [r.token_ids for r in results] == _greedy(plain)
    if speculative["method"] == "draft":
        assert all(r.spec is not None and r.spec.num_accepted_tokens == r.spec.num_draft_tokens > 0 for r in results)


def _config(model_path, configs):
    return {"project": "q3", "model": {"name": "tiny-qwen3", "path": str(model_path)}, "configs": configs,
            "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 4, "seed": 0,
                        "scorers": ["perplexity", "generation"],
                        "generation": {"prompts": 2, "prompt_words": 12, "max_new_tokens": 8}}]}


@pytest.mark.integration
def test_canary_run_takes_qwen3_moe_and_refuses_a_family_it_has_no_decoder_for(tmp_path):
    import json

    import transformers
    import yaml

    from tests.unit.test_cli import canary

    path, _ = _checkpoint(tmp_path / "tiny-qwen3-moe", "qwen3_moe")
    configs = [{"name": "fp32", "baseline": True, "engine": "reference", "weights": "fp32"},
               {"name": "int4-kv-int8-ngram", "engine": "reference", "weights": "rtn-int4", "kv_cache": "int8",
                "speculative": {"method": "ngram", "k": 4}}]
    (tmp_path / "canary.yaml").write_text(yaml.safe_dump(_config(path, configs)))
    db = f"sqlite:///{tmp_path / 'c.db'}"
    r = canary("run", "-f", "canary.yaml", "--json", "--fail-on", "never", cwd=tmp_path, env_db=db)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert [c["status"] for c in out["configs"]] == ["succeeded", "succeeded"], out["configs"]
    assert {c["metric"] for c in out["comparisons"] if c["config"] == "int4-kv-int8-ngram"} >= {"ppl_ratio",
                                                                                               "gen_nll_ratio"}
    # every expert quantized, the router not: 2 layers × (attention 4 × 128² + 4 experts × 3 × 128²) weights
    assert out["figures"]["int4-kv-int8-ngram"]["weight_bytes"] < out["figures"]["fp32"]["weight_bytes"]

    def refused(name, model_dir, config):
        (tmp_path / name).write_text(yaml.safe_dump(_config(model_dir, [config])))
        r = canary("run", "-f", name, cwd=tmp_path, env_db=db)
        assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, (r.stdout, r.stderr)
        return r.stderr

    # a family with no decoder in the reference engine, and AWQ on experts: refused before anything runs
    gemma = tmp_path / "tiny-gemma"
    transformers.GemmaForCausalLM(transformers.GemmaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)).save_pretrained(gemma)
    assert ("configs[0].engine: the reference engine has no decoder for model_type 'gemma' (config.json); "
            "it runs llama, mistral, qwen2, qwen3, qwen3_moe") in refused("gemma.yaml", gemma, configs[0])
    assert "configs[0].weights: the reference engine's AWQ search scales dense MLPs" in refused(
        "awq.yaml", path, {**configs[0], "weights": "awq-int4"})
    runs = canary("runs", "list", "--project", "q3", "--json", cwd=tmp_path, env_db=db)
    assert runs.returncode == 0 and len(json.loads(runs.stdout)) == 1  # the first run only: nothing stored
