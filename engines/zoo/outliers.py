"""pydoc-outlier: the tiny target with the activation outliers real LLMs have, at the same function.

A small model trained briefly has near-Gaussian activations (benchmarks/tiny_model_outliers.py:
a key-channel max/median near 2), where published LLMs show 10–100 (LLM.int8(), SmoothQuant,
KIVI, KVQuant). Quantization methods that exist because of outliers (AWQ's activation-aware
scales, KIVI's per-channel keys, TurboQuant's rotation) then buy nothing on it. This variant puts
outliers in by two function-preserving rescalings, each by a power of two so that fp32 products
are bit-exact:

* Salient input channels (AWQ, SmoothQuant). In every decoder layer, a few channels of each RMSNorm's
  gain are scaled up by s, and the matching input columns of the linears it feeds (q, k, v after
  input_layernorm; gate, up after post_attention_layernorm) down by s: (x·γ·s) · (W/s) = x·γ·W.
  The activations those linears see carry channels s times larger; their weight columns are
  s times smaller, which round-to-nearest quantization in groups of 128 rounds away.
* Key outlier channels (KIVI, KVQuant). Per KV head, one rotary pair (d, d + D/2) of k_proj's
  output rows is scaled up by s and the same pair of every query head in its group down by s:
  q·k is unchanged, RoPE rotates within the pair so it commutes with the scaling, and the cached
  keys carry channels s times larger, which per-token KV quantization cannot represent.

    python -m engines.zoo.outliers   # writes engines/zoo/artifacts/pydoc-outlier from pydoc-target
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import torch

SALIENT_SCALE = 64.0  # powers of two: scaling is exact in floating point
KEY_SCALE = 32.0
SALIENT_CHANNELS = 8  # per RMSNorm
SEED = 0


def add_outliers(state: dict[str, torch.Tensor], cfg: dict, seed: int = SEED) -> dict[str, torch.Tensor]:
    """A new state dict computing the same function as `state` (a Llama-layout checkpoint) with
    salient activation channels and key outlier channels (module docstring)."""
    out = {k: v.clone() for k, v in state.items()}
    gen = torch.Generator().manual_seed(seed)
    dim, head_dim = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for norm, consumers in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
            channels = torch.randperm(dim, generator=gen)[:SALIENT_CHANNELS]
            out[p + norm + ".weight"][channels] *= SALIENT_SCALE
            for linear in consumers:
                out[p + linear + ".weight"][:, channels] /= SALIENT_SCALE
        group = n_heads // n_kv
        for kv_head in range(n_kv):
            d = int(torch.randint(head_dim // 2, (1,), generator=gen))
            pair = [d, d + head_dim // 2]
            out[p + "self_attn.k_proj.weight"][[kv_head * head_dim + i for i in pair]] *= KEY_SCALE
            for q_head in range(kv_head * group, (kv_head + 1) * group):
                out[p + "self_attn.q_proj.weight"][[q_head * head_dim + i for i in pair]] /= KEY_SCALE
    return out


def derive(source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Write the outlier variant of the model directory `source` to `out` (config and tokenizer copied)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((source / "config.json").read_text())
    if cfg.get("model_type") != "llama" or cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"{source}: the outlier rescaling is written for a bias-free Llama checkpoint")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in source.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, tmp / f.name)
    save_file(add_outliers(load_file(source / "model.safetensors"), cfg), tmp / "model.safetensors",
              metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main() -> None:
    from engines.zoo import ARTIFACTS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=pathlib.Path, default=ARTIFACTS / "pydoc-target")
    ap.add_argument("--out", type=pathlib.Path, default=ARTIFACTS / "pydoc-outlier")
    args = ap.parse_args()
    print(derive(args.source, args.out))


if __name__ == "__main__":
    main()
