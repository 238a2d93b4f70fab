"""Triton kernels for the TurboQuant KV cache (see turbo_kv.py for the layout and the API).
Imported only when a kernel runs, so that the engine never needs Triton otherwise."""

import triton
import triton.language as tl

from engines.kernels._decode_triton import _grouped_program, _softmax_update, _store_partials


@triton.jit
def _codebook(idx, poly_ptr, BITS: tl.constexpr):
    # codebook values of indices idx (int32 < 2^BITS) as arithmetic, not a 2^BITS-way select: the
    # symmetric Lloyd-Max codebook is an odd polynomial of x = idx − (2^BITS − 1)/2 whose 2^(BITS−1)
    # coefficients (turbo_kv.codebook_polynomial) are read low power first; Horner in x². The
    # index becomes a float by its bits (2^23 + idx, then − 2^23): exact, no conversion instruction
    HALF: tl.constexpr = 2 ** (BITS - 1)
    x = (idx | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0 - (2**BITS - 1) / 2
    y = x * x
    acc = tl.zeros(idx.shape, tl.float32) + tl.load(poly_ptr + HALF - 1)
    for k in tl.static_range(HALF - 1):
        acc = acc * y + tl.load(poly_ptr + HALF - 2 - k)
    return x * acc


@triton.jit
def write_kernel(x_ptr, y_ptr, slot_ptr, rot_ptr, book_ptr, codes_ptr, norms_ptr, dx_ptr, dy_ptr, cos_ptr, sin_ptr,
                 N, T, HKV, x_sb, x_sh, x_st, y_sb, y_sh, y_st, c_kv, c_sb, c_sh, c_ss, n_kv, n_sb, n_sh, n_ss,
                 d_sb, d_sh, d_ss, cos_sb, cos_st,
                 D: tl.constexpr, BITS: tl.constexpr, F: tl.constexpr, BLOCK_N: tl.constexpr,
                 DEQUANT: tl.constexpr, ROPE: tl.constexpr):
    # quantize-on-write straight into the cache, keys and values in one launch: program (i, w, z)
    # takes rows of x (z = 0) or y (z = 1), both [B, HKV, T, D] (any strides, channels contiguous),
    # and writes them at slots[t] of codes [2, B, HKV, S, D·F/32] and norms [2, B, HKV, S] (index
    # z) and, with DEQUANT, the rotated-domain value ĉ·‖x‖ into dx or dy [B, HKV, S, D] (dq's dtype).
    # It takes BLOCK_N rows and the 32 rotated channels 32w…32w + 31: F words of 32/F F-bit fields.
    # ROPE: x (the keys) is rotated by RoPE as it is read, x·cos + cat(−x2, x1)·sin with cos, sin
    # [B, 1, T, D] (model.rope_cos_sin's), rounded to x's type as model.apply_rope rounds it
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # offsets can pass 2^31
    w = tl.program_id(1)
    z = tl.program_id(2)
    valid = rn < N
    t = rn % T
    b = rn // T // HKV
    h = rn // T % HKV
    if z == 0:
        x_row = x_ptr + b * x_sb + h * x_sh + t * x_st
        dq_ptr = dx_ptr
    else:
        x_row = y_ptr + b * y_sb + h * y_sh + t * y_st
        dq_ptr = dy_ptr
    lane = tl.arange(0, 32)
    rc = w * 32 + lane
    # Π·x over 32-channel slices of x (a [BLOCK_N, 32] × [32, 32] product each), ‖x‖² beside it:
    # the whole [BLOCK_N, D] × [D, 32] product at once spilled registers at D = 128 on sm_90
    rx = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
    sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in tl.static_range(0, D, 32):
        xk = tl.load(x_row[:, None] + k0 + lane[None, :], mask=valid[:, None], other=0.0)
        if ROPE:
            if z == 0:
                xk = _rope_chunk(xk, x_row, cos_ptr, sin_ptr, b * cos_sb + t * cos_st, valid, k0, lane, D)
        xk = xk.to(tl.float32)
        sq += tl.sum(xk * xk, axis=1)
        rot_t = tl.load(rot_ptr + rc[None, :] * D + k0 + lane[:, None])  # Πᵀ[k0 + i, rc_j] = Π[rc_j, k0 + i]
        rx += tl.dot(xk, rot_t, input_precision="ieee")
    norm = tl.sqrt(sq)
    u = rx / tl.maximum(norm, 1e-12)[:, None]  # rotated unit vectors Π·x̂, channels rc [BLOCK_N, 32]
    best = tl.full((BLOCK_N, 32), float("inf"), tl.float32)
    idx = tl.zeros((BLOCK_N, 32), dtype=tl.int32)
    val = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
    for j in tl.static_range(2**BITS):
        c = tl.load(book_ptr + j)
        dist = tl.abs(u - c)
        better = dist < best
        best = tl.where(better, dist, best)
        idx = tl.where(better, j, idx)
        val = tl.where(better, c, val)
    slot = tl.load(slot_ptr + t, mask=valid, other=0)
    c_off = z * c_kv + b * c_sb + h * c_sh + slot * c_ss
    fields = tl.reshape(idx, (BLOCK_N, F, 32 // F))  # channel 32w + (32/F)·i + j: field j of word F·w + i
    words = tl.sum(fields << (F * tl.arange(0, 32 // F))[None, None, :], axis=2)
    tl.store(codes_ptr + c_off[:, None] + w * F + tl.arange(0, F)[None, :], words, mask=valid[:, None])
    first_word = (tl.zeros((BLOCK_N,), tl.int32) + w) == 0  # the norm once per row
    tl.store(norms_ptr + z * n_kv + b * n_sb + h * n_sh + slot * n_ss, norm, mask=valid & first_word)
    if DEQUANT:
        dq = dq_ptr + (b * d_sb + h * d_sh + slot * d_ss)[:, None] + rc[None, :]
        tl.store(dq, (val * norm[:, None]).to(dq_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _rope_chunk(xk, x_row, cos_ptr, sin_ptr, cs_off, valid, k0: tl.constexpr, lane, D: tl.constexpr):
    # channels k0…k0 + 31 of rows x_row after RoPE: x·cos + partner·sin, the partner −x[c + D/2] in
    # the first half and x[c − D/2] in the second; products and the sum rounded to x's type
    # (a chunk may span both halves: at D = 32 it is the whole vector)
    ty = xk.dtype
    ch = k0 + lane
    part = tl.load(x_row[:, None] + ((ch + D // 2) % D)[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    part = tl.where((ch < D // 2)[None, :], -part, part)
    c = tl.load(cos_ptr + cs_off[:, None] + ch[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cs_off[:, None] + ch[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    return ((xk.to(tl.float32) * c).to(ty).to(tl.float32) + (part * s).to(ty).to(tl.float32)).to(ty)


@triton.jit
def _lookup8(w, la, lb, ha, hb):
    # one code word (8 nibbles, channel 8i + j at bits 4j, codes < 8) → the 16-bit codebook values
    # of its 8 channels in channel order, by byte permutes: a PRMT selects one byte of the 8
    # entries per selector nibble (bit 3 clear: codes < 8; bits 16-31 unread), so two pick the low
    # and the high bytes of four entries (la, lb: low bytes of entries 0-3, 4-7; ha, hb: high) and
    # two more interleave them into four 16-bit values. One element is one word: the outputs do not
    # depend on how Triton groups elements (an asm that read a pack's first element for all four
    # was hoisted above a broadcast by Triton and gave each channel its neighbour's value)
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 s, t, l, h;
        prmt.b32 l, $9, $10, $8;
        prmt.b32 h, $11, $12, $8;
        prmt.b32 t, l, h, 0x5140; mov.b32 {$0, $1}, t;
        prmt.b32 t, l, h, 0x7362; mov.b32 {$2, $3}, t;
        shr.u32 s, $8, 16;
        prmt.b32 l, $9, $10, s;
        prmt.b32 h, $11, $12, s;
        prmt.b32 t, l, h, 0x5140; mov.b32 {$4, $5}, t;
        prmt.b32 t, l, h, 0x7362; mov.b32 {$6, $7}, t; }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r",
        args=[w, tl.zeros(w.shape, tl.int32) + la, tl.zeros(w.shape, tl.int32) + lb,
              tl.zeros(w.shape, tl.int32) + ha, tl.zeros(w.shape, tl.int32) + hb],
        dtype=(tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16), is_pure=True, pack=1)


@triton.jit
def _lookup_tile(codes_ptr, row_off, rs, mask_s, la, lb, ha, hb, D: tl.constexpr, DOT: tl.constexpr):
    # rows rs of a [.., S, D/8] nibble code tensor → codebook values [BLOCK_S, D] in DOT (16-bit)
    W: tl.constexpr = D // 8
    words = tl.load(codes_ptr + row_off + rs[:, None] * W + tl.arange(0, W)[None, :], mask=mask_s[:, None], other=0)
    v0, v1, v2, v3, v4, v5, v6, v7 = _lookup8(words, la, lb, ha, hb)
    # [S, W, 2, 2, 2] with element (j0, j1, j2) = v[4·j0 + 2·j1 + j2]: channel order once reshaped
    vals = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return tl.reshape(vals, (rs.shape[0], D)).to(DOT, bitcast=True)


@triton.jit
def _unpack(codes_ptr, row_off, rs, mask_s, D: tl.constexpr, F: tl.constexpr):
    # rows rs of a [.., S, D·F/32] code tensor (F-bit fields, 32/F to a word, channel c at bits
    # F·(c mod 32/F) of word c // (32/F)) → code indices [BLOCK_S, D]
    W: tl.constexpr = D * F // 32
    PER: tl.constexpr = 32 // F
    words = tl.load(codes_ptr + row_off + rs[:, None] * W + tl.arange(0, W)[None, :], mask=mask_s[:, None], other=0)
    idx = (words[:, :, None] >> (F * tl.arange(0, PER))[None, None, :]) & ((1 << F) - 1)
    return tl.reshape(idx, (rs.shape[0], D))


@triton.jit
def _values(codes_ptr, row_off, rs, mask_s, poly_ptr, la, lb, ha, hb, D: tl.constexpr, BITS: tl.constexpr,
            F: tl.constexpr, DOT: tl.constexpr, LUT: tl.constexpr):
    # the codebook values [BLOCK_S, D] of rows rs in DOT: byte permutes on a GPU (LUT: 3-bit codes
    # in nibbles, a 16-bit DOT), the odd polynomial otherwise (the interpreter runs no inline PTX)
    if LUT:
        return _lookup_tile(codes_ptr, row_off, rs, mask_s, la, lb, ha, hb, D, DOT)
    idx = _unpack(codes_ptr, row_off, rs, mask_s, D, F)
    return _codebook(idx, poly_ptr, BITS).to(DOT)


@triton.jit
def attention_kernel(q_ptr, kc_ptr, kn_ptr, vc_ptr, vn_ptr, len_ptr, poly_ptr, rot_ptr, cos_ptr, sin_ptr,
                     m_ptr, l_ptr, acc_ptr, HKV, S, code_sb, code_sh, norm_sb, norm_sh, scale, la, lb, ha, hb,
                     q_sb, cos_sb, D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_S: tl.constexpr,
                     DOT: tl.constexpr, BITS: tl.constexpr, F: tl.constexpr, LUT: tl.constexpr, ROPE: tl.constexpr):
    # the G query heads of one KV head, rotated here (Π·q) and scored against codebook values in
    # the rotated domain: s = (Π·q)·ĉ_k·‖k‖, acc += p·‖v‖·ĉ_v (rotated back in the merge). q [B, H, D]
    # with row b at b·q_sb (a view of the fused q/k/v output is read in place); ROPE: q is rotated by
    # RoPE first, cos, sin [B, 1, 1, D] (row b at b·cos_sb), rounded as model.apply_rope rounds it
    bk, chunk, b, kvh, rg, rows = _grouped_program(HKV, G, GP)
    length = tl.minimum(tl.load(len_ptr + b), S)
    rd = tl.arange(0, D)
    q_row = q_ptr + b * q_sb + (kvh * G + rg) * D
    live = (rg < G)[:, None]
    q = tl.load(q_row[:, None] + rd[None, :], mask=live, other=0.0)
    if ROPE:
        ty = q.dtype
        part = tl.load(q_row[:, None] + ((rd + D // 2) % D)[None, :], mask=live, other=0.0).to(tl.float32)
        part = tl.where((rd < D // 2)[None, :], -part, part)
        c = tl.load(cos_ptr + b * cos_sb + rd).to(tl.float32)[None, :]
        s_ = tl.load(sin_ptr + b * cos_sb + rd).to(tl.float32)[None, :]
        q = ((q.to(tl.float32) * c).to(ty).to(tl.float32) + (part * s_).to(ty).to(tl.float32)).to(ty)
    q = (q.to(tl.float32) * (scale * 1.4426950408889634)).to(DOT)  # · log2 e, as _load_queries
    rot_t = tl.load(rot_ptr + rd[None, :] * D + rd[:, None]).to(DOT)  # Πᵀ: element (i, j) is Π[j, i]
    q = tl.dot(q, rot_t, input_precision="ieee").to(DOT)
    code_off = b * code_sb + kvh * code_sh
    norm_off = b * norm_sb + kvh * norm_sh
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    # tiles dealt round-robin (program c takes tiles c, c + n, …): every program has work at any
    # length, not only when the sequence fills the static cache; none past the length
    for s0 in range(chunk * BLOCK_S, length, tl.num_programs(1) * BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        valid = rs < length
        kv = _values(kc_ptr, code_off, rs, valid, poly_ptr, la, lb, ha, hb, D, BITS, F, DOT, LUT)
        kn = tl.load(kn_ptr + norm_off + rs, mask=valid, other=0.0)
        s = tl.where(valid[None, :], tl.dot(q, tl.trans(kv), input_precision="ieee") * kn[None, :], float("-inf"))
        m_i, l_i, p, alpha = _softmax_update(s, m_i, l_i)
        vv = _values(vc_ptr, code_off, rs, valid, poly_ptr, la, lb, ha, hb, D, BITS, F, DOT, LUT)
        vn = tl.load(vn_ptr + norm_off + rs, mask=valid, other=0.0)
        acc = acc * alpha[:, None] + tl.dot((p * vn[None, :]).to(DOT), vv, input_precision="ieee")
    _store_partials(m_ptr, l_ptr, acc_ptr, rows, rg, chunk, m_i, l_i, acc, G, D)
