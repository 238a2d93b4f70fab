"""A zoo model as GGUF, for llama.cpp: the weights written with the `gguf` package (F32, the
tensors laid out as llama.cpp's llama architecture reads them), then quantized by llama.cpp's
own quantizer (through `llama-cpp-python`) to the types GGUF deployments use (Q8_0, Q4_K_M).

Layout. The checkpoints are transformers' Llama layout: q and k projections hold each head's
rotary pairs as two halves (rotate_half). llama.cpp's llama rope rotates adjacent pairs, so each
head's rows of q_proj and k_proj are re-ordered from (half, pair) to (pair, half); every other
tensor is copied under llama.cpp's name. The tokenizer is byte-level BPE with GPT-2's split
regex: GGUF tokenizer model `gpt2`, pre-tokenizer `gpt-2`, the vocabulary and merges as they are,
<|endoftext|> as BOS and EOS with BOS added (the reference engine scores a document after it).

    python -m engines.zoo.gguf_export --model builtin:pydoc-target --out /tmp/gguf --quant Q8_0 Q4_K_M
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

QUANT_TYPES = ("Q8_0", "Q4_K_M")  # llama.cpp's LLAMA_FTYPE_MOSTLY_* names


def rotary_rows_to_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
    """[n_heads · head_dim, d] rows, each head [half₀; half₁] → each head's rows as pairs
    (h₀[0], h₁[0], h₀[1], h₁[1], …): transformers' rotate_half layout to llama.cpp's."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_map(n_layers: int) -> dict[str, str]:
    """transformers' tensor names → llama.cpp's."""
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for i in range(n_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    return names


def export_f32(model_dir: Path, out: Path) -> Path:
    """Write model_dir (config.json, model.safetensors, tokenizer.json) as an F32 GGUF file."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    if cfg.get("model_type") != "llama" or tok["model"]["type"] != "BPE":
        raise ValueError(f"{model_dir}: only llama models with a byte-level BPE tokenizer are exported")
    n_heads, n_kv, n_layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(model_dir.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    if [i for _, i in vocab] != list(range(len(vocab))):
        raise ValueError(f"{model_dir}: the vocabulary's ids are not 0..{len(vocab) - 1}")
    special = {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL) for _, i in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(True)

    names = tensor_map(n_layers)
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        t = t.astype(np.float32)
        if name.endswith("q_proj.weight"):
            t = rotary_rows_to_interleaved(t, n_heads)
        elif name.endswith("k_proj.weight"):
            t = rotary_rows_to_interleaved(t, n_kv)
        w.add_tensor(names[name], np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def quantize(src: Path, out: Path, qtype: str) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize) from an F32 GGUF to `qtype`."""
    import llama_cpp  # optional: the interop extra (llama-cpp-python)

    if qtype not in QUANT_TYPES:
        raise ValueError(f"quant type '{qtype}': choose one of {', '.join(QUANT_TYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {qtype} failed with status {rc}")
    return out


def main() -> None:
    from engines.zoo import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:pydoc-target", help="a zoo model (builtin:NAME) or a model directory")
    p.add_argument("--out", type=Path, required=True, help="folder for NAME-f32.gguf and NAME-<quant>.gguf")
    p.add_argument("--quant", nargs="*", default=list(QUANT_TYPES),
                   help=f"llama.cpp types (default: {' '.join(QUANT_TYPES)})")
    args = p.parse_args()
    model_dir = Path(resolve_model_path(args.model))
    args.out.mkdir(parents=True, exist_ok=True)
    f32 = export_f32(model_dir, args.out / f"{model_dir.name}-f32.gguf")
    print(f32)
    for q in args.quant:
        print(quantize(f32, args.out / f"{model_dir.name}-{q.lower()}.gguf", q))


if __name__ == "__main__":
    main()
