"""Triton kernels for the TurboQuant KV cache (see turbo_kv.py for the layout and the API).
Imported only when a kernel runs, so that the engine never needs Triton otherwise."""

import triton
import triton.language as tl

from engines.kernels._decode_triton import _grouped_program, _load_queries, _softmax_update, _store_partials


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
def write_kernel(x_ptr, y_ptr, slot_ptr, rot_ptr, book_ptr, codes_ptr, norms_ptr, dx_ptr, dy_ptr, N, T, HKV,
                 x_sb, x_sh, x_st, y_sb, y_sh, y_st, c_kv, c_sb, c_sh, c_ss, n_kv, n_sb, n_sh, n_ss, d_sb, d_sh, d_ss,
                 D: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, DEQUANT: tl.constexpr):
    # quantize-on-write straight into the cache, keys and values in one launch: program (i, w, z)
    # takes rows of x (z = 0) or y (z = 1), both [B, HKV, T, D] (any strides, channels contiguous),
    # and writes them at slots[t] of codes [2, B, HKV, S, BITS, D/32] and norms [2, B, HKV, S] (index
    # z) and, with DEQUANT, the rotated-domain value ĉ·‖x‖ into dx or dy [B, HKV, S, D] (dq's dtype).
    # It takes BLOCK_N rows and the 32 rotated channels of word w: one word per bit-plane
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
        xk = tl.load(x_row[:, None] + k0 + lane[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
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
    for k in tl.static_range(BITS):
        word = tl.sum(((idx >> k) & 1) << lane[None, :], axis=1)  # [BLOCK_N]: bit j is channel 32w + j
        tl.store(codes_ptr + c_off + k * (D // 32) + w, word, mask=valid)
    first_word = (tl.zeros((BLOCK_N,), tl.int32) + w) == 0  # the norm once per row
    tl.store(norms_ptr + z * n_kv + b * n_sb + h * n_sh + slot * n_ss, norm, mask=valid & first_word)
    if DEQUANT:
        dq = dq_ptr + (b * d_sb + h * d_sh + slot * d_ss)[:, None] + rc[None, :]
        tl.store(dq, (val * norm[:, None]).to(dq_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _unpack(codes_ptr, row_off, rs, mask_s, D: tl.constexpr, BITS: tl.constexpr):
    # rows rs of a [.., S, BITS, D/32] code tensor → code indices [BLOCK_S, D]
    rw = tl.arange(0, D // 32)
    lane = tl.arange(0, 32)
    idx = tl.zeros((rs.shape[0], D // 32, 32), dtype=tl.int32)
    for k in tl.static_range(BITS):
        words = tl.load(codes_ptr + row_off + rs[:, None] * (BITS * (D // 32)) + k * (D // 32) + rw[None, :],
                        mask=mask_s[:, None], other=0)
        idx += ((words[:, :, None] >> lane[None, None, :]) & 1) << k
    return tl.reshape(idx, (rs.shape[0], D))

@triton.jit
def attention_kernel(q_ptr, kc_ptr, kn_ptr, vc_ptr, vn_ptr, len_ptr, poly_ptr, rot_ptr,
                     m_ptr, l_ptr, acc_ptr, HKV, S, code_sb, code_sh, norm_sb, norm_sh, scale,
                     D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_S: tl.constexpr,
                     DOT: tl.constexpr, BITS: tl.constexpr):
    # the G query heads of one KV head, rotated here (Π·q) and scored against codebook values in
    # the rotated domain: s = (Π·q)·ĉ_k·‖k‖, acc += p·‖v‖·ĉ_v (rotated back in the merge)
    bk, chunk, b, kvh, rg, rows = _grouped_program(HKV, G, GP)
    length = tl.minimum(tl.load(len_ptr + b), S)
    rd = tl.arange(0, D)
    q = _load_queries(q_ptr, rows, rg, scale, G, D).to(DOT)
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
        kv = _codebook(_unpack(kc_ptr, code_off, rs, valid, D, BITS), poly_ptr, BITS).to(DOT)
        kn = tl.load(kn_ptr + norm_off + rs, mask=valid, other=0.0)
        s = tl.where(valid[None, :], tl.dot(q, tl.trans(kv), input_precision="ieee") * kn[None, :], float("-inf"))
        m_i, l_i, p, alpha = _softmax_update(s, m_i, l_i)
        vv = _codebook(_unpack(vc_ptr, code_off, rs, valid, D, BITS), poly_ptr, BITS).to(DOT)
        vn = tl.load(vn_ptr + norm_off + rs, mask=valid, other=0.0)
        acc = acc * alpha[:, None] + tl.dot((p * vn[None, :]).to(DOT), vv, input_precision="ieee")
    _store_partials(m_ptr, l_ptr, acc_ptr, rows, rg, chunk, m_i, l_i, acc, G, D)
