"""Static KV cache and attention over it.

k, v: [L, B, Hkv, S, D]. A forward pass writes its new keys/values at their slots, then every
query attends over the slots its mask allows. Writes go through `index_copy_` at a slot tensor
and reads span the mask's width, so a decode step with a fixed-width mask has static shapes and
no host sync (engines/reference/decode.py captures it as a CUDA graph). A lossy KV format (kv.py) decides what a query
reads back: the stored (compressed) value of a slot, or — inside a format's full-precision
residual window — the raw one, exactly as it would be at that query's decode step.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from engines.reference.kv import KiviKV, KVFormat, TurboKV


class KVCache:
    def __init__(self, n_layers: int, batch: int, slots: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fmt: KVFormat):
        shape = (n_layers, batch, n_kv_heads, slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.fmt = fmt
        if fmt.lossy:  # what the compressed cache holds, dequantized (see kv.py)
            self.kq = torch.zeros(shape, dtype=dtype, device=device)
            self.vq = torch.zeros(shape, dtype=dtype, device=device)
        self.seq_start = torch.zeros(batch, dtype=torch.long, device=device)

    def nbytes(self) -> int:
        """Bytes held: the raw and dequantized caches, and any packed buffers of the kernels."""
        tensors = [self.k, self.v, getattr(self, "kq", None), getattr(self, "vq", None), getattr(self, "codes", None),
                   getattr(self, "norms", None), getattr(self, "k8", None), getattr(self, "v8", None),
                   *getattr(self, "kivi", {}).values()]
        return sum(t.nbytes for t in tensors if t is not None)

    @property
    def seq_start(self) -> torch.Tensor:
        """[B] first real slot per row (left padding)."""
        return self._seq_start

    @seq_start.setter
    def seq_start(self, value: torch.Tensor) -> None:
        self._seq_start = value
        self.left_padded = bool(value.any())  # read once here, never inside a decode step

    def attend(self, layer: int, q, k, v, slots: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q: [B, H, T, D]; k, v: [B, Hkv, T, D] for `slots` [T]; mask: [B, 1, T, S], or None
        for a first pass over slots 0…T−1 with no padding (causal over the new tokens)."""
        S = mask.shape[-1] if mask is not None else len(slots)
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)
        keys, values = self.k[layer, :, :, :S], self.v[layer, :, :, :S]
        if mask is None and not self.fmt.lossy:  # prefill: causal flash / memory-efficient SDPA, no mask
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if mask is None:
            mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()[None, None]
        if not self.fmt.lossy:
            return masked_gqa_attention(q, keys, values, mask)
        if self._packs_codes(q):  # the kernels' packed cache is written as slots are
            self._write_codes(layer, k, v, slots)
        if self.fmt.per_token:  # encode each slot once, when it is written
            kq_new, vq_new = self.fmt.encode(k, v, self.seq_start, layer)
            self.kq[layer].index_copy_(2, slots, kq_new)
            self.vq[layer].index_copy_(2, slots, vq_new)
        elif self.fmt.name.startswith("kivi") and self._kernel_decode(q, slots):
            # the kernel keeps its own packed codes; the next multi-token step re-encodes all groups
            return self._kivi_kernel_attend(layer, q, slots)
        else:  # KIVI: key groups span tokens, so whole groups are (re)encoded
            self.kq[layer, :, :, :S], self.vq[layer, :, :, :S] = self.fmt.encode(keys, values, self.seq_start, layer)
        kq, vq = self.kq[layer, :, :, :S], self.vq[layer, :, :, :S]
        if self.fmt.rotated:
            if self._kernel_decode(q, slots):
                return self._turbo_kernel_attend(layer, q, slots, S)
            # TurboQuant: ⟨q, Πᵀĉ‖k‖⟩ = ⟨Πq, ĉ‖k‖⟩ — rotate the query once and score against the
            # stored codes; accumulate Σ pᵢ·ĉᵢ‖vᵢ‖ in the rotated domain and rotate back once.
            rotation = cast(TurboKV, self.fmt).rotation(q.shape[-1], q.device)  # rotated: TurboQuant
            return _rotated_attention(q, kq, vq, rotation.to(q.dtype), mask)
        if not self.fmt.windowed:  # every readable slot is compressed, the current one included
            if self.fmt.name == "fp8" and self._kernel_decode(q, slots):
                return self._fp8_kernel_attend(layer, q, slots, S)
            return masked_gqa_attention(q, kq, vq, mask)
        # A query reads slot j compressed iff j < boundary(n), n = its sequence length: the
        # format's window keeps recent keys (and values) in full precision.
        ck = self._compressed_mask(slots, S, self.fmt.boundary_k)
        cv = self._compressed_mask(slots, S, self.fmt.boundary_v)
        return _two_tier_attention(q, keys, values, kq, vq, mask, ck, cv)

    def _kernel_decode(self, q, slots) -> bool:
        """Decode steps (one new token, no left padding) run the Triton kernels where they run."""
        if q.shape[2] != 1 or self.left_padded:
            return False
        return self._kernels_fit(q) if self.fmt.name.startswith("kivi") else self._packs_codes(q)

    @staticmethod
    def _kernels_fit(q) -> bool:
        """Kernels run for this device (engines/kernels.use_triton) and their packed layouts fit
        the head_dim: a power of two from 32 to 128; other shapes take the torch path."""
        from engines.kernels import use_triton

        D = q.shape[-1]
        return 32 <= D <= 128 and D & (D - 1) == 0 and use_triton(q.device)

    def _packs_codes(self, q) -> bool:
        """TurboQuant (rotated) and fp8 keep a packed cache for the decode kernels where they run
        (fp8 where the GPU has the type: compute capability ≥ 8.9)."""
        from engines.kernels import fp8_native

        if not self._kernels_fit(q):
            return False
        return self.fmt.rotated or (self.fmt.name == "fp8" and fp8_native(str(q.device)))

    def _write_codes(self, layer: int, k, v, slots) -> None:
        """Quantize-on-write of the new slots into the packed cache (TurboQuant bit-planes and
        norms by the Triton kernel; fp8 by the cast kernel on CUDA, torch's cast elsewhere)."""
        L, B, Hkv, S_max, D = self.k.shape
        T = len(slots)
        if self.fmt.rotated:
            from engines.kernels.turbo_kv import quantize_on_write as turbo_quantize_on_write

            turbo = cast(TurboKV, self.fmt)  # rotated: TurboQuant
            bits = int(turbo.bits)
            if not hasattr(self, "codes"):
                self.codes = torch.zeros(2, L, B, Hkv, S_max, bits, D // 32, dtype=torch.int32, device=k.device)
                self.norms = torch.zeros(2, L, B, Hkv, S_max, device=k.device)
            for i, x in enumerate((k, v)):
                c, n = turbo_quantize_on_write(x.reshape(-1, D), bits, turbo.seed)
                self.codes[i, layer].index_copy_(2, slots, c.reshape(B, Hkv, T, bits, D // 32))
                self.norms[i, layer].index_copy_(2, slots, n.reshape(B, Hkv, T))
            return
        from engines.kernels.fp8_kv import FP8, quantize_on_write, quantize_reference

        # The Triton interpreter flushes e4m3 subnormals to zero where GPUs and torch round them:
        # off CUDA the cast is torch's, so both paths hold the same codes.
        to_fp8 = quantize_on_write if k.is_cuda else quantize_reference
        if not hasattr(self, "k8"):
            self.k8 = torch.zeros(self.k.shape, dtype=FP8, device=k.device)
            self.v8 = torch.zeros(self.v.shape, dtype=FP8, device=k.device)
        # index_copy_ has no fp8 kernels: write the codes' bytes
        self.k8[layer].view(torch.uint8).index_copy_(2, slots, to_fp8(k).view(torch.uint8))
        self.v8[layer].view(torch.uint8).index_copy_(2, slots, to_fp8(v).view(torch.uint8))

    def _lengths(self, q, slots) -> torch.Tensor:
        return (slots[-1:] + 1).expand(q.shape[0]).contiguous()  # [B] sequence lengths, on the device

    def _turbo_kernel_attend(self, layer: int, q, slots, S: int):
        """Attention by the decode kernel over the packed codes of the first S slots."""
        from engines.kernels.turbo_kv import decode_attention

        out = decode_attention(q[:, :, 0], self.codes[0, layer, :, :, :S], self.norms[0, layer, :, :, :S],
                               self.codes[1, layer, :, :, :S], self.norms[1, layer, :, :, :S], self._lengths(q, slots),
                               int(cast(TurboKV, self.fmt).bits), cast(TurboKV, self.fmt).seed)
        return out[:, :, None].to(q.dtype)

    def _fp8_kernel_attend(self, layer: int, q, slots, S: int):
        """Attention by the fp8 decode kernel over the first S slots."""
        from engines.kernels.fp8_kv import decode_attention

        out = decode_attention(q[:, :, 0], self.k8[layer, :, :, :S], self.v8[layer, :, :, :S], self._lengths(q, slots))
        return out[:, :, None].to(q.dtype)

    def _kivi_kernel_attend(self, layer: int, q, slots):
        """KIVI codes written by the quantize-on-write kernels as slots leave the full-precision
        window (keys in whole flushes, values token by token); attention by the two-tier kernel."""
        from engines.kernels.kivi_kv import GROUP, decode_attention, quantize_keys, quantize_values

        bits = cast(KiviKV, self.fmt).bits
        L, B, Hkv, S_max, D = self.k.shape
        if not hasattr(self, "kivi"):
            words, groups = D * bits // 32, -(-S_max // GROUP)
            z = lambda *shape, dtype=torch.float32: torch.zeros(L, B, Hkv, *shape, dtype=dtype, device=q.device)  # noqa: E731
            self.kivi = {"kc": z(S_max, words, dtype=torch.int32), "ks": z(groups, D), "kz": z(groups, D),
                         "vc": z(S_max, words, dtype=torch.int32), "vs": z(S_max, D // GROUP),
                         "vz": z(S_max, D // GROUP)}
            self.packed_k, self.packed_v = [0] * L, [0] * L
        c = self.kivi
        t = int(slots[-1])
        n = torch.tensor([t + 1], device=q.device)  # the query's sequence length
        nk, nv = int(self.fmt.boundary_k(n)), int(self.fmt.boundary_v(n))
        lo = self.packed_k[layer]
        if nk > lo:  # a flush: whole groups of GROUP tokens
            codes, scale, zero = quantize_keys(self.k[layer, :, :, lo:nk].reshape(-1, D), bits)
            n_g = (nk - lo) // GROUP
            c["kc"][layer, :, :, lo:nk] = codes.reshape(B, Hkv, nk - lo, -1)
            c["ks"][layer, :, :, lo // GROUP : nk // GROUP] = scale.reshape(B, Hkv, n_g, D)
            c["kz"][layer, :, :, lo // GROUP : nk // GROUP] = zero.reshape(B, Hkv, n_g, D)
            self.packed_k[layer] = nk
        lo = self.packed_v[layer]
        if nv > lo:
            codes, scale, zero = quantize_values(self.v[layer, :, :, lo:nv].reshape(-1, D), bits)
            c["vc"][layer, :, :, lo:nv] = codes.reshape(B, Hkv, nv - lo, -1)
            c["vs"][layer, :, :, lo:nv] = scale.reshape(B, Hkv, nv - lo, -1)
            c["vz"][layer, :, :, lo:nv] = zero.reshape(B, Hkv, nv - lo, -1)
            self.packed_v[layer] = nv
        full = lambda x: torch.full((B,), x, device=q.device)  # noqa: E731
        out = decode_attention(q[:, :, 0], self.k[layer], self.v[layer],
                               c["kc"][layer], c["ks"][layer], c["kz"][layer], c["vc"][layer], c["vs"][layer],
                               c["vz"][layer], full(t + 1), full(nk), full(nv), bits)
        return out[:, :, None].to(q.dtype)

    def _compressed_mask(self, slots: torch.Tensor, S: int, boundary) -> torch.Tensor:
        # [B, 1, T, S]: query at slot t (sequence length n = t − start + 1) reads j compressed
        # iff (j − start) < boundary(n).
        start = self.seq_start[:, None, None]  # [B, 1, 1]
        n = slots[None, :, None] - start + 1  # [B, T, 1]
        j = torch.arange(S, device=slots.device)[None, None, :] - start  # [B, 1, S]
        return (j < boundary(n))[:, None]


def masked_gqa_attention(q, k, v, mask) -> torch.Tensor:
    """SDPA with a mask under grouped-query attention. q: [B, H, T, D]; k, v: [B, Hkv, S, D];
    mask: [B, 1, T, S]. The G = H/Hkv query heads that share a kv head are folded into the query
    length ([B, Hkv, G·T, D]), so SDPA sees equal head counts: flash and memory-efficient
    attention refuse `enable_gqa` with a mask, and the math fallback would copy K and V to every
    query head (in fp32) on each decode step."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if H == Hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    G = H // Hkv
    folded = q.reshape(B, Hkv, G * T, D)  # query head h = kv head h // G, then group member h % G
    m = mask.unsqueeze(2).expand(B, 1, G, T, mask.shape[-1]).reshape(B, 1, G * T, mask.shape[-1])
    return F.scaled_dot_product_attention(folded, k, v, attn_mask=m).reshape(B, H, T, D)


def _rotated_attention(q, kr, vr, rot, mask) -> torch.Tensor:
    """q: [B, H, T, D]; kr, vr: [B, Hkv, S, D] rotated-domain codes × norms; rot: Π [D, D]."""
    out_rot = masked_gqa_attention(q @ rot.T, kr, vr, mask)
    return out_rot @ rot


def _two_tier_attention(q, k, v, kq, vq, mask, ck, cv) -> torch.Tensor:
    """Scores read compressed keys where ck, values mix compressed values where cv."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    k, v, kq, vq = (x.repeat_interleave(g, dim=1) for x in (k, v, kq, vq))  # [B, H, S, D]
    scale = 1.0 / D**0.5
    s_raw = (q @ k.transpose(-1, -2)) * scale
    s_cmp = (q @ kq.transpose(-1, -2)) * scale
    scores = torch.where(ck, s_cmp, s_raw).float().masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(q.dtype)
    return (p * cv) @ vq + (p * ~cv) @ v


class NoCache:
    """A single causal pass with a lossless KV format needs no cache (perplexity windows):
    attention runs on the new keys and values directly, with the causal SDPA kernel."""

    def attend(self, layer: int, q, k, v, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
