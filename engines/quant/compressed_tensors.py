"""compressed-tensors checkpoints (the format llm-compressor writes, `quant_method:
compressed-tensors`): weight-only integer quantization read back to dense weights.

Supported: `pack-quantized` (int weights of 1–8 bits packed densely into int32 words along the
input dimension, element i at bits [i·b, i·b + b) of the row's bit stream, stored as q + 2^(b−1)),
and `naive-quantized` (int8 weights stored as they are); strategies tensor, channel and group,
symmetric or not (the zero point packed the same way along the output dimension), with a
`weight_g_idx` (GPTQ's activation order "group") giving each input column's group. Each
quantized Linear holds `weight_packed` (or an int8 `weight`), `weight_scale`, `weight_shape`, and
`weight_zero_point` when asymmetric:

    W[o, c] = (q[o, c] − z[o, g(c)]) · s[o, g(c)],  g(c) = g_idx[c] or c // group_size.

Quantized activations (W8A8, FP8, NVFP4) are refused: the reference engine computes in floating
point and would not reproduce them.
"""

from __future__ import annotations

import math
import re

import torch


class CheckpointFormatError(ValueError):
    pass


def unpack_int32(packed: torch.Tensor, bits: int, n: int, packed_dim: int = 1) -> torch.Tensor:
    """int32 words [rows, ⌈n·bits/32⌉] (packed_dim 1; packed_dim 0 holds them transposed) → signed
    ints [rows, n] (transposed back for packed_dim 0), each stored value less 2^(bits−1)."""
    words = packed.T if packed_dim == 0 else packed
    w = words.to(torch.int64) & 0xFFFFFFFF  # the words as unsigned 32-bit values
    w = torch.cat([w, torch.zeros_like(w[:, :1])], 1)  # an element may run into the next word
    start = torch.arange(n, dtype=torch.int64, device=packed.device) * bits
    word, offset = start // 32, start % 32
    stream = w[:, word] | (w[:, word + 1] << 32)  # 64 bits starting at each element's word
    values = ((stream >> offset) & ((1 << bits) - 1)) - (1 << (bits - 1))
    return values.T if packed_dim == 0 else values


def group_args(qcfg: dict, module: str) -> dict:
    """The `weights` quantization args of the config group whose targets name this module: a
    `re:` pattern that matches it, else a group targeting every Linear."""
    groups = list((qcfg.get("config_groups") or {}).values())
    for group in groups:
        if any(t.startswith("re:") and re.match(t[3:], module) for t in group.get("targets", [])):
            return group
    for group in groups:
        if "Linear" in group.get("targets", []) or any(module.endswith(t) for t in group.get("targets", [])):
            return group
    raise CheckpointFormatError(f"module '{module}' is quantized, but no config group of the quantization_config "
                                f"targets it")


def check_quantization_config(qcfg: dict) -> None:
    """Refuse what the loader cannot read back exactly (engines/zoo compressed_tensors_problem, the
    same check the service makes at the door), naming it; never the checkpoint's path."""
    from engines.zoo import compressed_tensors_problem

    problem = compressed_tensors_problem(qcfg)
    if problem:
        raise CheckpointFormatError(f"the checkpoint's quantization_config: {problem}; use engine: vllm for it")


def dequantize_state(state: dict[str, torch.Tensor], qcfg: dict) -> dict[str, torch.Tensor]:
    """A compressed-tensors state dict → dense float32 weights under their `.weight` names; the
    rest as it was."""
    check_quantization_config(qcfg)
    modules = {k.removesuffix(".weight_scale") for k in state if k.endswith(".weight_scale")}
    out = {k: v for k, v in state.items()
           if not any(k == f"{m}.{s}" for m in modules
                      for s in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx",
                                "weight"))}
    for m in sorted(modules):
        args = group_args(qcfg, m)["weights"]
        bits = int(args["num_bits"])
        scale = state[f"{m}.weight_scale"].float()
        if f"{m}.weight_packed" in state:
            rows, cols = (int(x) for x in state[f"{m}.weight_shape"].tolist())
            q = unpack_int32(state[f"{m}.weight_packed"], bits, cols)
        else:  # naive-quantized: the int8 codes as they are
            q = state[f"{m}.weight"].to(torch.int64)
            rows, cols = q.shape
        if scale.ndim < 2:
            scale = scale.reshape(1, 1).expand(rows, 1) if scale.numel() == 1 else scale.reshape(rows, 1)
        n_groups = scale.shape[1]
        zero = torch.zeros(rows, n_groups)
        if not args.get("symmetric", True):
            zero = _zero_point(state[f"{m}.weight_zero_point"], bits, rows, n_groups).float()
        if f"{m}.weight_g_idx" in state and n_groups > 1:
            g = state[f"{m}.weight_g_idx"].to(torch.int64)
        elif n_groups > 1:
            g = torch.arange(cols) // int(args.get("group_size") or math.ceil(cols / n_groups))
        else:
            g = torch.zeros(cols, dtype=torch.int64)
        out[f"{m}.weight"] = ((q.float() - zero[:, g]) * scale[:, g]).float()
    return out


def _zero_point(zp: torch.Tensor, bits: int, rows: int, n_groups: int) -> torch.Tensor:
    """An asymmetric zero point [rows, n_groups]: packed into int32 along the output dimension
    (compressed-tensors ≥ 0.10), along the groups (older releases), stored unpacked, or one value
    for the whole tensor (strategy tensor)."""
    if zp.numel() == 1:
        return zp.to(torch.int64).reshape(1, 1).expand(rows, n_groups)
    if zp.dtype != torch.int32 or zp.shape == (rows, n_groups):
        return zp.to(torch.int64).reshape(rows, n_groups)
    if zp.shape == (math.ceil(rows * bits / 32), n_groups):
        return unpack_int32(zp, bits, rows, packed_dim=0)
    return unpack_int32(zp, bits, n_groups)
