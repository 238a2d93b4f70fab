"""TurboQuant KV cache on the GPU: quantize-on-write and decode attention in the rotated domain.

Layout of one cached vector (head_dim D, b bits): its rotated unit vector's code indices as b
bit-planes of 32-channel words — codes [b, D/32] int32, bit k of the code of channel 32w + j is
bit j of plane k, word w — exactly b bits per element with power-of-two tensor shapes; plus the
vector's norm (fp32 here; 16 bits in the memory accounting).

write_slots: new keys and values [B, Hkv, T, D] coded straight into the cache at a device tensor of
slots, codes, norms and the rotated-domain values the torch path reads, in one launch (capturable);
quantize_on_write: x [N, D] → (codes [N, b, D/32] int32, norms [N]), the same kernel into fresh
buffers. The caller rotates nothing.
decode_attention: q [B, H, D] (one new token per sequence) against the cached codes of keys and
values [B, Hkv, S, b, D/32] with norms [B, Hkv, S] and per-sequence lengths; the query is rotated
once (Π·q), scores are taken against codebook values, Σ p·ĉ·‖v‖ accumulates in the rotated
domain, and the output is rotated back once. GQA: query head h reads kv head h // (H/Hkv).
Split-K over the sequence, grouped by KV head (decode.py): the query heads of a KV head are
rotated inside the kernel, and the merge rotates the output back.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from engines.kernels.decode import Tuning, head_strides, launch
from engines.quant import codebook_on, rotation_on

# the fastest in the H200 sweep at 3 bits (benchmarks/results/gpu); 4 bits spill at 128-slot tiles
TUNING = {2: Tuning(128, 8), 3: Tuning(128, 8), 4: Tuning(64, 8)}

WRITE_WARPS = 4  # 90 registers, no spills at D = 128 on sm_90 (benchmarks/kernel_resources.py)

_kernels: dict[str, object] = {}


def rotation_and_codebook(d: int, bits: int, seed: int,
                          device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Π [d, d] and the Lloyd-Max codebook [2^bits] on `device`, made once per device."""
    return rotation_on(d, seed, device), codebook_on(d, bits, device)


@functools.lru_cache
def _codebook_polynomial(d: int, bits: int, device: str) -> torch.Tensor:
    book = codebook_on(d, bits, "cpu").double()
    if not torch.allclose(book, -book.flip(0)):
        raise ValueError(f"the {bits}-bit codebook for d={d} is not symmetric: no odd polynomial through it")
    half = 2 ** (bits - 1)
    x = torch.arange(half, 2 * half, dtype=torch.float64) - (2 * half - 1) / 2  # the positive half
    powers = torch.stack([x ** (2 * k + 1) for k in range(half)], 1)
    return torch.linalg.solve(powers, book[half:]).float().to(device)


def codebook_polynomial(d: int, bits: int, device: str | torch.device) -> torch.Tensor:
    """The odd polynomial through the codebook: coefficients a₁, a₃, … [2^(bits−1)] with
    c[j] = Σ_k a_(2k+1)·x^(2k+1), x = j − (2^bits − 1)/2 (the codebook is symmetric, so its
    positive half fixes them; solved in float64). In fp32 it gives the codebook exactly at 1–3
    bits and within 1e-7 at 4 (tests/kernels/test_turbo_kv.py): the decode kernel computes
    codebook values with it instead of selecting among 2^bits constants."""
    return _codebook_polynomial(d, bits, str(device))


# -- torch references --------------------------------------------------------------------------
def pack_bitplanes(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """idx [..., D] ints < 2^bits → [..., bits, D/32] int32 bit-planes."""
    *lead, D = idx.shape
    lanes = idx.to(torch.int64).reshape(*lead, D // 32, 32)
    planes = [((lanes >> k) & 1) << torch.arange(32, dtype=torch.int64, device=idx.device) for k in range(bits)]
    words = torch.stack([p.sum(-1) for p in planes], dim=-2)  # [..., bits, D/32]
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_bitplanes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    *lead, b, W = codes.shape
    # words: [..., b, W, 32]
    words = codes.to(torch.int64)[..., None] >> torch.arange(32, dtype=torch.int64, device=codes.device)
    idx = sum(((words[..., k, :, :] & 1) << k) for k in range(bits))
    return idx.reshape(*lead, W * 32)  # type: ignore[union-attr]  # bits ≥ 1, so the sum is a tensor


def quantize_reference(x: torch.Tensor, bits: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    rot, book = rotation_and_codebook(d, bits, seed, x.device)
    xf = x.float()
    norm = xf.norm(dim=-1)
    u = (xf / norm[..., None].clamp(min=1e-12)) @ rot.T
    idx = (u[..., None] - book).abs().argmin(-1)
    return pack_bitplanes(idx, bits), norm


def dequantize_rotated(codes: torch.Tensor, norms: torch.Tensor, bits: int) -> torch.Tensor:
    """Rotated-domain values ĉ·‖x‖ [..., D]."""
    _, book = rotation_and_codebook(codes.shape[-1] * 32, bits, 0, codes.device)
    return book[unpack_bitplanes(codes, bits)] * norms[..., None]


def decode_attention_reference(q: torch.Tensor, k_codes: torch.Tensor, k_norms: torch.Tensor, v_codes: torch.Tensor,
                               v_norms: torch.Tensor, lengths: torch.Tensor, bits: int, seed: int = 0) -> torch.Tensor:
    B, H, D = q.shape
    Hkv = k_codes.shape[1]
    rot, _ = rotation_and_codebook(D, bits, seed, q.device)
    kr = dequantize_rotated(k_codes, k_norms, bits)  # [B, Hkv, S, D]
    vr = dequantize_rotated(v_codes, v_norms, bits)
    kr, vr = kr.repeat_interleave(H // Hkv, 1), vr.repeat_interleave(H // Hkv, 1)
    qr = q.float() @ rot.T
    scores = torch.einsum("bhd,bhsd->bhs", qr, kr) / math.sqrt(D)
    S = kr.shape[2]
    valid = torch.arange(S, device=q.device)[None, :] < lengths[:, None]
    p = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), -1)
    return (torch.einsum("bhs,bhsd->bhd", p, vr) @ rot).to(q.dtype)


# -- Triton ----------------------------------------------------------------------------------------
def _get() -> tuple[Any, Any]:  # (write_kernel, attention_kernel): Triton kernel handles
    if not _kernels:
        from engines.kernels import _turbo_kv_triton as k

        _kernels["write"], _kernels["attention"] = k.write_kernel, k.attention_kernel
    return _kernels["write"], _kernels["attention"]


def write_slots(xs: Sequence[torch.Tensor], slots: torch.Tensor, codes: torch.Tensor, norms: torch.Tensor,
                dequantized: Sequence[torch.Tensor] | None, bits: int, seed: int = 0, block_n: int = 16) -> None:
    """Quantize-on-write of new cache entries in one launch: xs, the keys and the values (or one
    tensor), each [B, Hkv, T, D] (channels contiguous), at `slots` [T] (on the device: no host
    sync, capturable) of codes [len(xs), B, Hkv, S, bits, D/32] int32, norms [len(xs), B, Hkv, S]
    fp32 and, if given, dequantized (one [B, Hkv, S, D] tensor per x, one layout: the
    rotated-domain value ĉ·‖x‖ that the torch attention reads, in its dtype). All written in place."""
    B, Hkv, T, D = xs[0].shape
    if D % 32 or D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two ≥ 32 for the packed TurboQuant layout")
    if len(xs) not in (1, 2) or any(x.shape != xs[0].shape or x.stride(-1) != 1 for x in xs):
        raise ValueError("write_slots takes one or two [B, Hkv, T, D] tensors with contiguous channels")
    if slots.shape != (T,) or slots.device != xs[0].device:
        raise ValueError(f"write_slots needs slots [{T}] on {xs[0].device}, one per new token; "
                         f"got {tuple(slots.shape)}")
    if (codes.shape[0] != len(xs) or codes.shape[1:3] != (B, Hkv) or codes.shape[-2:] != (bits, D // 32)
            or codes.stride(-1) != 1 or codes.stride(-2) != D // 32 or codes.dtype != torch.int32):
        raise ValueError(f"write_slots needs int32 codes [{len(xs)}, {B}, {Hkv}, S, {bits}, {D // 32}] "
                         "with whole code rows")
    if norms.shape[:3] != (len(xs), B, Hkv) or norms.shape[3] != codes.shape[3] or norms.dtype != torch.float32:
        raise ValueError(f"write_slots needs fp32 norms [{len(xs)}, {B}, {Hkv}, S] beside the codes")
    if dequantized is not None and any(d.shape != (B, Hkv, codes.shape[3], D) for d in dequantized):
        raise ValueError(f"write_slots needs dequantized buffers [{B}, {Hkv}, S, {D}] beside the codes")
    if any(t.device != xs[0].device for t in (codes, norms, *(dequantized or ()))):
        raise ValueError("write_slots needs every buffer on the device of the new values")
    if dequantized is not None and (len(dequantized) != len(xs) or any(
            d.stride() != dequantized[0].stride() or d.stride(-1) != 1 for d in dequantized)):
        raise ValueError("write_slots needs one dequantized buffer per tensor, all of one layout, channels contiguous")
    write, _ = _get()
    rot, book = rotation_and_codebook(D, bits, seed, xs[0].device)
    dq = list(dequantized) if dequantized is not None else [norms, norms]  # pointers the kernel never stores to
    x, y = xs[0], xs[-1]
    N = B * Hkv * T
    write[(math.ceil(N / block_n), D // 32, len(xs))](
        x, y, slots, rot, book, codes, norms, dq[0], dq[-1], N, T, Hkv, *x.stride()[:3], *y.stride()[:3],
        *codes.stride()[:4], *norms.stride()[:4],
        *(dequantized[0].stride()[:3] if dequantized is not None else (0, 0, 0)),
        D=D, BITS=bits, BLOCK_N=block_n, DEQUANT=dequantized is not None, num_warps=WRITE_WARPS)


def quantize_on_write(x: torch.Tensor, bits: int, seed: int = 0,
                      block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] → (codes [N, bits, D/32] int32, norms [N] fp32). D must be a multiple of 32."""
    N, D = x.shape
    codes = torch.empty(1, 1, 1, N, bits, D // 32, dtype=torch.int32, device=x.device)
    norms = torch.empty(1, 1, 1, N, dtype=torch.float32, device=x.device)
    write_slots([x.contiguous()[None, None]], torch.arange(N, device=x.device), codes, norms, None, bits, seed, block_n)
    return codes[0, 0, 0], norms[0, 0, 0]


def decode_attention(q: torch.Tensor, k_codes: torch.Tensor, k_norms: torch.Tensor, v_codes: torch.Tensor,
                     v_norms: torch.Tensor, lengths: torch.Tensor, bits: int, seed: int = 0,
                     chunks: int | None = None, block_s: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> torch.Tensor:
    """q [B, H, D]; codes [B, Hkv, S, bits, D/32]; norms [B, Hkv, S] fp32; lengths [B] → [B, H, D]
    in q's dtype. A [:, :, :S] slice of a wider cache is read in place. chunks, block_s,
    num_warps: decode.launch's defaults unless given."""
    B, H, D = q.shape
    Hkv, S = k_codes.shape[1], k_codes.shape[2]
    if k_codes.stride() != v_codes.stride() or k_norms.stride() != v_norms.stride():
        raise ValueError("keys and values must share one layout")
    _, attention = _get()
    rot = rotation_on(D, seed, q.device)
    csb, csh = head_strides(k_codes)
    nsb, nsh = head_strides(k_norms)
    poly = codebook_polynomial(D, bits, q.device)
    return launch(attention, q, Hkv, S, [k_codes, k_norms, v_codes, v_norms, lengths, poly, rot],
                  dict(HKV=Hkv, S=S, code_sb=csb, code_sh=csh, norm_sb=nsb, norm_sh=nsh, scale=1.0 / math.sqrt(D),
                       BITS=bits), TUNING[bits],
                  rotation=rot, chunks=chunks, block_s=block_s, num_warps=num_warps, num_stages=num_stages)
