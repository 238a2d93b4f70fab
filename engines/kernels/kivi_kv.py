"""KIVI KV cache on the GPU: min-max quantize-on-write and decode attention over the two tiers.

Layout (head_dim D, b ∈ {2, 4} bits, group G = 32): codes packed 32/b per int32 along the
channels — codes [.., S, D·b/32] int32, channel c in word c // (32/b) at bit (c % (32/b))·b.
- keys: per channel over groups of G tokens (KIVI's key outliers live in channels):
  scale, zero [.., S/G, D] fp32;
- values: per token over groups of G channels: scale, zero [.., S, D/G] fp32.
Dequantized x̂ = q·scale + zero (zero is the group minimum), as engines.quant.minmax_quant.

decode_attention reads slot j's key compressed iff j < nk[b] and its value iff j < nv[b] (the
boundaries of kv.KiviKV), otherwise the full-precision residual k / v [B, Hkv, S, D]; grouped
split-K over the sequence (decode.py). Tiles wholly below both boundaries (nearly all, at long
context) fold the scales instead of dequantizing each element: a key group's per-channel scale
into the query and its zero into one offset, a value channel group's per-token scale into the
softmax weights and its zero into one offset per group; the codes go to the products as they are.
"""

from __future__ import annotations

import math

import torch

from engines.kernels.decode import Tuning, launch
from engines.kernels.launches import run

# one token group a tile, so that nearly every tile takes the loop that folds the scales into the
# query and the weights; 2 warps: 6.0 (2 bits) and 6.9 (4 bits) lane-instructions per element in that
# loop on sm_90, against 9.0 at 4 warps (benchmarks/kernel_resources.py). Before, 64-slot tiles at 4
# warps were the H200 sweep's fastest, and 2 pipeline stages made every shape ~4x slower (its loop
# had a data-dependent branch then); the 32-slot tile measured the same. Not yet timed on a GPU
TUNING = Tuning(block_s=32, num_warps=2, num_stages=1)


def pair_codes(dtype: torch.dtype, device: str | torch.device) -> bool:
    """Whether the decode kernel turns codes into floats two an instruction (inline PTX: a LOP3
    makes an fp16 pair 2^10 + q, a subtraction leaves q): on a CUDA device, for a 16-bit query.
    Elsewhere (the interpreter, an fp32 model) one code at a time by its bits."""
    return torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)

GROUP = 32


# -- torch references --------------------------------------------------------------------------
def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [..., D] ints < 2^bits → [..., D·bits/32] int32."""
    per = 32 // bits
    lanes = q.to(torch.int64).reshape(*q.shape[:-1], q.shape[-1] // per, per)
    words = (lanes << (torch.arange(per, dtype=torch.int64, device=q.device) * bits)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64, device=codes.device) * bits
    lanes = (codes.to(torch.int64)[..., None] >> shifts) & (2**bits - 1)
    return lanes.reshape(*codes.shape[:-1], codes.shape[-1] * per)


def _minmax(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo).clamp(min=1e-8) / (2**bits - 1)
    return torch.round((x - lo) / scale).clamp(0, 2**bits - 1), scale, lo


def quantize_keys_reference(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k [S, D], S a multiple of G → (codes [S, D·b/32], scale [S/G, D], zero [S/G, D])."""
    S, D = k.shape
    q, scale, lo = _minmax(k.float().reshape(S // GROUP, GROUP, D), bits, 1)
    return pack_codes(q.reshape(S, D), bits), scale[:, 0], lo[:, 0]


def quantize_values_reference(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v [N, D] → (codes [N, D·b/32], scale [N, D/G], zero [N, D/G])."""
    N, D = v.shape
    q, scale, lo = _minmax(v.float().reshape(N, D // GROUP, GROUP), bits, 2)
    return pack_codes(q.reshape(N, D), bits), scale[..., 0], lo[..., 0]


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [.., S, D·b/32], scale/zero [.., ⌈S/G⌉, D] → [.., S, D]."""
    q = unpack_codes(codes, bits).float()
    S = q.shape[-2]
    return q * scale.repeat_interleave(GROUP, -2)[..., :S, :] + zero.repeat_interleave(GROUP, -2)[..., :S, :]


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [.., S, D·b/32], scale/zero [.., S, D/G] → [.., S, D]."""
    q = unpack_codes(codes, bits).float()
    return q * scale.repeat_interleave(GROUP, -1) + zero.repeat_interleave(GROUP, -1)


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor,
                               kz: torch.Tensor, vc: torch.Tensor, vs: torch.Tensor, vz: torch.Tensor,
                               lengths: torch.Tensor, nk: torch.Tensor, nv: torch.Tensor, bits: int) -> torch.Tensor:
    """q [B, H, D]; k, v [B, Hkv, S, D] full precision; kc/vc codes; ks/kz [B, Hkv, ⌈S/G⌉, D];
    vs/vz [B, Hkv, S, D/G]; lengths, nk, nv [B] → [B, H, D]."""
    B, H, D = q.shape
    S = k.shape[2]
    j = torch.arange(S, device=q.device)[None, None, :, None]
    keys = torch.where(j < nk[:, None, None, None], dequantize_keys(kc, ks, kz, bits), k.float())
    values = torch.where(j < nv[:, None, None, None], dequantize_values(vc, vs, vz, bits), v.float())
    g = H // k.shape[1]
    keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), keys) / math.sqrt(D)
    valid = torch.arange(S, device=q.device)[None, :] < lengths[:, None]
    p = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), -1)
    return torch.einsum("bhs,bhsd->bhd", p, values).to(q.dtype)


# -- Triton launchers ------------------------------------------------------------------------------
def _check(D: int, bits: int) -> None:
    if bits not in (2, 4) or D % GROUP or D & (D - 1):
        raise ValueError(f"KIVI kernels need bits in (2, 4) and a power-of-two head_dim ≥ {GROUP}; "
                         f"got bits={bits}, D={D}")


def quantize_keys(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k [S, D], S a multiple of G (KIVI flushes whole token groups) → codes, scale, zero."""
    from engines.kernels._kivi_kv_triton import quantize_keys_kernel

    S, D = k.shape
    _check(D, bits)
    if S % GROUP:
        raise ValueError(f"keys are quantized in whole groups of {GROUP} tokens; got {S} tokens")
    codes = torch.empty(S, D * bits // 32, dtype=torch.int32, device=k.device)
    scale = torch.empty(S // GROUP, D, device=k.device)
    zero = torch.empty(S // GROUP, D, device=k.device)
    run(quantize_keys_kernel, (S // GROUP,), k.contiguous(), codes, scale, zero, D=D, G=GROUP, BITS=bits)
    return codes, scale, zero


def quantize_values(v: torch.Tensor, bits: int, block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v [N, D] → codes [N, D·b/32], scale [N, D/G], zero [N, D/G]."""
    from engines.kernels._kivi_kv_triton import quantize_values_kernel

    N, D = v.shape
    _check(D, bits)
    codes = torch.empty(N, D * bits // 32, dtype=torch.int32, device=v.device)
    scale = torch.empty(N, D // GROUP, device=v.device)
    zero = torch.empty(N, D // GROUP, device=v.device)
    run(quantize_values_kernel, (math.ceil(N / block_n),), v.contiguous(), codes, scale, zero, N,
        D=D, G=GROUP, BITS=bits, BLOCK_N=block_n)
    return codes, scale, zero


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, ks: torch.Tensor,
                     kz: torch.Tensor, vc: torch.Tensor, vs: torch.Tensor, vz: torch.Tensor, lengths: torch.Tensor,
                     nk: torch.Tensor, nv: torch.Tensor, bits: int, chunks: int | None = None,
                     block_s: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> torch.Tensor:
    """Shapes as decode_attention_reference; lengths, nk, nv of any integer type → [B, H, D] in
    q's dtype. chunks, block_s, num_warps: decode.launch's defaults unless given."""
    from engines.kernels._kivi_kv_triton import attention_kernel

    B, H, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    _check(D, bits)
    caches = [t.contiguous() for t in (kc, ks, kz, vc, vs, vz, k, v)]
    return launch(attention_kernel, q, Hkv, S, [*caches, lengths, nk, nv],
                  dict(HKV=Hkv, S=S, SG=ks.shape[2], scale=1.0 / math.sqrt(D), GROUP=GROUP, BITS=bits,
                       PAIRS=pair_codes(q.dtype, q.device)), TUNING,
                  chunks=chunks, block_s=block_s, num_warps=num_warps, num_stages=num_stages)
