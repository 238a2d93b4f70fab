"""Triton kernels for W4A16 over the AutoAWQ GEMM layout (see w4a16.py for the layout and API).
Imported only when a kernel runs. On CUDA the launchers wrap them in @triton.autotune over the
configurations below (Hopper-sized tiles); the interpreter runs one fixed small configuration."""

import inspect
from typing import Any

import triton
import triton.language as tl


@triton.jit
def _dequant_tile(qw_ptr, qz_ptr, s_ptr, rk, rn, N, K, GROUP: tl.constexpr):
    # W[rk, rn] = (q − z)·s as fp32 [BLOCK_K, BLOCK_N]; the nibble of column n within its int32
    # is the inverse of AWQ's order [0, 2, 4, 6, 1, 3, 5, 7]
    j = rn % 8
    shift = ((j % 2) * 4 + j // 2) * 4
    mask = (rk[:, None] < K) & (rn[None, :] < N)
    packed = tl.load(qw_ptr + rk[:, None] * (N // 8) + (rn[None, :] // 8), mask=mask, other=0)
    g = rk // GROUP
    zp = tl.load(qz_ptr + g[:, None] * (N // 8) + (rn[None, :] // 8), mask=mask, other=0)
    s = tl.load(s_ptr + g[:, None] * N + rn[None, :], mask=mask, other=0.0)
    q = (packed >> shift[None, :]) & 0xF
    z = (zp >> shift[None, :]) & 0xF
    return (q - z).to(tl.float32) * s.to(tl.float32)


@triton.jit
def gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, M, N, K, M_BUCKET,
                GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                FP32: tl.constexpr):
    # prefill: tensor-core dots over [BLOCK_M, BLOCK_K] × [BLOCK_K, BLOCK_N] tiles. M_BUCKET
    # (M rounded up to a power of two) is read by the autotuner's key only: a new prompt length
    # reuses its bucket's tuned tiles instead of timing every configuration again (inside TTFT)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    # rows in int64: the row offsets rm·K and rm·N pass 2³¹ in a long prefill (gate_up, N = 28672,
    # from M ≈ 75K tokens), where int32 offsets wrap
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, rk, rn, N, K, GROUP)
        if FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def gemv_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, M, N, K,
                GROUP: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr):
    # decode (M ≤ 16), bound by the packed weight bytes it streams: each program reads its
    # [K/SPLIT_K, BLOCK_N/8] slab of int32 words once, as contiguous rows (vectorized loads),
    # and unpacks the 8 nibbles of each word in registers. Columns stay in the packed order
    # (nibble i of word c holds column 8c + AWQ_ORDER[i]): scales and the output are addressed
    # through that permutation, so no nibble is reordered. A BLOCK_K tile lies inside one
    # quantization group (GROUP % BLOCK_K == 0): zeros and scales are read once per tile.
    # Split-K programs add their partial sums into y (fp32).
    W: tl.constexpr = BLOCK_N // 8
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, M_PAD)
    rw = pid_n * W + tl.arange(0, W)  # packed word columns [W]
    lane = tl.arange(0, 8)
    shift = lane * 4
    # AWQ_ORDER[i] = 2(i%4) + i//4
    col = tl.reshape(rw[:, None] * 8 + ((lane % 4) * 2 + lane // 4)[None, :], (BLOCK_N,))
    word_ok = rw < N // 8
    col_ok = col < N
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    for k0 in range(pid_k * k_per, tl.minimum((pid_k + 1) * k_per, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        packed = tl.load(qw_ptr + rk[:, None] * (N // 8) + rw[None, :],
                         mask=(rk[:, None] < K) & word_ok[None, :], other=0)
        q = tl.reshape((packed[:, :, None] >> shift[None, None, :]) & 0xF, (BLOCK_K, BLOCK_N))
        g = k0 // GROUP
        zp = tl.load(qz_ptr + g * (N // 8) + rw, mask=word_ok, other=0)
        z = tl.reshape((zp[:, None] >> shift[None, :]) & 0xF, (BLOCK_N,))
        sc = tl.load(s_ptr + g * N + col, mask=col_ok, other=0.0).to(tl.float32)
        w = (q - z[None, :]).to(tl.float32) * sc[None, :]  # [BLOCK_K, BLOCK_N]
        if M_PAD >= 16:  # a whole decode batch: tensor cores
            if x.dtype == tl.float32:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        else:  # 2 to 8 rows (batch 1 takes gemv1_kernel)
            acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    ptrs = y_ptr + rm[:, None] * N + col[None, :]
    mask = (rm[:, None] < M) & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc, mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask)


@triton.jit
def gemv1_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, N, K,
                 GROUP: tl.constexpr, W: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    # batch 1 (the decode of one sequence): each program streams a [K/SPLIT_K, W] slab of packed
    # words once and keeps the 8 nibbles of a word as a third axis, so no tile is reshaped (a
    # reshape of [BLOCK_K, W, 8] to [BLOCK_K, 8W] costs a layout conversion through shared memory
    # per tile). Per weight: shift, mask, convert, multiply-add; the zero point and scale come out
    # of the sum over a tile, which lies inside one group: Σ (q − z)·s·x = s·(Σ q·x − z·Σ x).
    NW = N // 8
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rw = pid_n * W + tl.arange(0, W)  # packed word columns [W]
    lane = tl.arange(0, 8)
    shift = lane * 4
    col = rw[:, None] * 8 + ((lane % 4) * 2 + lane // 4)[None, :]  # [W, 8]: AWQ_ORDER[i] = 2(i%4) + i//4
    word_ok = rw < NW
    acc = tl.zeros((W, 8), dtype=tl.float32)
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    for k0 in range(pid_k * k_per, tl.minimum((pid_k + 1) * k_per, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)  # [BLOCK_K]
        packed = tl.load(qw_ptr + rk[:, None].to(tl.int64) * NW + rw[None, :],
                         mask=(rk[:, None] < K) & word_ok[None, :], other=0)  # [BLOCK_K, W]
        q = ((packed[:, :, None] >> shift[None, None, :]) & 0xF).to(tl.float32)  # [BLOCK_K, W, 8]
        part = tl.sum(q * x[:, None, None], axis=0)  # [W, 8]
        g = k0 // GROUP
        zp = tl.load(qz_ptr + g * NW + rw, mask=word_ok, other=0)
        z = ((zp[:, None] >> shift[None, :]) & 0xF).to(tl.float32)  # [W, 8]
        sc = tl.load(s_ptr + g * N + col, mask=word_ok[:, None], other=0.0).to(tl.float32)
        acc += sc * (part - z * tl.sum(x, axis=0))
    ptrs = y_ptr + col
    if SPLIT_K == 1:
        tl.store(ptrs, acc, mask=word_ok[:, None])
    else:
        tl.atomic_add(ptrs, acc, mask=word_ok[:, None])


@triton.jit
def _awq_pairs(w):
    # one AWQ-packed word (nibble i holds column AWQ_ORDER[i] = 2(i%4) + i//4 of its 8) → 2^10 plus
    # each of its 8 codes as fp16, natural column order, two a LOP3: nibbles k and k + 4 are
    # columns 2k and 2k + 1, so (w >> 4k) & 0x000F000F | 0x64006400 is that fp16 pair
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b32 t, m;
        lop3.b32 t, $8, 0x000F000F, 0x64006400, 0xea; mov.b32 {$0, $1}, t;
        shr.u32 m, $8, 4; lop3.b32 t, m, 0x000F000F, 0x64006400, 0xea; mov.b32 {$2, $3}, t;
        shr.u32 m, $8, 8; lop3.b32 t, m, 0x000F000F, 0x64006400, 0xea; mov.b32 {$4, $5}, t;
        shr.u32 m, $8, 12; lop3.b32 t, m, 0x000F000F, 0x64006400, 0xea; mov.b32 {$6, $7}, t; }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r", args=[w], dtype=(tl.float16,) * 8, is_pure=True, pack=1)


@triton.jit
def _biased_codes(words, PAIRS: tl.constexpr):
    # AWQ-packed words [R, W] → 2^10 + their codes [R, 8W] as fp16 (exact) in natural column order:
    # by _awq_pairs on a GPU (PAIRS), by shifts elsewhere (the interpreter runs no inline PTX). The
    # bias cancels exactly in q − z (both in [1024, 1039])
    R: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    if PAIRS:
        v0, v1, v2, v3, v4, v5, v6, v7 = _awq_pairs(words)
        # element (j0, j1, j2) = v[4·j0 + 2·j1 + j2]: natural order once reshaped
        vals = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
        return tl.reshape(vals, (R, 8 * W))
    j = tl.arange(0, 8)
    shift = ((j % 2) * 4 + j // 2) * 4  # column j of a word sits in nibble (j % 2)·4 + j // 2
    return tl.reshape(((words[:, :, None] >> shift[None, None, :]) & 0xF) + 1024, (R, 8 * W)).to(tl.float16)


@triton.jit
def gemv_mma_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, M, N, K,
                    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                    PAIRS: tl.constexpr):
    # decode (M ≤ 16 rows, padded to the 16 a tensor-core product takes): each program streams a
    # [K/SPLIT_K, BLOCK_N/8] slab of packed words once; a word's codes become fp16 (2^10 + q) two an
    # instruction (PAIRS), the tile W = (q − z)·s in x's type goes to a tensor-core dot with the
    # 16 rows of x, and columns are in natural order (the pairs put them there), so scales, zeros
    # and the output are read and written contiguously. A BLOCK_K tile lies inside one group.
    W: tl.constexpr = BLOCK_N // 8
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, 16)
    rw = pid_n * W + tl.arange(0, W)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    word_ok = rw < N // 8
    col_ok = rn < N
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    for k0 in range(pid_k * k_per, tl.minimum((pid_k + 1) * k_per, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        packed = tl.load(qw_ptr + rk[:, None].to(tl.int64) * (N // 8) + rw[None, :],
                         mask=(rk[:, None] < K) & word_ok[None, :], other=0)
        g = k0 // GROUP
        zp = tl.load(qz_ptr + g * (N // 8) + rw, mask=word_ok, other=0)
        sc = tl.load(s_ptr + g * N + rn, mask=col_ok, other=0.0)
        q = _biased_codes(packed, PAIRS)  # [BLOCK_K, BLOCK_N]
        z = tl.reshape(_biased_codes(zp[None, :], PAIRS), (BLOCK_N,))
        if x.dtype == tl.float32:
            acc += tl.dot(x, (q - z[None, :]).to(tl.float32) * sc.to(tl.float32)[None, :], input_precision="ieee")
        else:
            acc += tl.dot(x, ((q - z[None, :]) * sc[None, :]).to(x.dtype))
    ptrs = y_ptr + rm[:, None] * N + rn[None, :]
    mask = (rm[:, None] < M) & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc, mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")


def gemv_mma_configs() -> list[triton.Config]:
    # (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages): Appendix B of the GPU review compiled 256 × 64 × 4
    # stages at 4.5 lane-instructions a weight; split-K fills the SMs at N = 4096 (16 column blocks).
    # Each compiled for sm_90 at 3.9-4.4 lane-instructions a weight, none spilling
    # (benchmarks/kernel_resources.py; 128 × 64 took 5.1, 256 × 128 at 8 warps spilled)
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w, num_stages=st)
            for bn, bk, sk, w, st in ((256, 64, 8, 4, 4), (256, 64, 4, 4, 4), (256, 64, 16, 4, 3), (128, 128, 8, 4, 3),
                                      (128, 128, 16, 4, 3), (256, 64, 2, 4, 4))]


def gemv1_configs() -> list[triton.Config]:
    # (words per program, K tile, split-K, warps, stages). N = 4096 has 512 packed words: 16 words
    # a program and split-K 8 make 256 programs for 132 SMs; N = 14336 (1792 words) needs less
    # split-K. A K tile divides the group size 128 so that its zeros and scales are one row.
    return [triton.Config({"W": w, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=nw, num_stages=st)
            for w, bk, sk, nw, st in ((16, 64, 8, 4, 4), (16, 128, 8, 8, 3), (32, 32, 8, 4, 4), (16, 32, 16, 4, 4),
                                      (8, 128, 4, 4, 3), (32, 64, 4, 8, 3), (16, 64, 2, 4, 4), (16, 128, 1, 8, 3),
                                      # fewer stages: fewer registers (the 4-stage 4-warp tiles take 253)
                                      (16, 32, 8, 4, 2), (8, 64, 8, 4, 2), (32, 32, 8, 8, 3))]


GEMM_TILES = ((16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 8, 3),
              (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 256, 128, 8, 3))


@triton.jit
def dequant_kernel(qw_ptr, qz_ptr, s_ptr, w_ptr, N, K,
                   GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    # a long prefill: W [K, N] = (q − z)·s written once in w's dtype and natural column order, for
    # torch's matmul (cuBLAS) to multiply. Each element of a [BLOCK_K, BLOCK_N] tile loads the word
    # that holds it (8 neighbours share one, from L1), so the stores are whole contiguous rows:
    # on an H200 2.2 TB/s at BLOCK_K 2 × BLOCK_N 1024, against 0.33 TB/s for a first version that
    # kept a word's 8 nibbles as a tile axis (benchmarks/results/gpu, run 7's sweep)
    rk = (tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)  # rk·N passes 2³¹ at K·N > 2³¹
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, rk, rn, N, K, GROUP)
    tl.store(w_ptr + rk[:, None] * N + rn[None, :], w.to(w_ptr.dtype.element_ty),
             mask=(rk[:, None] < K) & (rn[None, :] < N))


SMEM_BUDGET = 200 * 1024  # bytes of pipelined tiles per program; Hopper allows 227 KiB


def gemm_stage_bytes(bm: int, bn: int, bk: int, x_bytes: int) -> int:
    """Shared memory one pipeline stage of gemm_kernel holds: the x tile, and the packed words,
    zeros and scales, each loaded per element as a [BLOCK_K, BLOCK_N] tile (int32, int32, and
    scales as wide as x at most 4 bytes)."""
    return bm * bk * x_bytes + bk * bn * (4 + 4 + x_bytes)


def gemm_configs(x_bytes: int = 2) -> list[triton.Config]:
    """Tiles for 2-byte inputs as tuned for Hopper; for fp32 inputs (x_bytes 4) the stages are cut
    until stages × stage bytes fit SMEM_BUDGET, and tiles that do not fit at one stage are left
    out (on an H200 every fp32 configuration with the fp16 stages asked for more shared memory
    than the SM has, and the launch failed)."""
    out = []
    for bm, bn, bk, w, st in GEMM_TILES:
        per = gemm_stage_bytes(bm, bn, bk, x_bytes)
        if x_bytes > 2:
            st = min(st, SMEM_BUDGET // per)
            if st < 1:
                continue
        out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st))
    return out


def gemv_configs() -> list[triton.Config]:
    # Hopper: 132 SMs. At batch 1 a 4096-wide layer has only 4096 / BLOCK_N column blocks, so
    # split-K multiplies the programs (N=4096, BLOCK_N=128: 32 blocks × SPLIT_K 8 = 256 programs);
    # BLOCK_K divides the group size 128 so that a tile's zeros and scales are one row.
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w, num_stages=st)
            # Each compiled for sm_90 without register spills at M_PAD 2, 4, 8 and 16 (cuobjdump
            # -res-usage) with N and K unspecialized; specialized as multiples of 16, as an 8B launch
            # is, four spill at M_PAD 8 (benchmarks/kernel_resources.py). 128×128, 256×128 and 512×64
            # tiles spilled at some M_PAD: left out. On CUDA with 16-bit x, gemv_mma serves instead.
            for bn, bk, sk, w, st in ((128, 64, 1, 8, 4), (64, 128, 1, 4, 3), (128, 64, 4, 8, 4), (64, 128, 4, 4, 3),
                                      (128, 64, 8, 8, 4), (256, 64, 8, 8, 4), (64, 128, 16, 4, 3), (128, 64, 16, 8, 3),
                                      (256, 32, 16, 8, 4), (128, 32, 32, 4, 4))]


_autotuned: dict[str, object] = {}
CACHE_TUNING = True  # keep tuned configurations on disk (Triton's cache_results) where this Triton can


def m_bucket(M: int) -> int:
    """The autotuning bucket of a prefill of M rows: the next power of two."""
    return 1 << (M - 1).bit_length()


def autotuned(name: str) -> Any:  # a triton Autotuner (a kernel handle; triton ships no types)
    """The kernel wrapped in @triton.autotune (CUDA only: the tuner times configs on the device),
    keyed on M's bucket (the gemm: M_BUCKET; the gemv: M_PAD), never on the exact M. The gemv's
    split-K accumulates into y, so the tuner zeroes y before each trial. Where this Triton can,
    the timings are cached on disk too, so a new process does not tune again."""
    if name not in _autotuned:
        can = "cache_results" in inspect.signature(triton.autotune).parameters
        extra = {"cache_results": True} if CACHE_TUNING and can else {}
        if name in ("gemm", "gemm_fp32"):
            configs = gemm_configs(4 if name == "gemm_fp32" else 2)
            _autotuned[name] = triton.autotune(configs, key=["M_BUCKET", "N", "K"], **extra)(gemm_kernel)
        elif name == "gemv_mma":
            _autotuned[name] = triton.autotune(gemv_mma_configs(), key=["N", "K"], reset_to_zero=["y_ptr"],
                                               **extra)(gemv_mma_kernel)
        elif name == "gemv1":
            _autotuned[name] = triton.autotune(gemv1_configs(), key=["N", "K"], reset_to_zero=["y_ptr"],
                                               **extra)(gemv1_kernel)
        else:
            _autotuned[name] = triton.autotune(gemv_configs(), key=["M_PAD", "N", "K"],
                                               reset_to_zero=["y_ptr"], **extra)(gemv_kernel)
    return _autotuned[name]
