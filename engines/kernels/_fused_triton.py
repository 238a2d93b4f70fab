"""Triton kernels of the fused decode step (engines/kernels/fused.py has their wrappers and torch
references). Each rounds where the unfused torch ops round: a product or sum of two 16-bit values
is formed in fp32 and rounded once to the 16-bit type, as torch's half-precision ops do."""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    # one row per program: h = x + res (rounded to x's type), res_out = h, out = w · (h·rsqrt(mean(h²) + eps))
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < n_cols
    h = tl.load(x_ptr + row * n_cols + cols, mask=keep, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * n_cols + cols, mask=keep, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + cols, h, mask=keep)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)
    normed = (hf * inv).to(h.dtype)
    w = tl.load(w_ptr + cols, mask=keep, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=keep)


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, n, width, BLOCK: tl.constexpr):
    # gate_up [N, 2W] (gate first) → silu(gate)·up [N, W]: silu rounded to the type, then the product
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = i < n
    row, col = i // width, i % width
    g = tl.load(gu_ptr + row * 2 * width + col, mask=keep, other=0.0)
    u = tl.load(gu_ptr + row * 2 * width + width + col, mask=keep, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    y = s.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def rope_store_kernel(qkv_ptr, q_ptr, cos_ptr, sin_ptr, slot_ptr, k_dst, v_dst, T, S, cos_sb, cos_st,
                      dst_sb, dst_sh, dst_ss, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                      HALF: tl.constexpr, HB: tl.constexpr, STORE: tl.constexpr, FP8: tl.constexpr):
    # qkv [N = B·T, H + 2·Hkv, D] (one token's heads contiguous): the query heads rotated into
    # q [N, H, D], the key heads in place, x·cos + cat(−x2, x1)·sin; with STORE, each token's
    # rotated keys and its values also go to k_dst, v_dst [B, Hkv, S, D] at slot slots[t] (FP8:
    # saturated to ±448 and cast to e4m3, as fp8_quantize_kernel does). Program (token, block of
    # HB heads).
    n = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    b, t = n // T, n % T
    d = tl.arange(0, HALF)
    ok = (heads < H + 2 * HKV)[:, None] & (d < D // 2)[None, :]
    row = qkv_ptr + n * (H + 2 * HKV) * D + heads[:, None] * D + d[None, :]
    x1 = tl.load(row, mask=ok, other=0.0)
    x2 = tl.load(row + D // 2, mask=ok, other=0.0)
    c1 = tl.load(cos_ptr + b * cos_sb + t * cos_st + d, mask=d < D // 2, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + b * cos_sb + t * cos_st + D // 2 + d, mask=d < D // 2, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + b * cos_sb + t * cos_st + d, mask=d < D // 2, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + b * cos_sb + t * cos_st + D // 2 + d, mask=d < D // 2, other=0.0).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    ty = x1.dtype
    y1 = ((a1 * c1[None, :]).to(ty).to(tl.float32) + (-a2 * s1[None, :]).to(ty).to(tl.float32)).to(ty)
    y2 = ((a2 * c2[None, :]).to(ty).to(tl.float32) + (a1 * s2[None, :]).to(ty).to(tl.float32)).to(ty)
    is_q = (heads < H)[:, None] & ok
    q_at = q_ptr + n * H * D + heads[:, None] * D + d[None, :]
    tl.store(q_at, y1, mask=is_q)
    tl.store(q_at + D // 2, y2, mask=is_q)
    rot = ((heads >= H) & (heads < H + HKV))[:, None] & ok
    tl.store(row, y1, mask=rot)
    tl.store(row + D // 2, y2, mask=rot)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        is_k = (heads >= H) & (heads < H + HKV)
        is_v = heads >= H + HKV
        kvh = tl.where(is_k, heads - H, heads - H - HKV).to(tl.int64)
        at = b * dst_sb + kvh[:, None] * dst_sh + slot * dst_ss + d[None, :]
        z1 = tl.where(is_k[:, None], y1, x1).to(tl.float32)
        z2 = tl.where(is_k[:, None], y2, x2).to(tl.float32)
        if FP8:
            z1 = tl.minimum(tl.maximum(z1, -448.0), 448.0)
            z2 = tl.minimum(tl.maximum(z2, -448.0), 448.0)
        z1 = z1.to(k_dst.dtype.element_ty)
        z2 = z2.to(k_dst.dtype.element_ty)
        at_slot = tl.zeros((HB,), tl.int64) + slot
        inside = (at_slot >= 0) & (at_slot < S)  # never past this row and head's slots
        kmask = (is_k & inside)[:, None] & ok
        vmask = (is_v & inside)[:, None] & ok
        tl.store(k_dst + at, z1, mask=kmask)
        tl.store(k_dst + at + D // 2, z2, mask=kmask)
        tl.store(v_dst + at, z1, mask=vmask)
        tl.store(v_dst + at + D // 2, z2, mask=vmask)
