"""The decoder against transformers on small random Llama (with llama3 / linear RoPE scaling),
Mistral and Qwen2 (attention bias, untied head) checkpoints written by transformers itself."""

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
    }[kind]
    model = model_cls(cfg_cls(**COMMON, **extra)).eval()
    with torch.no_grad():  # random norms and biases, so that a skipped one would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / kind)
    return model, tmp_path / kind


def _ours(path, ids):
    m = load_model(path)
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


def test_sliding_window_caps_the_context(tmp_path):
    _, path = _write(tmp_path, "mistral", sliding_window=64)
    assert load_model(path).args.max_seq_len == 64
