"""TurboQuant KV cache on the GPU: quantize-on-write and decode attention in the rotated domain.

Layout of one cached vector (head_dim D, b bits): its rotated unit vector's code indices as b
bit-planes of 32-channel words — codes [b, D/32] int32, bit k of the code of channel 32w + j is
bit j of plane k, word w — exactly b bits per element with power-of-two tensor shapes; plus the
vector's norm (fp32 here; 16 bits in the memory accounting).

quantize_on_write: x [N, D] → (codes [N, b, D/32] int32, norms [N]); the caller rotates nothing.
decode_attention: q [B, H, D] (one new token per sequence) against the cached codes of keys and
values [B, Hkv, S, b, D/32] with norms [B, Hkv, S] and per-sequence lengths; the query is rotated
once (Π·q), scores are taken against codebook values, Σ p·ĉ·‖v‖ accumulates in the rotated
domain, and the output is rotated back once. GQA: query head h reads kv head h // (H/Hkv).
Split-K over the sequence: each program reduces a chunk to (max, sum, acc); chunks are combined
with a log-sum-exp merge.
"""

from __future__ import annotations

import functools
import math

import torch

from engines.quant import codebook_on, rotation_on

_kernels: dict[str, object] = {}


def rotation_and_codebook(d: int, bits: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Π [d, d] and the Lloyd-Max codebook [2^bits] on `device`, made once per device."""
    return rotation_on(d, seed, device), codebook_on(d, bits, device)


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


def quantize_reference(x: torch.Tensor, bits: int, seed: int = 0):
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


def decode_attention_reference(q, k_codes, k_norms, v_codes, v_norms, lengths, bits: int, seed: int = 0):
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
def merge_split_k(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Combine per-chunk (max [R, C], sum [R, C], accumulator [R, C, D]) of an online softmax:
    out = Σ_c e^(m_c − M)·acc_c / Σ_c e^(m_c − M)·l_c, M = max_c m_c (empty chunks have m = −inf)."""
    M = m.max(dim=1, keepdim=True).values
    w = torch.exp(m - M).nan_to_num(0.0)
    return (w[..., None] * acc).sum(1) / (w * l).sum(1, keepdim=True)


def split_k_chunk(S: int, rows: int, device, block_s: int) -> int:
    """Tokens per split-K program of a decode-attention kernel, which sets the number of programs
    along the sequence (⌈S / chunk⌉); the kernels deal BLOCK_S tiles to them round-robin, so the
    work is even at any length below S. At batch 1 the grid has only
    B·H rows (32 for Llama-3-8B): the sequence is split so that rows × chunks ≈ 4 programs per SM
    (528 on an H100's 132), and no more — each chunk writes a [D] partial that merge_split_k
    reads back, so tiny chunks would add traffic in proportion to S."""
    sms = _sm_count(str(device)) if torch.device(device).type == "cuda" else 4
    n_chunks = max(1, min(math.ceil(S / block_s), math.ceil(4 * sms / rows)))
    return math.ceil(math.ceil(S / n_chunks) / block_s) * block_s


@functools.lru_cache
def _sm_count(device: str) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# 8 warps: at 64-token tiles and head_dim 128 the decode-attention kernels spill registers with 4
# (benchmarks/kernel_resources.py, sm_90)
ATTENTION_WARPS = 8


def default_block_s(device) -> int:
    return 64 if torch.device(device).type == "cuda" else 16  # the interpreter runs small tiles faster


def _get():
    if not _kernels:
        from engines.kernels import _turbo_kv_triton as k

        _kernels["quantize"], _kernels["attention"] = k.quantize_kernel, k.attention_kernel
    return _kernels["quantize"], _kernels["attention"]


def quantize_on_write(x: torch.Tensor, bits: int, seed: int = 0, block_n: int = 16):
    """x [N, D] → (codes [N, bits, D/32] int32, norms [N] fp32). D must be a multiple of 32."""
    N, D = x.shape
    if D % 32 or D & (D - 1):
        raise ValueError(f"head_dim {D} must be a power of two ≥ 32 for the packed TurboQuant layout")
    quantize, _ = _get()
    rot, book = rotation_and_codebook(D, bits, seed, x.device)
    codes = torch.empty(N, bits, D // 32, dtype=torch.int32, device=x.device)
    norms = torch.empty(N, dtype=torch.float32, device=x.device)
    quantize[(math.ceil(N / block_n),)](x.contiguous().float(), rot, book, codes, norms, N,
                                        D=D, BITS=bits, BLOCK_N=block_n)
    return codes, norms


def decode_attention(q, k_codes, k_norms, v_codes, v_norms, lengths, bits: int, seed: int = 0,
                     chunk: int | None = None, block_s: int | None = None) -> torch.Tensor:
    """q [B, H, D]; codes [B, Hkv, S, bits, D/32]; norms [B, Hkv, S]; lengths [B] → [B, H, D].
    chunk: tokens per split-K program (default split_k_chunk)."""
    B, H, D = q.shape
    Hkv, S = k_codes.shape[1], k_codes.shape[2]
    block_s = block_s or default_block_s(q.device)
    chunk = chunk or split_k_chunk(S, B * H, q.device, block_s)
    _, attention = _get()
    rot, book = rotation_and_codebook(D, bits, seed, q.device)
    q_rot = (q.float() @ rot.T).contiguous()  # rotate the query once
    n_chunks = math.ceil(S / chunk)
    m = torch.empty(B * H, n_chunks, device=q.device)
    l = torch.empty(B * H, n_chunks, device=q.device)
    acc = torch.empty(B * H, n_chunks, D, device=q.device)
    attention[(B * H, n_chunks)](q_rot, k_codes.contiguous(), k_norms.contiguous().float(), v_codes.contiguous(),
                                 v_norms.contiguous().float(), lengths.to(torch.int32).contiguous(), book,
                                 m, l, acc, H, Hkv, S, chunk, 1.0 / math.sqrt(D), D=D, BITS=bits, BLOCK_S=block_s,
                                 num_warps=ATTENTION_WARPS)
    return (merge_split_k(m, l, acc) @ rot).reshape(B, H, D).to(q.dtype)  # rotate back once
