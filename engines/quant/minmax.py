"""Round-to-nearest weight quantization: group-wise asymmetric INT-b (docs/reference.md §1).

Per (output row, group of 128 input columns):
    s = (max − min) / (2^b − 1),  z = clamp(−round(min / s), 0, 2^b − 1)
    q = clamp(round(w / s) + z, 0, 2^b − 1),  ŵ = (q − z) · s
b = 4 is the quantizer AWQ and RTN-int4 share; b = 8 gives int8 with the same grouping.
minmax_quant is the same min-max rule along any one axis, returned dequantized: the KV formats'
per-token and KIVI groups (docs/reference.md §2).
"""

from __future__ import annotations

import torch

GROUP_SIZE = 128


def quantize_groupwise(w: torch.Tensor, bits: int,
                       group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w: [out, in] → q: uint8 [out, in], scale: [out, in/g], zero: [out, in/g] (float32)."""
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"in_features={in_f} is not a multiple of group_size={group_size}")
    qmax = 2**bits - 1
    wg = w.float().reshape(out_f, in_f // group_size, group_size)
    w_min, w_max = wg.amin(-1), wg.amax(-1)
    scale = (w_max - w_min).clamp(min=1e-8) / qmax  # a constant group gets a tiny scale, not 0
    zero = (-torch.round(w_min / scale)).clamp(0, qmax)
    q = (torch.round(wg / scale[..., None]) + zero[..., None]).clamp(0, qmax)
    return q.reshape(out_f, in_f).to(torch.uint8), scale, zero


def dequantize_groupwise(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                         group_size: int = GROUP_SIZE) -> torch.Tensor:
    out_f, in_f = q.shape
    qg = q.float().reshape(out_f, in_f // group_size, group_size)
    return ((qg - zero[..., None]) * scale[..., None]).reshape(out_f, in_f)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """ŵ in w's dtype: the exact values an INT-b kernel would multiply with."""
    q, scale, zero = quantize_groupwise(w, bits, group_size)
    return dequantize_groupwise(q, scale, zero, group_size).to(w.dtype)


def quantized_bytes(out_f: int, in_f: int, bits: int, group_size: int = GROUP_SIZE) -> int:
    """Storage of a packed INT-b weight with one fp16 scale and one fp16 zero per group."""
    groups = out_f * (in_f // group_size)
    return out_f * in_f * bits // 8 + groups * 2 * 2


def minmax_quant(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min-max quantize → dequantize along `dim` (one scale and zero per slice)."""
    qmax = 2**bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo).clamp(min=1e-8) / qmax
    q = torch.round((x - lo) / scale).clamp(0, qmax)
    return q * scale + lo
