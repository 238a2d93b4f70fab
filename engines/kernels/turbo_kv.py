"""TurboQuant KV cache on the GPU: quantize-on-write and decode attention in the rotated domain.

Layout of one cached vector (head_dim D, b bits): its rotated unit vector's code indices in F-bit
fields of int32 words — codes [D·F/32] int32, channel c in bits F·(c mod 32/F) of word c // (32/F),
F = field_bits(b): 2 at 2 bits, a nibble at 3 and 4 (3-bit codes are stored in 4 bits, so that the
decode kernel can look their values up by byte permutes) — plus the vector's norm (fp32 here; 16
bits in the memory accounting).

write_slots: new keys and values [B, Hkv, T, D] coded straight into the cache at a device tensor of
slots, codes, norms and the rotated-domain values the torch path reads, in one launch (capturable);
quantize_on_write: x [N, D] → (codes [N, D·F/32] int32, norms [N]), the same kernel into fresh
buffers. The caller rotates nothing.
decode_attention: q [B, H, D] (one new token per sequence) against the cached codes of keys and
values [B, Hkv, S, D·F/32] with norms [B, Hkv, S] and per-sequence lengths; the query is rotated
once (Π·q), scores are taken against codebook values, Σ p·ĉ·‖v‖ accumulates in the rotated
domain, and the output is rotated back once. GQA: query head h reads kv head h // (H/Hkv).
Split-K over the sequence, grouped by KV head (decode.py): the query heads of a KV head are
rotated inside the kernel, and the merge rotates the output back. On a GPU at 3 bits (fp16 or bf16
queries) the kernel reads codebook values by byte permutes, 8 codes a word (byte_lookup); elsewhere
it computes them with the codebook's odd polynomial (codebook_polynomial).
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

WRITE_WARPS = 4  # 106 registers, no spills at D = 128 on sm_90 (benchmarks/kernel_resources.py, Triton 3.9)

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


def field_bits(bits: int) -> int:
    """The width of one code's field in a code word: 2 bits for 2-bit codes, 4 (a nibble) for 3-
    and 4-bit ones, so that fields never straddle words and a word holds 32/F whole codes."""
    if bits not in (2, 3, 4):
        raise ValueError(f"the TurboQuant kernels take 2-, 3- or 4-bit codes; got {bits}")
    return 2 if bits == 2 else 4


def byte_lookup(bits: int, dtype: torch.dtype, device: str | torch.device) -> bool:
    """Whether the decode kernel reads codebook values by byte permutes (PRMT, inline PTX): on a
    CUDA device, for 3-bit codes (8 entries, each code a nibble whose top bit is clear: a PRMT
    selector), into a 16-bit type. Elsewhere (the interpreter, an fp32 model, 2 or 4 bits) it
    computes them with the odd polynomial."""
    return torch.device(device).type == "cuda" and bits == 3 and dtype in (torch.float16, torch.bfloat16)


@functools.lru_cache
def _lookup_bytes(d: int, bits: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    book = codebook_on(d, bits, "cpu").to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    entries = [int(v) for v in book] + [0] * (8 - len(book))
    lo, hi = [e & 0xFF for e in entries], [e >> 8 for e in entries]

    def word(b: list[int]) -> int:  # four bytes, the first lowest, as a signed int32
        w = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
        return w - (1 << 32) if w >= 1 << 31 else w

    return word(lo[:4]), word(lo[4:]), word(hi[:4]), word(hi[4:])


def lookup_bytes(d: int, bits: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """The codebook in `dtype` as the four int32 words the byte-permute lookup selects from: the
    low bytes of entries 0-3 and 4-7, then their high bytes (entries past 2^bits are 0)."""
    return _lookup_bytes(d, bits, dtype)


# -- torch references --------------------------------------------------------------------------
def pack_codes(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """idx [..., D] ints < 2^bits → [..., D·F/32] int32 code words (F = field_bits(bits))."""
    *lead, D = idx.shape
    F = field_bits(bits)
    fields = idx.to(torch.int64).reshape(*lead, D * F // 32, 32 // F)
    words = (fields << (F * torch.arange(32 // F, dtype=torch.int64, device=idx.device))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [..., D·F/32] int32 → the code indices [..., D] (int64)."""
    *lead, W = codes.shape
    F = field_bits(bits)
    fields = (codes.to(torch.int64)[..., None] >> (F * torch.arange(32 // F, dtype=torch.int64, device=codes.device)))
    return (fields & ((1 << F) - 1)).reshape(*lead, W * (32 // F))


def code_words(d: int, bits: int) -> int:
    """Code words per cached vector of head_dim d at `bits` bits."""
    return d * field_bits(bits) // 32


def quantize_reference(x: torch.Tensor, bits: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    rot, book = rotation_and_codebook(d, bits, seed, x.device)
    xf = x.float()
    norm = xf.norm(dim=-1)
    u = (xf / norm[..., None].clamp(min=1e-12)) @ rot.T
    idx = (u[..., None] - book).abs().argmin(-1)
    return pack_codes(idx, bits), norm


def dequantize_rotated(codes: torch.Tensor, norms: torch.Tensor, bits: int) -> torch.Tensor:
    """Rotated-domain values ĉ·‖x‖ [..., D]."""
    _, book = rotation_and_codebook(codes.shape[-1] * 32 // field_bits(bits), bits, 0, codes.device)
    return book[unpack_codes(codes, bits)] * norms[..., None]


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
                dequantized: Sequence[torch.Tensor] | None, bits: int, seed: int = 0, block_n: int = 16,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Quantize-on-write of new cache entries in one launch: xs, the keys and the values (or one
    tensor), each [B, Hkv, T, D] (channels contiguous), at `slots` [T] (on the device: no host
    sync, capturable) of codes [len(xs), B, Hkv, S, D·F/32] int32, norms [len(xs), B, Hkv, S]
    fp32 and, if given, dequantized (one [B, Hkv, S, D] tensor per x, one layout: the
    rotated-domain value ĉ·‖x‖ that the torch attention reads, in its dtype). All written in place.
    rope: (cos, sin) [B, 1, T, D] (model.rope_cos_sin's): the keys, xs[0], are rotated by RoPE as the
    kernel reads them (the fused decode step's RoPE + quantize-on-write), as model.apply_rope would."""
    B, Hkv, T, D = xs[0].shape
    if D % 32 or D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two ≥ 32 for the packed TurboQuant layout")
    if len(xs) not in (1, 2) or any(x.shape != xs[0].shape or x.stride(-1) != 1 for x in xs):
        raise ValueError("write_slots takes one or two [B, Hkv, T, D] tensors with contiguous channels")
    if slots.shape != (T,) or slots.device != xs[0].device:
        raise ValueError(f"write_slots needs slots [{T}] on {xs[0].device}, one per new token; "
                         f"got {tuple(slots.shape)}")
    W = code_words(D, bits)
    if (codes.dim() != 5 or codes.shape[0] != len(xs) or codes.shape[1:3] != (B, Hkv) or codes.shape[-1] != W
            or codes.stride(-1) != 1 or codes.dtype != torch.int32):
        raise ValueError(f"write_slots needs int32 codes [{len(xs)}, {B}, {Hkv}, S, {W}] with whole code rows")
    if norms.shape[:3] != (len(xs), B, Hkv) or norms.shape[3] != codes.shape[3] or norms.dtype != torch.float32:
        raise ValueError(f"write_slots needs fp32 norms [{len(xs)}, {B}, {Hkv}, S] beside the codes")
    if dequantized is not None and any(d.shape != (B, Hkv, codes.shape[3], D) for d in dequantized):
        raise ValueError(f"write_slots needs dequantized buffers [{B}, {Hkv}, S, {D}] beside the codes")
    if any(t.device != xs[0].device for t in (codes, norms, *(dequantized or ()))):
        raise ValueError("write_slots needs every buffer on the device of the new values")
    if dequantized is not None and (len(dequantized) != len(xs) or any(
            d.stride() != dequantized[0].stride() or d.stride(-1) != 1 for d in dequantized)):
        raise ValueError("write_slots needs one dequantized buffer per tensor, all of one layout, channels contiguous")
    if rope is not None and (rope[0].shape != (B, 1, T, D) or rope[1].stride() != rope[0].stride()
                             or rope[0].stride(-1) != 1):
        raise ValueError(f"write_slots needs rope's cos and sin [{B}, 1, {T}, {D}] of one layout")
    write, _ = _get()
    rot, book = rotation_and_codebook(D, bits, seed, xs[0].device)
    cos, sin = rope if rope is not None else (norms, norms)  # pointers the kernel never reads without ROPE
    dq = list(dequantized) if dequantized is not None else [norms, norms]  # pointers the kernel never stores to
    x, y = xs[0], xs[-1]
    N = B * Hkv * T
    from engines.kernels.launches import run

    run(write, (math.ceil(N / block_n), D // 32, len(xs)),
        x, y, slots, rot, book, codes, norms, dq[0], dq[-1], cos, sin, N, T, Hkv, *x.stride()[:3], *y.stride()[:3],
        *codes.stride()[:4], *norms.stride()[:4],
        *(dequantized[0].stride()[:3] if dequantized is not None else (0, 0, 0)),
        *((cos.stride(0), cos.stride(2)) if rope is not None else (0, 0)),
        D=D, BITS=bits, F=field_bits(bits), BLOCK_N=block_n, DEQUANT=dequantized is not None, ROPE=rope is not None,
        num_warps=WRITE_WARPS)


def quantize_on_write(x: torch.Tensor, bits: int, seed: int = 0,
                      block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] → (codes [N, D·F/32] int32, norms [N] fp32). D must be a multiple of 32."""
    N, D = x.shape
    codes = torch.empty(1, 1, 1, N, code_words(D, bits), dtype=torch.int32, device=x.device)
    norms = torch.empty(1, 1, 1, N, dtype=torch.float32, device=x.device)
    write_slots([x.contiguous()[None, None]], torch.arange(N, device=x.device), codes, norms, None, bits, seed, block_n)
    return codes[0, 0, 0], norms[0, 0, 0]


def decode_attention(q: torch.Tensor, k_codes: torch.Tensor, k_norms: torch.Tensor, v_codes: torch.Tensor,
                     v_norms: torch.Tensor, lengths: torch.Tensor, bits: int, seed: int = 0,
                     chunks: int | None = None, block_s: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [B, H, D] (heads and channels contiguous: a view of the fused q/k/v output is read in
    place); codes [B, Hkv, S, D·F/32]; norms [B, Hkv, S] fp32; lengths [B] → [B, H, D] in q's
    dtype. A [:, :, :S] slice of a wider cache is read in place. chunks, block_s, num_warps:
    decode.launch's defaults unless given. rope: (cos, sin) [B, 1, 1, D] (model.rope_cos_sin's):
    q is rotated by RoPE in the kernel first (the fused decode step), as model.apply_rope would."""
    B, H, D = q.shape
    Hkv, S = k_codes.shape[1], k_codes.shape[2]
    if k_codes.stride() != v_codes.stride() or k_norms.stride() != v_norms.stride():
        raise ValueError("keys and values must share one layout")
    _, attention = _get()
    rot = rotation_on(D, seed, q.device)
    csb, csh = head_strides(k_codes)
    nsb, nsh = head_strides(k_norms)
    if any(c.shape[-1] != code_words(D, bits) or c.stride(-1) != 1 for c in (k_codes, v_codes)):
        raise ValueError(f"decode_attention needs codes [B, Hkv, S, {code_words(D, bits)}] with whole code rows "
                         f"at {bits} bits, head_dim {D}")
    poly = codebook_polynomial(D, bits, q.device)
    lut = byte_lookup(bits, q.dtype, q.device)
    la, lb, ha, hb = lookup_bytes(D, bits, q.dtype) if lut else (0, 0, 0, 0)
    if rope is not None and (rope[0].shape != (B, 1, 1, D) or rope[1].stride() != rope[0].stride()
                             or rope[0].stride(-1) != 1):
        raise ValueError(f"decode_attention needs rope's cos and sin [{B}, 1, 1, {D}] of one layout")
    cos, sin = rope if rope is not None else (rot, rot)  # pointers the kernel never reads without ROPE
    return launch(attention, q, Hkv, S, [k_codes, k_norms, v_codes, v_norms, lengths, poly, rot, cos, sin],
                  dict(HKV=Hkv, S=S, code_sb=csb, code_sh=csh, norm_sb=nsb, norm_sh=nsh, scale=1.0 / math.sqrt(D),
                       la=la, lb=lb, ha=ha, hb=hb, cos_sb=cos.stride(0) if rope is not None else 0, BITS=bits,
                       F=field_bits(bits), LUT=lut, ROPE=rope is not None), TUNING[bits],
                  rotation=rot, chunks=chunks, block_s=block_s, num_warps=num_warps, num_stages=num_stages,
                  strided_q=True)
