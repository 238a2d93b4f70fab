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
def _code_ints(codes_ptr, row_off, rs, mask_s, BITS: tl.constexpr, D: tl.constexpr):
    # rows rs of a [.., S, D·BITS/32] code tensor → codes [BLOCK_S, D] as int32. Each packed word
    # is loaded once and split by shifts along a third axis (channel c is lane c % PER of word c // PER)
    PER: tl.constexpr = 32 // BITS
    rw = tl.arange(0, D // PER)
    words = tl.load(codes_ptr + row_off + rs[:, None] * (D // PER) + rw[None, :], mask=mask_s[:, None], other=0)
    lanes = (words[:, :, None] >> (tl.arange(0, PER) * BITS)[None, None, :]) & (2**BITS - 1)
    return tl.reshape(lanes, (rs.shape[0], D))


@triton.jit
def _unpack_rows(codes_ptr, row_off, rs, mask_s, BITS: tl.constexpr, D: tl.constexpr):
    # the codes of rows rs as fp32 [BLOCK_S, D]. The integer becomes a float by its bits: 2^23 + q
    # has q in the low mantissa bits, so OR-ing q into 0x4B000000 and subtracting 2^23 is exact,
    # with no conversion instruction
    codes = _code_ints(codes_ptr, row_off, rs, mask_s, BITS, D)
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _codes_as(codes_ptr, row_off, rs, mask_s, BITS: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr):
    # the codes of rows rs in DOT [BLOCK_S, D], exact. In a 16-bit DOT the code becomes an fp16 by
    # its bits: OR-ing q into the bits of 2^10 gives 2^10 + q, and one subtraction leaves q, with no
    # conversion instruction (bf16 converts that fp16: the interpreter's bf16 bitcast is wrong, so
    # the same trick in bf16 could not be tested here)
    if DOT == tl.float32:
        return _unpack_rows(codes_ptr, row_off, rs, mask_s, BITS, D)
    lanes = _code_ints(codes_ptr, row_off, rs, mask_s, BITS, D)
    return ((lanes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0).to(DOT)


@triton.jit
def _pairs2(w):
    # one word of 16 2-bit codes (channel 16i + j at bits 2j) → its 16 codes as fp16, channel order,
    # two a LOP3: (w >> 2k) & 0x00030003 | 0x64006400 holds 2^10 + the codes of channels k and k + 8
    # as an fp16 pair, and one f16x2 subtraction leaves the codes (exact)
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 t, m, c;
        mov.b32 c, 0x64006400;
        lop3.b32 t, $16, 0x00030003, c, 0xea; sub.f16x2 t, t, c; mov.b32 {$0, $8}, t;
        shr.u32 m, $16, 2; lop3.b32 t, m, 0x00030003, c, 0xea; sub.f16x2 t, t, c; mov.b32 {$1, $9}, t;
        shr.u32 m, $16, 4; lop3.b32 t, m, 0x00030003, c, 0xea; sub.f16x2 t, t, c; mov.b32 {$2, $10}, t;
        shr.u32 m, $16, 6; lop3.b32 t, m, 0x00030003, c, 0xea; sub.f16x2 t, t, c; mov.b32 {$3, $11}, t;
        shr.u32 m, $16, 8; lop3.b32 t, m, 0x00030003, c, 0xea; sub.f16x2 t, t, c; mov.b32 {$4, $12}, t;
        shr.u32 m, $16, 10; lop3.b32 t, m, 0x00030003, c, 0xea; sub.f16x2 t, t, c; mov.b32 {$5, $13}, t;
        shr.u32 m, $16, 12; lop3.b32 t, m, 0x00030003, c, 0xea; sub.f16x2 t, t, c; mov.b32 {$6, $14}, t;
        shr.u32 m, $16, 14; lop3.b32 t, m, 0x00030003, c, 0xea; sub.f16x2 t, t, c; mov.b32 {$7, $15}, t; }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r", args=[w],
        dtype=(tl.float16,) * 16, is_pure=True, pack=1)


@triton.jit
def _pairs4(w):
    # one word of 8 4-bit codes (channel 8i + j at bits 4j) → its 8 codes as fp16, channel order,
    # two a LOP3 as _pairs2: channels k and k + 4 from (w >> 4k) & 0x000F000F
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 t, m, c;
        mov.b32 c, 0x64006400;
        lop3.b32 t, $8, 0x000F000F, c, 0xea; sub.f16x2 t, t, c; mov.b32 {$0, $4}, t;
        shr.u32 m, $8, 4; lop3.b32 t, m, 0x000F000F, c, 0xea; sub.f16x2 t, t, c; mov.b32 {$1, $5}, t;
        shr.u32 m, $8, 8; lop3.b32 t, m, 0x000F000F, c, 0xea; sub.f16x2 t, t, c; mov.b32 {$2, $6}, t;
        shr.u32 m, $8, 12; lop3.b32 t, m, 0x000F000F, c, 0xea; sub.f16x2 t, t, c; mov.b32 {$3, $7}, t; }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r", args=[w], dtype=(tl.float16,) * 8, is_pure=True, pack=1)


@triton.jit
def _codes_by_pairs(codes_ptr, row_off, rs, BITS: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr):
    # rows rs (all in the cache) of a [.., S, D·BITS/32] code tensor → codes [BLOCK_S, D] in DOT on a
    # GPU: inline PTX, two codes an instruction (_pairs2, _pairs4); the joins put them in channel order
    PER: tl.constexpr = 32 // BITS
    words = tl.load(codes_ptr + row_off + rs[:, None] * (D // PER) + tl.arange(0, D // PER)[None, :])
    if BITS == 2:
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _pairs2(words)
        # element (j0, j1, j2, j3) = v[8·j0 + 4·j1 + 2·j2 + j3]: channel order once reshaped
        c0 = tl.join(tl.join(tl.join(v0, v8), tl.join(v4, v12)), tl.join(tl.join(v2, v10), tl.join(v6, v14)))
        c1 = tl.join(tl.join(tl.join(v1, v9), tl.join(v5, v13)), tl.join(tl.join(v3, v11), tl.join(v7, v15)))
        vals = tl.join(c0, c1)
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = _pairs4(words)
        vals = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return tl.reshape(vals, (rs.shape[0], D)).to(DOT)


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
def _compressed_tile(q, acc3, m_i, l_i, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, code_off, head, s0, S, SG,
                     D: tl.constexpr, BLOCK_S: tl.constexpr, DOT: tl.constexpr, GROUP: tl.constexpr,
                     BITS: tl.constexpr, PAIRS: tl.constexpr):
    # a tile wholly compressed in both tiers and inside one key group, with no select and no
    # per-element scale: the group's per-channel key scale folds into the query and its zero into
    # one offset per head, s = (q·scale)·codesᵀ + q·zero; each value channel group g's per-token
    # scale folds into the weights and its zero into one offset per head and group,
    # acc_g += (p·scale_g)·codes_g + p·zero_g. The codes go to the products as they are (small
    # integers: exact in any DOT). acc3 [D/GROUP, GP, GROUP]: the accumulator by channel group
    NG: tl.constexpr = D // GROUP
    rd = tl.arange(0, D)
    rs = s0 + tl.arange(0, BLOCK_S)
    every = rs < S  # all: the tile lies below the compressed boundaries
    goff = (head * SG + s0 // GROUP) * D + rd
    qs = (q * tl.load(ks_ptr + goff)[None, :]).to(DOT)
    zq = tl.sum(q * tl.load(kz_ptr + goff)[None, :], axis=1)
    if PAIRS:
        kq = _codes_by_pairs(kc_ptr, code_off, rs, BITS, D, DOT)
    else:
        kq = _codes_as(kc_ptr, code_off, rs, every, BITS, D, DOT)
    s = tl.dot(qs, tl.trans(kq), input_precision="ieee") + zq[:, None]
    m_i, l_i, p, alpha = _softmax_update(s, m_i, l_i)
    rg = tl.arange(0, NG)
    voff = (head * S + rs)[None, :] * NG + rg[:, None]  # [NG, BLOCK_S]
    vs, vz = tl.load(vs_ptr + voff), tl.load(vz_ptr + voff)
    pv = (p[None, :, :] * vs[:, None, :]).to(DOT)  # [NG, GP, BLOCK_S]
    if PAIRS:
        vq = _codes_by_pairs(vc_ptr, code_off, rs, BITS, D, DOT)
    else:
        vq = _codes_as(vc_ptr, code_off, rs, every, BITS, D, DOT)
    codes = tl.permute(tl.reshape(vq, (BLOCK_S, NG, GROUP)), (1, 0, 2))  # [NG, BLOCK_S, GROUP]
    pz = tl.sum(p[None, :, :] * vz[:, None, :], axis=2)  # [NG, GP]
    acc3 = acc3 * alpha[None, :, None] + tl.dot(pv, codes, input_precision="ieee") + pz[:, :, None]
    return acc3, m_i, l_i


@triton.jit
def attention_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, k_ptr, v_ptr,
                     len_ptr, nk_ptr, nv_ptr, m_ptr, l_ptr, acc_ptr, HKV, S, SG, scale,
                     D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_S: tl.constexpr,
                     DOT: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr, PAIRS: tl.constexpr):
    # the G query heads of one KV head. Slot j's key is read compressed iff j < nk, its value iff
    # j < nv; otherwise from the full-precision residual (k_ptr / v_ptr). Tiles are dealt
    # round-robin (program c takes tiles c, c + n, …), in two loops: first the tiles wholly below
    # both boundaries (at long context nearly all: _compressed_tile, where a tile lies inside one
    # key group, GROUP a multiple of BLOCK_S), then the rest, which mix tiers by masked loads
    # (each slot's bytes come from one tier only) and selects
    bk, chunk, b, kvh, rg, rows = _grouped_program(HKV, G, GP)
    length = tl.minimum(tl.load(len_ptr + b), S)
    nk, nv = tl.load(nk_ptr + b), tl.load(nv_ptr + b)
    rd = tl.arange(0, D)
    q = _load_queries(q_ptr, rows, rg, scale, G, D)  # fp32
    head = b * HKV + kvh
    code_off = head * S * (D * BITS // 32)
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    n = tl.num_programs(1)
    first = 0  # the first tile of the mixed loop
    if GROUP % BLOCK_S == 0:
        acc3 = tl.zeros((D // GROUP, GP, GROUP), tl.float32)
        wholly = tl.minimum(tl.minimum(nk, nv), length) // BLOCK_S  # tiles wholly compressed
        for t in range(chunk, wholly, n):
            acc3, m_i, l_i = _compressed_tile(q, acc3, m_i, l_i, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                                              code_off, head, t * BLOCK_S, S, SG, D, BLOCK_S, DOT, GROUP, BITS,
                                              PAIRS)
        acc = tl.reshape(tl.permute(acc3, (1, 0, 2)), (GP, D))
        first = wholly + (chunk + n - wholly % n) % n  # ≥ wholly, ≡ chunk (mod n)
    else:
        acc = tl.zeros((GP, D), tl.float32)
        first = chunk
    for t in range(first, tl.cdiv(length, BLOCK_S), n):
        s0 = t * BLOCK_S
        rs = s0 + tl.arange(0, BLOCK_S)
        valid = rs < length
        ck, cv = valid & (rs < nk), valid & (rs < nv)
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
