"""fp8 (e4m3, unit scale) KV cache on the GPU: quantize-on-write (a saturating cast) and GQA
decode attention that reads fp8 keys/values and widens them in registers (the grouped split-K
scheme of decode.py). Torch references beside them."""

from __future__ import annotations

import math

import torch

from engines.kernels.decode import Tuning, float_decode_attention

TUNING = Tuning(block_s=128, num_warps=4, num_stages=2)  # the fastest in the H200 sweep (benchmarks/results/gpu)

FP8 = torch.float8_e4m3fn


def quantize_reference(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(FP8)


def decode_attention_reference(q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
                               lengths: torch.Tensor) -> torch.Tensor:
    """q [B, H, D]; k8, v8 [B, Hkv, S, D] fp8; lengths [B] → [B, H, D]."""
    B, H, D = q.shape
    g = H // k8.shape[1]
    k, v = k8.float().repeat_interleave(g, 1), v8.float().repeat_interleave(g, 1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k) / math.sqrt(D)
    valid = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]
    p = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), -1)
    return torch.einsum("bhs,bhsd->bhd", p, v).to(q.dtype)


def quantize_on_write(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    from engines.kernels._decode_triton import fp8_quantize_kernel
    from engines.kernels.launches import run

    flat = x.contiguous().reshape(-1)
    out = torch.empty(flat.shape, dtype=FP8, device=x.device)
    run(fp8_quantize_kernel, (math.ceil(flat.numel() / block),), flat, out, flat.numel(), BLOCK=block)
    return out.reshape(x.shape)


def decode_attention(q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, lengths: torch.Tensor,
                     **launch_kw: int | None) -> torch.Tensor:
    """q [B, H, D]; k8, v8 [B, Hkv, S, D] fp8 (a [:, :, :S] slice of a wider cache is read in
    place); lengths [B] (any integer type) → [B, H, D] in q's dtype: decode.float_decode_attention
    at fp8's launch shape (launch_kw: chunks, block_s, num_warps, num_stages to override it)."""
    return float_decode_attention(q, k8, v8, lengths, tuning=TUNING, **launch_kw)
