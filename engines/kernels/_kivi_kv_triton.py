"""Triton kernels for the KIVI KV cache (see kivi_kv.py for the layout and the API).
Imported only when a kernel runs."""

import triton
import triton.language as tl

from engines.kernels._decode_triton import _grouped_program, _load_queries, _softmax_update, _store_partials


@triton.jit
def _pack(q, BITS: tl.constexpr, D: tl.constexpr):
    # codes q [R, D] < 2^BITS → [R, D·BITS/32] int32; channel c in word c // PER, bits (c % PER)·BITS
    PER: tl.constexpr = 32 // BITS
    lanes = tl.reshape(q, (q.shape[0], D // PER, PER))
    return tl.sum(lanes << (tl.arange(0, PER) * BITS)[None, None, :], axis=2)


@triton.jit
def _unpack_rows(codes_ptr, row_off, rs, mask_s, BITS: tl.constexpr, D: tl.constexpr):
    # rows rs of a [.., S, D·BITS/32] code tensor → codes [BLOCK_S, D] as fp32. Each packed word
    # is loaded once and split by shifts along a third axis (channel c is lane c % PER of word
    # c // PER). The integer becomes a float by its bits: 2^23 + q has q in the low mantissa bits,
    # so OR-ing q into 0x4B000000 and subtracting 2^23 is exact, with no conversion instruction
    PER: tl.constexpr = 32 // BITS
    rw = tl.arange(0, D // PER)
    words = tl.load(codes_ptr + row_off + rs[:, None] * (D // PER) + rw[None, :], mask=mask_s[:, None], other=0)
    lanes = (words[:, :, None] >> (tl.arange(0, PER) * BITS)[None, None, :]) & (2**BITS - 1)
    codes = tl.reshape(lanes, (rs.shape[0], D))
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _key_scores(q, kc_ptr, ks_ptr, kz_ptr, k_ptr, code_off, head, rs, valid, ck, S, SG,
                D: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, DOT: tl.constexpr):
    # scores [GP, BLOCK_S] of a tile that mixes tiers: keys dequantized per element (per channel
    # scale/zero of each slot's token group [SG = ⌈S/G⌉, D]) or read from the residual
    rd = tl.arange(0, D)
    kq = _unpack_rows(kc_ptr, code_off, rs, ck, BITS, D)
    koff = (head * SG + rs // GROUP)[:, None] * D + rd[None, :]
    kdq = (kq * tl.load(ks_ptr + koff, mask=ck[:, None], other=0.0)
           + tl.load(kz_ptr + koff, mask=ck[:, None], other=0.0))
    kraw = tl.load(k_ptr + (head * S + rs)[:, None] * D + rd[None, :], mask=(valid & ~ck)[:, None], other=0.0)
    kt = tl.where(ck[:, None], kdq, kraw.to(tl.float32)).to(DOT)
    return tl.dot(q.to(DOT), tl.trans(kt), input_precision="ieee")


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
                     len_ptr, nk_ptr, nv_ptr, m_ptr, l_ptr, acc_ptr, HKV, S, SG, scale,
                     D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_S: tl.constexpr,
                     DOT: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr):
    # the G query heads of one KV head. Slot j's key is read compressed iff j < nk, its value iff
    # j < nv; otherwise from the full-precision residual (k_ptr / v_ptr). Masked loads: each
    # slot's bytes come from one tier only. Where a tile is one token group wholly compressed
    # (BLOCK_S = GROUP), the group's per-channel key scale folds into the query and its zero into
    # one offset per head: s = (q·scale)·codesᵀ + q·zero, so the codes go to the product as they are
    bk, chunk, b, kvh, rg, rows = _grouped_program(HKV, G, GP)
    length = tl.minimum(tl.load(len_ptr + b), S)
    nk, nv = tl.load(nk_ptr + b), tl.load(nv_ptr + b)
    rd = tl.arange(0, D)
    q = _load_queries(q_ptr, rows, rg, scale, G, D)  # fp32
    head = b * HKV + kvh
    code_off = head * S * (D * BITS // 32)
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    # tiles dealt round-robin (program c takes tiles c, c + n, …): every program has work at any
    # length, not only when the sequence fills the static cache; none past the length
    for s0 in range(chunk * BLOCK_S, length, tl.num_programs(1) * BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        valid = rs < length
        ck, cv = valid & (rs < nk), valid & (rs < nv)
        if BLOCK_S == GROUP:
            if s0 + BLOCK_S <= nk:
                goff = (head * SG + s0 // GROUP) * D + rd
                qs = (q * tl.load(ks_ptr + goff)[None, :]).to(DOT)
                zq = tl.sum(q * tl.load(kz_ptr + goff)[None, :], axis=1)
                kq = _unpack_rows(kc_ptr, code_off, rs, ck, BITS, D).to(DOT)  # small integers: exact
                s = tl.dot(qs, tl.trans(kq), input_precision="ieee") + zq[:, None]
            else:
                s = _key_scores(q, kc_ptr, ks_ptr, kz_ptr, k_ptr, code_off, head, rs, valid, ck, S, SG,
                                D, GROUP, BITS, DOT)
        else:
            s = _key_scores(q, kc_ptr, ks_ptr, kz_ptr, k_ptr, code_off, head, rs, valid, ck, S, SG, D, GROUP, BITS, DOT)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, p, alpha = _softmax_update(s, m_i, l_i)
        # values: per token scale/zero of each group of G channels [S, D/G]
        vq = _unpack_rows(vc_ptr, code_off, rs, cv, BITS, D)
        voff = (head * S + rs)[:, None] * (D // GROUP) + (rd // GROUP)[None, :]
        vdq = (vq * tl.load(vs_ptr + voff, mask=cv[:, None], other=0.0)
               + tl.load(vz_ptr + voff, mask=cv[:, None], other=0.0))
        vraw = tl.load(v_ptr + (head * S + rs)[:, None] * D + rd[None, :], mask=(valid & ~cv)[:, None], other=0.0)
        vt = tl.where(cv[:, None], vdq, vraw.to(tl.float32)).to(DOT)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), vt, input_precision="ieee")
    _store_partials(m_ptr, l_ptr, acc_ptr, rows, rg, chunk, m_i, l_i, acc, G, D)
