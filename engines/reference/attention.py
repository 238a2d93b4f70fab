"""Attention over what a KV cache holds, in torch: masked GQA SDPA, TurboQuant's rotated-domain
attention, and KIVI's two-tier attention (compressed slots beside a full-precision window).
The KV formats (kv.py) pick one for their storage; the Triton decode kernels
(engines/kernels) compute the same on packed codes.

Shapes: B batch, H query heads, Hkv key/value heads, T queries, S slots read, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_gqa_attention(q, k, v, mask) -> torch.Tensor:
    """SDPA with a mask under grouped-query attention. q: [B, H, T, D]; k, v: [B, Hkv, S, D];
    mask: [B, 1, T, S], or None where every query attends every slot given. The G = H/Hkv query
    heads that share a kv head are folded into the query length ([B, Hkv, G·T, D]), so SDPA sees
    equal head counts: flash and memory-efficient attention refuse `enable_gqa` with a mask, and
    the math fallback would copy K and V to every query head (in fp32) on each decode step."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if H == Hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    G = H // Hkv
    folded = q.reshape(B, Hkv, G * T, D)  # query head h = kv head h // G, then group member h % G
    if mask is None or T == 1:  # no mask, or one row that every folded query shares (it broadcasts)
        return F.scaled_dot_product_attention(folded, k, v, attn_mask=mask).reshape(B, H, T, D)
    m = mask.unsqueeze(2).expand(B, 1, G, T, mask.shape[-1]).reshape(B, 1, G * T, mask.shape[-1])
    return F.scaled_dot_product_attention(folded, k, v, attn_mask=m).reshape(B, H, T, D)


def rotated_attention(q, kr, vr, rot, mask) -> torch.Tensor:
    """q: [B, H, T, D]; kr, vr: [B, Hkv, S, D] rotated-domain codes × norms; rot: Π [D, D].
    ⟨q, Πᵀĉ‖k‖⟩ = ⟨Πq, ĉ‖k‖⟩: rotate the query once and score against the stored codes;
    accumulate Σ pᵢ·ĉᵢ‖vᵢ‖ in the rotated domain and rotate back once."""
    out_rot = masked_gqa_attention(q @ rot.T, kr, vr, mask)
    return out_rot @ rot


def two_tier_attention(q, k, v, kq, vq, mask, ck, cv) -> torch.Tensor:
    """Scores read compressed keys where ck, values mix compressed values where cv.
    k, v: raw and kq, vq: dequantized [B, Hkv, S, D]; mask, ck, cv: [B, 1, T, S]."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    k, v, kq, vq = (x.repeat_interleave(g, dim=1) for x in (k, v, kq, vq))  # [B, H, S, D]
    scale = 1.0 / D**0.5
    s_raw = (q @ k.transpose(-1, -2)) * scale
    s_cmp = (q @ kq.transpose(-1, -2)) * scale
    scores = torch.where(ck, s_cmp, s_raw).float().masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q.dtype)
    return (p * cv) @ vq + (p * ~cv) @ v
