"""What the decode-attention kernels share (see decode.py for the scheme and the API): the grouped
split-K program, the online-softmax update, the partials' store, the merge kernel, and the
attention kernel over a float cache (fp16, bf16, fp32 or fp8). Imported only when a kernel runs.

One program serves all G query heads of one KV head over one share of the sequence, so each KV tile
is read and decoded once for the G heads (GQA), and both products run on the tensor cores: scores
[GP, BLOCK_S] = q [GP, D] · Kᵀ and the accumulator [GP, D] += p · V, operands of the query's
type (DOT: fp16 or bf16 for a half-precision model, fp32 with IEEE products for an fp32 one) and
fp32 accumulation (FlashDecoding's grouped shape; GP = G padded to the 16 rows a tensor-core
product needs). Scores are kept in log2 units (the query carries scale·log2 e), so the softmax uses exp2.
"""

import triton
import triton.language as tl


@triton.jit
def _grouped_program(HKV, G: tl.constexpr, GP: tl.constexpr):
    # grid (B·Hkv, chunks): this program's (kv row, chunk, batch, kv head, group lanes, query rows).
    # b, the kv head and the rows in int64: offsets like (b·Hkv + kvh)·S·D pass 2^31 at batch 16 × 128K
    bk, chunk = tl.program_id(0), tl.program_id(1)
    rg = tl.arange(0, GP)
    return bk, chunk, (bk // HKV).to(tl.int64), (bk % HKV).to(tl.int64), rg, bk.to(tl.int64) * G + rg


@triton.jit
def _load_queries(q_ptr, rows, rg, scale, G: tl.constexpr, D: tl.constexpr):
    # q [B·H, D] (any float type): rows b·H + kvh·G + g for g < G, zero rows beyond; scaled by
    # scale·log2 e so that the scores come out in log2 units; fp32 [GP, D]
    rd = tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None] * D + rd[None, :], mask=(rg < G)[:, None], other=0.0).to(tl.float32)
    return q * (scale * 1.4426950408889634)  # · log2 e


@triton.jit
def _softmax_update(s, m_i, l_i):
    # scores s [GP, BLOCK_S] in log2 units (−inf where invalid) → the new running max and sum, the
    # tile's weights p [GP, BLOCK_S], and alpha [GP], the factor that rescales the accumulator
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def _store_partials(m_ptr, l_ptr, acc_ptr, rows, rg, chunk, m_i, l_i, acc, G: tl.constexpr, D: tl.constexpr):
    # this chunk's partial (max, sum, accumulator) of each query row, merged by merge_kernel
    out = rows * tl.num_programs(1) + chunk
    live = rg < G
    tl.store(m_ptr + out, m_i, mask=live)
    tl.store(l_ptr + out, l_i, mask=live)
    tl.store(acc_ptr + out[:, None] * D + tl.arange(0, D)[None, :], acc, mask=live[:, None])


@triton.jit
def merge_kernel(m_ptr, l_ptr, acc_ptr, rot_ptr, out_ptr, NC,
                 D: tl.constexpr, NCP: tl.constexpr, ROTATE: tl.constexpr):
    # one query row: out = Σ_c 2^(m_c − M)·acc_c / Σ_c 2^(m_c − M)·l_c over its NC chunks (empty
    # chunks have m = −inf), written in the output's dtype; ROTATE: times Π [D, D] (TurboQuant's
    # rotation back from the rotated domain)
    row = tl.program_id(0).to(tl.int64)
    rc = tl.arange(0, NCP)
    rd = tl.arange(0, D)
    live = rc < NC
    m = tl.load(m_ptr + row * NC + rc, mask=live, other=float("-inf"))
    l = tl.load(l_ptr + row * NC + rc, mask=live, other=0.0)
    acc = tl.load(acc_ptr + (row * NC + rc)[:, None] * D + rd[None, :], mask=live[:, None], other=0.0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - tl.max(m, axis=0)))
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    if ROTATE:
        rot = tl.load(rot_ptr + rd[:, None] * D + rd[None, :])
        out = tl.sum(out[:, None] * rot, axis=0)
    tl.store(out_ptr + row * D + rd, out.to(out_ptr.dtype.element_ty))


@triton.jit
def fp8_quantize_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # e4m3 with unit scale; saturate to ±448 first (e4m3fn has no infinity)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.float8e4nv), mask=i < n)


@triton.jit
def float_attention_kernel(q_ptr, k_ptr, v_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, HKV, S, stride_b, stride_h, scale,
                         D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_S: tl.constexpr,
                         DOT: tl.constexpr):
    # keys and values [B, Hkv, S, D] in a float type: fp16/bf16/fp32, or e4m3 widened to DOT in
    # registers (e4m3 values are exact in fp16 and bf16); rows of one head contiguous, b and head
    # by stride
    bk, chunk, b, kvh, rg, rows = _grouped_program(HKV, G, GP)
    length = tl.minimum(tl.load(len_ptr + b), S)
    rd = tl.arange(0, D)
    q = _load_queries(q_ptr, rows, rg, scale, G, D).to(DOT)
    base = b * stride_b + kvh * stride_h
    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    # tiles dealt round-robin (program c takes tiles c, c + n, …): every program has work at any
    # length, not only when the sequence fills the static cache; none past the length
    for s0 in range(chunk * BLOCK_S, length, tl.num_programs(1) * BLOCK_S):
        rs = s0 + tl.arange(0, BLOCK_S)
        valid = rs < length
        kt = tl.load(k_ptr + base + rs[:, None] * D + rd[None, :], mask=valid[:, None], other=0.0).to(DOT)
        s = tl.where(valid[None, :], tl.dot(q, tl.trans(kt), input_precision="ieee"), float("-inf"))
        m_i, l_i, p, alpha = _softmax_update(s, m_i, l_i)
        vt = tl.load(v_ptr + base + rs[:, None] * D + rd[None, :], mask=valid[:, None], other=0.0).to(DOT)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), vt, input_precision="ieee")
    _store_partials(m_ptr, l_ptr, acc_ptr, rows, rg, chunk, m_i, l_i, acc, G, D)
