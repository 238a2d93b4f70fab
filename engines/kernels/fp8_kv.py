"""fp8 (e4m3, unit scale) KV cache on the GPU: quantize-on-write (a saturating cast) and GQA
decode attention that reads fp8 keys/values and widens them in registers, split-K over the
sequence like turbo_kv.decode_attention. Torch references beside them."""

from __future__ import annotations

import math

import torch

from engines.kernels.turbo_kv import ATTENTION_WARPS, default_block_s, merge_split_k, split_k_chunk

FP8 = torch.float8_e4m3fn


def quantize_reference(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(FP8)


def decode_attention_reference(q, k8, v8, lengths) -> torch.Tensor:
    """q [B, H, D]; k8, v8 [B, Hkv, S, D] fp8; lengths [B] → [B, H, D]."""
    B, H, D = q.shape
    g = H // k8.shape[1]
    k, v = k8.float().repeat_interleave(g, 1), v8.float().repeat_interleave(g, 1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k) / math.sqrt(D)
    valid = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None]
    p = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), -1)
    return torch.einsum("bhs,bhsd->bhd", p, v).to(q.dtype)


def quantize_on_write(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    from engines.kernels._turbo_kv_triton import fp8_quantize_kernel

    flat = x.contiguous().reshape(-1)
    out = torch.empty(flat.shape, dtype=FP8, device=x.device)
    fp8_quantize_kernel[(math.ceil(flat.numel() / block),)](flat, out, flat.numel(), BLOCK=block)
    return out.reshape(x.shape)


def decode_attention(q, k8, v8, lengths, chunk: int | None = None, block_s: int | None = None) -> torch.Tensor:
    """q [B, H, D]; k8, v8 [B, Hkv, S, D] fp8; lengths [B] → [B, H, D] (chunk: turbo_kv.split_k_chunk)."""
    from engines.kernels._turbo_kv_triton import fp8_attention_kernel

    B, H, D = q.shape
    Hkv, S = k8.shape[1], k8.shape[2]
    block_s = block_s or default_block_s(q.device)
    chunk = chunk or split_k_chunk(S, B * H, q.device, block_s)
    n_chunks = math.ceil(S / chunk)
    m = torch.empty(B * H, n_chunks, device=q.device)
    l = torch.empty(B * H, n_chunks, device=q.device)
    acc = torch.empty(B * H, n_chunks, D, device=q.device)
    fp8_attention_kernel[(B * H, n_chunks)](q.float().contiguous(), k8.contiguous(), v8.contiguous(),
                                            lengths.to(torch.int32).contiguous(), m, l, acc, H, Hkv, S, chunk,
                                            1.0 / math.sqrt(D), D=D, BLOCK_S=block_s, num_warps=ATTENTION_WARPS)
    return merge_split_k(m, l, acc).reshape(B, H, D).to(q.dtype)
