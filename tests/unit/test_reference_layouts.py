"""The decoder against transformers on small random Llama (with llama3 / linear RoPE scaling),
Mistral, Qwen2 (attention bias, untied head) and Qwen3 (per-head query and key norms, a head dim
apart from hidden ÷ heads) and Qwen3-MoE (a router over experts, dense and sparse layers mixed)
checkpoints written by transformers itself."""

import pytest
import torch
from engines.reference.cache import KVCache
from engines.reference.kv import kv_format
from engines.reference.model import load_model

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _write(tmp_path, kind, **extra):
    import transformers

    torch.manual_seed(0)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    }[kind]
    model = model_cls(cfg_cls(**{**COMMON, **extra})).eval()
    with torch.no_grad():  # random norms and biases, so that a skipped one would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):  # a router that prefers some experts per token
                p.normal_(0, 1.0)
    model.save_pretrained(tmp_path / kind)
    return model, tmp_path / kind


def _ours(path, ids):
    return _forward(load_model(path), ids)


def _forward(m, ids):
    a = m.args
    T = ids.shape[1]
    slots = torch.arange(T)
    cache = KVCache(a.n_layers, 1, T, a.n_kv_heads, a.head_dim, torch.float32, torch.device("cpu"), kv_format("auto", torch.float32))
    with torch.no_grad():
        return m(ids, slots[None], slots, cache, torch.ones(T, T, dtype=torch.bool).tril()[None, None])


@pytest.mark.parametrize("kind,extra", [
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"tie_word_embeddings": False}),
    ("qwen3", {"tie_word_embeddings": True, "head_dim": 24}),
    ("qwen3", {"tie_word_embeddings": False, "attention_bias": True}),
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16,
                   "norm_topk_prob": True}),
    ("qwen3_moe", {"num_experts": 5, "num_experts_per_tok": 3, "moe_intermediate_size": 24, "head_dim": 16,
                   "norm_topk_prob": False, "num_hidden_layers": 3, "mlp_only_layers": [0]}),
])
def test_logits_match_transformers(tmp_path, kind, extra):
    ref, path = _write(tmp_path, kind, **extra)
    ids = torch.randint(0, 97, (1, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
    got = _ours(path, ids)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    if kind == "qwen2":
        assert load_model(path).args.attention_bias
    if kind == "qwen3_moe":
        args = load_model(path).args
        assert args.sparse_layers == tuple(i for i in range(extra.get("num_hidden_layers", 2))
                                           if i not in extra.get("mlp_only_layers", []))
    if kind == "qwen3":
        args = load_model(path).args
        assert args.qk_norm and args.head_dim == extra.get("head_dim", 128)  # Qwen3Config's default, not 64 ÷ 4
        # the norms are read: with them reset to ones the logits move (the test would see a skipped norm)
        ours = load_model(path)
        with torch.no_grad():
            for layer in ours.model.layers:
                layer.self_attn.q_norm.weight.fill_(1.0)
        assert not torch.allclose(_forward(ours, ids), expected, atol=1e-4)


def test_an_unsupported_family_is_refused_naming_the_supported_ones(tmp_path):
    _, path = _write(tmp_path, "gemma", head_dim=16)
    with pytest.raises(ValueError, match=r"model_type 'gemma' is not supported by the reference engine; "
                                         r"supported: llama, mistral, qwen2, qwen3, qwen3_moe"):
        load_model(path)


def test_sliding_window_caps_the_context(tmp_path):
    _, path = _write(tmp_path, "mistral", sliding_window=64)
    assert load_model(path).args.max_seq_len == 64
