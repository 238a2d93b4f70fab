"""The fused decode step: the small operators between a layer's matmuls, one launch each instead
of six to eight (the round-3 GPU review: about 1,000 launches per 8B decode step, ~2.4 of 6.4 ms).

- add_rms_norm: the residual add and the next RMSNorm (eight aten launches and an add → one).
- silu_mul: SwiGLU's silu(gate)·up over the fused gate/up output (two → one).
- rope_store: RoPE of the query and key heads in place in the fused q/k/v output and, where the
  cache takes it, the new keys and values stored at their slot, cast to the cache's type (fp16
  or fp8 e4m3: quantize-on-write; two to four launches and two index_copy_ → one).

engines/reference/model.py takes them on the kernel path (engines.kernels.use_triton) for
one-token steps; each has its torch reference here, which is what the unfused model computes.
"""

from __future__ import annotations

import math

import torch

from engines.kernels.decode import triton_next_pow2
from engines.kernels.launches import run


# -- torch references (the unfused model's arithmetic) ---------------------------------------------
def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight · RMSNorm(h), h) with h = x + residual (x alone when residual is None), as
    model.RMSNorm computes it."""
    h = x if residual is None else residual + x
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype), h


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] · cos + rotate_half(x) · sin (model.apply_rope)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# -- Triton ----------------------------------------------------------------------------------------
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., dim] (one layout, contiguous) → (normed, h) as add_rms_norm_reference, in
    one launch; h is a new tensor (the residual stream after the add), normed in weight's type."""
    from engines.kernels._fused_triton import add_rms_norm_kernel

    dim = x.shape[-1]
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match "
                         f"x {tuple(x.shape)} {x.dtype}")
    if weight.shape != (dim,):
        raise ValueError(f"add_rms_norm: weight must be [{dim}]; got {tuple(weight.shape)}")
    x = x.contiguous()
    res = residual.contiguous() if residual is not None else x
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = torch.empty_like(x) if residual is not None else x
    rows = x.numel() // dim
    run(add_rms_norm_kernel, (rows,), x, res, weight, out, h, dim, eps, HAS_RES=residual is not None,
        BLOCK=triton_next_pow2(dim), num_warps=4 if dim <= 4096 else 8)
    return out, h


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2W] (contiguous) → silu(gate)·up [..., W] in one launch."""
    from engines.kernels._fused_triton import silu_mul_kernel

    gate_up = gate_up.contiguous()
    width = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
    n, block = out.numel(), 1024
    run(silu_mul_kernel, (math.ceil(n / block),), gate_up, out, n, width, BLOCK=block)
    return out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
               slots: torch.Tensor, dst: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """qkv [B, T, H + 2·Hkv, D] contiguous (queries, keys, values) → the rotated queries [B, T, H, D]
    (a new contiguous tensor, which the decode kernels read without a copy), the key heads rotated
    in place (rope_reference with cos, sin [B, 1, T, D], as model.rope_cos_sin makes them); with
    dst = (k_cache, v_cache) [B, Hkv, S, D] (slots of one head contiguous; fp16/bf16/fp32, or fp8
    e4m3 saturated to ±448), the rotated keys and the values also stored at `slots` [T] (a slot
    past the cache's S is not stored: the unfused index_copy_ would raise there). One launch."""
    from engines.kernels._fused_triton import rope_store_kernel

    B, T, heads, D = qkv.shape
    if heads != n_heads + 2 * n_kv_heads or not qkv.is_contiguous() or D % 2:
        raise ValueError(f"rope_store needs a contiguous qkv [B, T, {n_heads + 2 * n_kv_heads}, D] with D even; "
                         f"got {tuple(qkv.shape)}")
    if cos.shape != (B, 1, T, D) or sin.shape != cos.shape or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError(f"rope_store needs cos and sin [{B}, 1, {T}, {D}] of one layout; got {tuple(cos.shape)}")
    fp8 = False
    if dst is not None:
        if slots.shape != (T,):  # read only to store: a row cache's step passes each row's own positions
            raise ValueError(f"rope_store needs slots [{T}] to store at; got {tuple(slots.shape)}")
        slots = slots.contiguous()
        k_dst, v_dst = dst
        if (k_dst.shape[:2] != (B, n_kv_heads) or k_dst.shape[-1] != D or k_dst.stride() != v_dst.stride()
                or k_dst.dtype != v_dst.dtype or k_dst.stride(-1) != 1):
            raise ValueError(f"rope_store needs caches [{B}, {n_kv_heads}, S, {D}] of one layout and type")
        fp8 = k_dst.dtype == torch.float8_e4m3fn
    k_dst, v_dst = dst if dst is not None else (qkv, qkv)
    q = torch.empty(B, T, n_heads, D, dtype=qkv.dtype, device=qkv.device)
    hb = 8
    run(rope_store_kernel, (B * T, math.ceil(heads / hb)), qkv, q, cos, sin, slots, k_dst, v_dst, T,
        k_dst.shape[2] if dst is not None else 0,
        cos.stride(0), cos.stride(2), *(k_dst.stride()[:3] if dst is not None else (0, 0, 0)),
        H=n_heads, HKV=n_kv_heads, D=D, HALF=triton_next_pow2(D // 2), HB=hb, STORE=dst is not None, FP8=fp8)
    return q
