"""Triton kernels for the KIVI KV cache (see kivi_kv.py for the layout and the API).
Imported only when a kernel runs."""

import triton
import triton.language as tl

from engines.kernels._turbo_kv_triton import _online_softmax_step, _split_k_program, _store_split_k


@triton.jit
def _pack(q, BITS: tl.constexpr, D: tl.constexpr):
    # codes q [R, D] < 2^BITS → [R, D·BITS/32] int32; channel c in word c // PER, bits (c % PER)·BITS
    PER: tl.constexpr = 32 // BITS
    lanes = tl.reshape(q, (q.shape[0], D // PER, PER))
    return tl.sum(lanes << (tl.arange(0, PER) * BITS)[None, None, :], axis=2)


@triton.jit
def _unpack_rows(codes_ptr, row_off, rs, mask_s, BITS: tl.constexpr, D: tl.constexpr):
    # rows rs of a [.., S, D·BITS/32] code tensor → codes [BLOCK_S, D] (float)
    PER: tl.constexpr = 32 // BITS
    rd = tl.arange(0, D)
    words = tl.load(codes_ptr + row_off + rs[:, None] * (D // PER) + (rd // PER)[None, :],
                    mask=mask_s[:, None], other=0)
    return ((words >> ((rd % PER) * BITS)[None, :]) & (2**BITS - 1)).to(tl.float32)


@triton.jit
def quantize_keys_kernel(k_ptr, codes_ptr, scale_ptr, zero_ptr,
                         D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr):
    # one program per group of G tokens: min-max per channel over the group (KIVI keys)
    grp = tl.program_id(0).to(tl.int64)  # rows·D can pass 2^31
    rs = grp * G + tl.arange(0, G)
    rd = tl.arange(0, D)
    x = tl.load(k_ptr + rs[:, None] * D + rd[None, :]).to(tl.float32)  # [G, D]
    lo, hi = tl.min(x, axis=0), tl.max(x, axis=0)
    scale = tl.maximum(hi - lo, 1e-8) / (2**BITS - 1)
    q = tl.minimum(tl.maximum(tl.floor((x - lo[None, :]) / scale[None, :] + 0.5), 0), 2**BITS - 1).to(tl.int32)
    rw = tl.arange(0, D * BITS // 32)
    tl.store(codes_ptr + rs[:, None] * (D * BITS // 32) + rw[None, :], _pack(q, BITS, D))
    tl.store(scale_ptr + grp * D + rd, scale)
    tl.store(zero_ptr + grp * D + rd, lo)


@triton.jit
def quantize_values_kernel(v_ptr, codes_ptr, scale_ptr, zero_ptr, N,
                           D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr):
    # one program per BLOCK_N tokens: min-max per token over each group of G channels (KIVI values)
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rd = tl.arange(0, D)
    x = tl.load(v_ptr + rn[:, None] * D + rd[None, :], mask=rn[:, None] < N, other=0.0).to(tl.float32)
    xg = tl.reshape(x, (BLOCK_N, D // G, G))
    lo, hi = tl.min(xg, axis=2), tl.max(xg, axis=2)  # [BLOCK_N, D/G]
    scale = tl.maximum(hi - lo, 1e-8) / (2**BITS - 1)
    qg = tl.floor((xg - lo[:, :, None]) / scale[:, :, None] + 0.5)
    q = tl.reshape(tl.minimum(tl.maximum(qg, 0), 2**BITS - 1).to(tl.int32), (BLOCK_N, D))
    rw = tl.arange(0, D * BITS // 32)
    tl.store(codes_ptr + rn[:, None] * (D * BITS // 32) + rw[None, :], _pack(q, BITS, D), mask=rn[:, None] < N)
    rg = tl.arange(0, D // G)
    tl.store(scale_ptr + rn[:, None] * (D // G) + rg[None, :], scale, mask=rn[:, None] < N)
    tl.store(zero_ptr + rn[:, None] * (D // G) + rg[None, :], lo, mask=rn[:, None] < N)


@triton.jit
def attention_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, k_ptr, v_ptr,
                     len_ptr, nk_ptr, nv_ptr, m_ptr, l_ptr, acc_ptr, H, HKV, S, SG, CHUNK, scale,
                     D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, BLOCK_S: tl.constexpr):
    # one query head × one chunk of the sequence. Slot j's key is read compressed iff j < nk,
    # its value iff j < nv; otherwise from the full-precision residual (k_ptr / v_ptr). Masked
    # loads: each slot's bytes come from one tier only.
    bh, chunk, b, kvh = _split_k_program(H, HKV)
    length, nk, nv = tl.load(len_ptr + b), tl.load(nk_ptr + b), tl.load(nv_ptr + b)
    rd = tl.arange(0, D)
    q = tl.load(q_ptr + bh * D + rd).to(tl.float32)
    head = b * HKV + kvh
    code_off = head * S * (D * BITS // 32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros((D,), dtype=tl.float32)
    # tiles dealt round-robin (program c takes tiles c, c + n, …): every program has work at any
    # length, not only when the sequence fills the static cache; none past the length
    for s0 in range(chunk * BLOCK_S, length, tl.num_programs(1) * BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        valid = (rs < length) & (rs < S)
        ck, cv = valid & (rs < nk), valid & (rs < nv)
        # keys: per channel scale/zero of the slot's token group [SG = ⌈S/G⌉, D]
        kq = _unpack_rows(kc_ptr, code_off, rs, ck, BITS, D)
        koff = (head * SG + rs // G)[:, None] * D + rd[None, :]
        kdq = (kq * tl.load(ks_ptr + koff, mask=ck[:, None], other=0.0)
               + tl.load(kz_ptr + koff, mask=ck[:, None], other=0.0))
        kraw = tl.load(k_ptr + (head * S + rs)[:, None] * D + rd[None, :], mask=(valid & ~ck)[:, None], other=0.0)
        kt = tl.where(ck[:, None], kdq, kraw.to(tl.float32))
        s = tl.where(valid, tl.sum(kt * q[None, :], axis=1) * scale, float("-inf"))
        # values: per token scale/zero of each group of G channels [S, D/G]
        vq = _unpack_rows(vc_ptr, code_off, rs, cv, BITS, D)
        voff = (head * S + rs)[:, None] * (D // G) + (rd // G)[None, :]
        vdq = (vq * tl.load(vs_ptr + voff, mask=cv[:, None], other=0.0)
               + tl.load(vz_ptr + voff, mask=cv[:, None], other=0.0))
        vraw = tl.load(v_ptr + (head * S + rs)[:, None] * D + rd[None, :], mask=(valid & ~cv)[:, None], other=0.0)
        vt = tl.where(cv[:, None], vdq, vraw.to(tl.float32))
        m_i, l_i, acc = _online_softmax_step(s, vt, m_i, l_i, acc)
    _store_split_k(m_ptr, l_ptr, acc_ptr, bh, chunk, m_i, l_i, acc, D)
