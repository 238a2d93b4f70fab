"""Decode attention on the GPU, the part every compressed KV format shares: one new query token per
sequence against a cache of S slots, split-K over the sequence, grouped by KV head.

- Grid (B·Hkv, chunks). One program serves the G = H/Hkv query heads of one KV head, so a KV tile
  is read and decoded once for all of them (GQA), and scores and values go through tensor-core
  products (_decode_triton.py). Tiles of BLOCK_S slots are dealt to the chunks round-robin, so the
  work is even at any length below S and none is done past a sequence's length.
- Each program leaves a partial (max, sum, accumulator) per query row; merge_kernel combines a
  row's chunks with a log-sum-exp merge and writes the output in the query's dtype (TurboQuant
  also rotates it back there). Two launches per call, nothing else on the device: no casts of the
  query or the lengths, and no copy of a cache passed as a strided slice.
- Scores are in log2 units throughout (the query carries scale·log2 e); merge_split_k is the
  merge's torch reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any

import torch

from engines.kernels import on_kernel_path

if TYPE_CHECKING:
    import triton.language as tl

GROUP_ROWS = 16  # query rows of one program: G padded to what a tensor-core product takes
PROGRAMS_PER_SM = 2  # split-K chunks: about this many programs per SM at batch 1


@dataclasses.dataclass(frozen=True)
class Tuning:
    """A kernel's launch shape on CUDA: slots per tile, warps, and software-pipeline stages. Each
    format keeps its own (its tile decodes to different register and shared-memory needs:
    benchmarks/kernel_resources.py compiles them for sm_90 and reports spills); off CUDA the
    interpreter runs 16-slot tiles, which it runs fastest."""

    block_s: int = 64
    num_warps: int = 4
    num_stages: int = 2


@functools.lru_cache
def _sm_count(device: str) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_chunks(S: int, rows: int, device: str | torch.device, block_s: int) -> int:
    """Split-K programs along the sequence for `rows` = B·Hkv programs across: enough that the grid
    holds about PROGRAMS_PER_SM programs per SM, and no more than there are BLOCK_S tiles (each
    chunk writes a [G, D] partial that the merge reads back, so tiny chunks add traffic)."""
    sms = _sm_count(str(device)) if torch.device(device).type == "cuda" else 4
    return max(1, min(math.ceil(S / block_s), math.ceil(PROGRAMS_PER_SM * sms / rows)))


def dot_type(dtype: torch.dtype) -> tl.dtype:
    """The tensor-core operand type for a query of `dtype`: half types as they are, fp32 as fp32
    with IEEE products (the fp32 reference engine keeps its precision)."""
    import triton.language as tl

    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(dtype, tl.float32)


def merge_split_k(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """The merge's torch reference. Per-chunk (max [R, C] in log2 units, sum [R, C], accumulator
    [R, C, D]) of an online softmax: out = Σ_c 2^(m_c − M)·acc_c / Σ_c 2^(m_c − M)·l_c,
    M = max_c m_c (empty chunks have m = −inf)."""
    M = m.max(dim=1, keepdim=True).values
    w = torch.exp2(m - M).nan_to_num(0.0)
    return (w[..., None] * acc).sum(1) / (w * l).sum(1, keepdim=True)


def head_strides(cache: torch.Tensor) -> tuple[int, int]:
    """(batch, head) strides of a cache [B, Hkv, S, ...] whose slots of one head are contiguous
    (a [:, :, :S] slice of a wider cache is): the kernels index it in place."""
    inner = cache[0, 0]
    if not inner.is_contiguous():
        raise ValueError(f"the slots of one KV head must be contiguous; got strides {tuple(cache.stride())}")
    return cache.stride(0), cache.stride(1)


def launch(kernel: Any, q: torch.Tensor, Hkv: int, S: int, args: list[torch.Tensor], consts: dict[str, object],
           tuning: Tuning, *, rotation: torch.Tensor | None = None, chunks: int | None = None,
           block_s: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
           strided_q: bool = False) -> torch.Tensor:
    """Run a grouped decode-attention kernel and the merge: q [B, H, D] → [B, H, D] in q's dtype.
    `args` are the kernel's arguments between the query and the partials' pointers (caches,
    lengths, …), `consts` the rest by name (HKV, S, strides, scale, the format's constexprs); D, G,
    GP, BLOCK_S and DOT are set here. rotation: Π [D, D], applied to the merged output. chunks,
    block_s, num_warps, num_stages: the format's `tuning` and split_k_chunks unless given.
    strided_q: the kernel reads q's rows by its batch stride (its `q_sb`), so a view of the fused
    q/k/v output ([B, H, D] with heads and channels contiguous) is passed without a copy."""
    from engines.kernels._decode_triton import merge_kernel
    from engines.kernels.launches import run

    B, H, D = q.shape
    if H % Hkv:
        raise ValueError(f"{H} query heads do not share {Hkv} KV heads evenly")
    G = H // Hkv
    if G > GROUP_ROWS:
        raise ValueError(f"at most {GROUP_ROWS} query heads per KV head; got {G}")
    block_s = block_s or (tuning.block_s if on_kernel_path(q) else 16)
    n = chunks or split_k_chunks(S, B * Hkv, q.device, block_s)
    if not strided_q or q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    if strided_q:
        consts = {**consts, "q_sb": q.stride(0)}
    m = torch.empty(B * H, n, device=q.device)
    l = torch.empty(B * H, n, device=q.device)
    acc = torch.empty(B * H, n, D, device=q.device)
    run(kernel, (B * Hkv, n), q, *args, m, l, acc, **consts, D=D, G=G, GP=GROUP_ROWS, BLOCK_S=block_s,
        DOT=dot_type(q.dtype), num_warps=num_warps or tuning.num_warps, num_stages=num_stages or tuning.num_stages)
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    run(merge_kernel, (B * H,), m, l, acc, rotation if rotation is not None else m, out, n, D=D,
        NCP=triton_next_pow2(n), ROTATE=rotation is not None, num_warps=4)
    return out


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


FLOAT_TUNING = Tuning(block_s=128, num_warps=4, num_stages=2)  # the fastest fp8 shape in the H200 sweep


def float_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                           chunks: int | None = None, block_s: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           tuning: Tuning = FLOAT_TUNING) -> torch.Tensor:
    """q [B, H, D]; k, v [B, Hkv, S, D] in a float type (fp16, bf16, fp32, or fp8 e4m3 widened in
    registers; a [:, :, :S] slice of a wider cache is read in place); lengths [B] (any integer
    type) → [B, H, D] in q's dtype. The reference engine's decode steps over a float or dequantized
    cache take it where kernels run (engines/reference/kv/base.py)."""
    from engines.kernels._decode_triton import float_attention_kernel

    B, H, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if k.stride() != v.stride() or k.dtype != v.dtype:
        raise ValueError("keys and values must share one layout and type")
    sb, sh = head_strides(k)
    return launch(float_attention_kernel, q, Hkv, S, [k, v, lengths],
                  dict(HKV=Hkv, S=S, stride_b=sb, stride_h=sh, scale=1.0 / math.sqrt(D)), tuning,
                  chunks=chunks, block_s=block_s, num_warps=num_warps, num_stages=num_stages)
