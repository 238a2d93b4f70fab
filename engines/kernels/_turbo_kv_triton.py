"""Triton kernels for the TurboQuant KV cache (see turbo_kv.py for the layout and the API).
Imported only when a kernel runs, so that the engine never needs Triton otherwise."""

import triton
import triton.language as tl


@triton.jit
def _select(idx, book_ptr, LEVELS: tl.constexpr):
    # codebook lookup as arithmetic selects (no data-dependent loads)
    out = tl.zeros(idx.shape, dtype=tl.float32)
    for j in tl.static_range(LEVELS):
        out = tl.where(idx == j, tl.load(book_ptr + j), out)
    return out

@triton.jit
def _online_softmax_step(s, vals, m_i, l_i, acc):
    # one block of scores s [BLOCK_S] (−inf where invalid) and value rows vals [BLOCK_S, D]:
    # rescale the running (max, sum, accumulator) and add the block
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe)
    alpha = tl.exp(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * vals, axis=0)


@triton.jit
def _split_k_program(H, HKV):
    # decode attention grid (B·H, chunks): this program's (query row, chunk, batch, kv head); GQA
    # b and the kv head in int64: offsets like (b·HKV + kvh)·S·D pass 2^31 at batch 16 × 128K
    bh, chunk = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    return bh, chunk, b.to(tl.int64), (h // (H // HKV)).to(tl.int64)


@triton.jit
def _store_split_k(m_ptr, l_ptr, acc_ptr, bh, chunk, m_i, l_i, acc, D: tl.constexpr):
    # this chunk's partial (max, sum, accumulator), merged on the host by merge_split_k
    out = bh * tl.num_programs(1) + chunk
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)
    tl.store(acc_ptr + out * D + tl.arange(0, D), acc)


@triton.jit
def quantize_kernel(x_ptr, rot_ptr, book_ptr, codes_ptr, norms_ptr, N,
                    D: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr):
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # rows·D can pass 2^31
    rd = tl.arange(0, D)
    x = tl.load(x_ptr + rn[:, None] * D + rd[None, :], mask=rn[:, None] < N, other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    unit = x / tl.maximum(norm, 1e-12)[:, None]
    rot = tl.load(rot_ptr + rd[:, None] * D + rd[None, :])  # Π [D, D], row-major
    u = tl.dot(unit, tl.trans(rot), input_precision="ieee")  # rotated unit vectors Π·x̂ [BLOCK_N, D]
    best = tl.full((BLOCK_N, D), float("inf"), tl.float32)
    idx = tl.zeros((BLOCK_N, D), dtype=tl.int32)
    for j in tl.static_range(2**BITS):
        dist = tl.abs(u - tl.load(book_ptr + j))
        better = dist < best
        best = tl.where(better, dist, best)
        idx = tl.where(better, j, idx)
    lanes = tl.reshape(idx, (BLOCK_N, D // 32, 32))
    shift = tl.arange(0, 32)[None, None, :]
    rw = tl.arange(0, D // 32)
    for k in tl.static_range(BITS):
        word = tl.sum(((lanes >> k) & 1) << shift, axis=2)  # [BLOCK_N, D/32]
        tl.store(codes_ptr + rn[:, None] * (BITS * (D // 32)) + k * (D // 32) + rw[None, :], word, mask=rn[:, None] < N)
    tl.store(norms_ptr + rn, norm, mask=rn < N)

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
def attention_kernel(q_ptr, kc_ptr, kn_ptr, vc_ptr, vn_ptr, len_ptr, book_ptr,
                     m_ptr, l_ptr, acc_ptr, H, HKV, S, CHUNK, scale,
                     D: tl.constexpr, BITS: tl.constexpr, BLOCK_S: tl.constexpr):
    bh, chunk, b, kvh = _split_k_program(H, HKV)
    length = tl.load(len_ptr + b)
    rd = tl.arange(0, D)
    q = tl.load(q_ptr + bh * D + rd).to(tl.float32)  # rotated query
    row_off = (b * HKV + kvh) * S * (BITS * (D // 32))
    norm_off = (b * HKV + kvh) * S
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros((D,), dtype=tl.float32)
    # tiles dealt round-robin (program c takes tiles c, c + n, …): every program has work at any
    # length, not only when the sequence fills the static cache; none past the length
    for s0 in range(chunk * BLOCK_S, length, tl.num_programs(1) * BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        valid = (rs < length) & (rs < S)
        kv = _select(_unpack(kc_ptr, row_off, rs, valid, D, BITS), book_ptr, 2**BITS)
        kn = tl.load(kn_ptr + norm_off + rs, mask=valid, other=0.0)
        s = tl.sum(kv * q[None, :], axis=1) * kn * scale
        s = tl.where(valid, s, float("-inf"))
        vv = _select(_unpack(vc_ptr, row_off, rs, valid, D, BITS), book_ptr, 2**BITS)
        vn = tl.load(vn_ptr + norm_off + rs, mask=valid, other=0.0)
        m_i, l_i, acc = _online_softmax_step(s, vn[:, None] * vv, m_i, l_i, acc)
    _store_split_k(m_ptr, l_ptr, acc_ptr, bh, chunk, m_i, l_i, acc, D)


@triton.jit
def fp8_quantize_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # e4m3 with unit scale; saturate to ±448 first (e4m3fn has no infinity)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.float8e4nv), mask=i < n)


@triton.jit
def fp8_attention_kernel(q_ptr, k_ptr, v_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, H, HKV, S, CHUNK, scale,
                         D: tl.constexpr, BLOCK_S: tl.constexpr):
    # one query head × one chunk of the sequence; keys and values read as fp8 and widened
    bh, chunk, b, kvh = _split_k_program(H, HKV)
    length = tl.load(len_ptr + b)
    rd = tl.arange(0, D)
    q = tl.load(q_ptr + bh * D + rd).to(tl.float32)
    base = (b * HKV + kvh) * S * D
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros((D,), dtype=tl.float32)
    # tiles dealt round-robin (program c takes tiles c, c + n, …): every program has work at any
    # length, not only when the sequence fills the static cache; none past the length
    for s0 in range(chunk * BLOCK_S, length, tl.num_programs(1) * BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        valid = (rs < length) & (rs < S)
        kt = tl.load(k_ptr + base + rs[:, None] * D + rd[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(kt * q[None, :], axis=1) * scale
        s = tl.where(valid, s, float("-inf"))
        vt = tl.load(v_ptr + base + rs[:, None] * D + rd[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(s, vt, m_i, l_i, acc)
    _store_split_k(m_ptr, l_ptr, acc_ptr, bh, chunk, m_i, l_i, acc, D)
