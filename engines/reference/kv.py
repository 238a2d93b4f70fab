"""KV-cache formats (REFERENCE.md §2). Each format says what a cache slot holds after it is
written (``encode``: the dequantized value a kernel would read back), how many leading positions
of a sequence are held compressed when its length is n (``boundary``: KIVI keeps a recent
full-precision window; the others compress every slot, the current one included), and its exact
storage cost (``bits_per_element``, metadata amortized).

Each format also owns its storage in a cache (``new_store``): the buffers it keeps beside the
cache's raw keys and values, how new slots are written into them, and the attention a query runs
over them. The reference engine stores dequantized values (a faithful simulation of the
arithmetic); where the Triton kernels of engines/kernels run, a format also keeps the packed
codes the bit counts describe and its decode steps (one new token per row, no left padding) read
those. engines/reference/cache.py holds only slots and masks: a new format is a class here.

Shapes: L layers, B batch, H query heads, Hkv key/value heads, T new tokens, S slots, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engines.kernels import fp8_native, use_triton
from engines.quant import minmax_quant, qjl_residual, rotation_on, turbo_mse, turbo_mse_rotated
from engines.reference.attention import masked_gqa_attention, rotated_attention, two_tier_attention

FP16_BITS = 16


class KVFormat:
    name = "base"
    lossy = True
    rotated = False  # stored values live in a rotated domain (TurboQuant): attention rotates q once

    def encode(self, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor, layer: int = 0):
        """k, v: [B, Hkv, S, D] raw → what the cache holds for them (same shapes)."""
        raise NotImplementedError

    def boundary_k(self, n: torch.Tensor) -> torch.Tensor:
        """Leading key positions held compressed when the sequence holds n tokens (all of them,
        the current one included, unless the format keeps a full-precision window)."""
        return n

    def boundary_v(self, n: torch.Tensor) -> torch.Tensor:
        return n

    @property
    def windowed(self) -> bool:
        return False

    def bits_per_element(self, head_dim: int) -> tuple[float, float]:
        """(key bits, value bits) per cached element, metadata included."""
        raise NotImplementedError

    def new_store(self, k: torch.Tensor, v: torch.Tensor) -> KVStore:
        """This format's storage in a cache whose raw keys and values are k, v [L, B, Hkv, S, D]:
        a lossless format reads them as they are; a lossy one each slot's dequantized value."""
        return DequantizedStore(self, k, v) if self.lossy else KVStore(self, k, v)


# -- storage ---------------------------------------------------------------------------------------
class KVStore:
    """What a cache holds for its format beside the raw keys and values k, v [L, B, Hkv, S, D]
    (which the cache writes first), and the attention over it. Lossless: the raw values."""

    def __init__(self, fmt: KVFormat, k: torch.Tensor, v: torch.Tensor):
        self.fmt, self.k, self.v = fmt, k, v

    def buffers(self) -> list[torch.Tensor]:
        """Tensors held beside the raw cache, counted in the cache's bytes."""
        return []

    def attend(self, layer: int, q, k, v, slots: torch.Tensor, mask: torch.Tensor, seq_start: torch.Tensor,
               decode_step: bool) -> torch.Tensor:
        """q: [B, H, T, D]; k, v: [B, Hkv, T, D] new, already in the raw cache at `slots` [T];
        mask: [B, 1, T, S]; seq_start: [B] first real slot per row; decode_step: one new token
        per row and no left padding (where a decode kernel may run) → [B, H, T, D]."""
        S = mask.shape[-1]
        return masked_gqa_attention(q, self.k[layer, :, :, :S], self.v[layer, :, :, :S], mask)


class DequantizedStore(KVStore):
    """A lossy format whose slots encode on their own: each slot's dequantized value, encoded
    once when the slot is written; every readable slot is read compressed, the current one too."""

    def __init__(self, fmt: KVFormat, k: torch.Tensor, v: torch.Tensor):
        super().__init__(fmt, k, v)
        self.kq, self.vq = torch.zeros_like(k), torch.zeros_like(v)

    def buffers(self) -> list[torch.Tensor]:
        return [self.kq, self.vq]

    def write(self, layer: int, k, v, slots: torch.Tensor, seq_start: torch.Tensor) -> None:
        kq_new, vq_new = self.fmt.encode(k, v, seq_start, layer)
        self.kq[layer].index_copy_(2, slots, kq_new)
        self.vq[layer].index_copy_(2, slots, vq_new)

    def attend(self, layer, q, k, v, slots, mask, seq_start, decode_step):
        self.write(layer, k, v, slots, seq_start)
        S = mask.shape[-1]
        return masked_gqa_attention(q, self.kq[layer, :, :, :S], self.vq[layer, :, :, :S], mask)


def kernels_fit(q: torch.Tensor) -> bool:
    """Kernels run for this device (engines/kernels.use_triton) and their packed layouts fit
    the head_dim: a power of two from 32 to 128; other shapes take the torch path."""
    D = q.shape[-1]
    return 32 <= D <= 128 and D & (D - 1) == 0 and use_triton(q.device)


def _lengths(q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[B] sequence lengths of a decode step, on the device (no host sync)."""
    return (slots[-1:] + 1).expand(q.shape[0]).contiguous()


@dataclass
class FloatKV(KVFormat):
    dtype: torch.dtype
    compute_dtype: torch.dtype

    def __post_init__(self) -> None:
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[self.dtype]
        self.lossy = self.dtype != self.compute_dtype

    def encode(self, k, v, seq_start, layer=0):
        return k.to(self.dtype).to(k.dtype), v.to(self.dtype).to(v.dtype)

    def bits_per_element(self, head_dim):
        bits = torch.finfo(self.dtype).bits
        return float(bits), float(bits)


class Fp8KV(KVFormat):
    """fp8 e4m3 with unit scale (vLLM's kv_cache_dtype="fp8" without calibrated scales)."""

    name = "fp8"

    def encode(self, k, v, seq_start, layer=0):
        f8 = torch.float8_e4m3fn
        return k.float().clamp(-448, 448).to(f8).to(k.dtype), v.float().clamp(-448, 448).to(f8).to(v.dtype)

    def bits_per_element(self, head_dim):
        return 8.0, 8.0

    def new_store(self, k, v) -> KVStore:
        return Fp8Store(self, k, v)


class Fp8Store(DequantizedStore):
    """Where the kernels run and the GPU has the type (fp8_native: compute capability ≥ 8.9),
    also the fp8 codes k8, v8 [L, B, Hkv, S, D], written as slots are (made on first use);
    decode steps read them with the fp8 decode kernel."""

    k8: torch.Tensor | None = None
    v8: torch.Tensor | None = None

    def buffers(self):
        return [*super().buffers(), *(t for t in (self.k8, self.v8) if t is not None)]

    def attend(self, layer, q, k, v, slots, mask, seq_start, decode_step):
        codes = self._write_codes(layer, k, v, slots) if kernels_fit(q) and fp8_native(str(q.device)) else None
        self.write(layer, k, v, slots, seq_start)
        S = mask.shape[-1]
        if decode_step and codes is not None:
            from engines.kernels.fp8_kv import decode_attention

            k8, v8 = codes
            out = decode_attention(q[:, :, 0], k8[layer, :, :, :S], v8[layer, :, :, :S], _lengths(q, slots))
            return out[:, :, None].to(q.dtype)
        return masked_gqa_attention(q, self.kq[layer, :, :, :S], self.vq[layer, :, :, :S], mask)

    def _write_codes(self, layer: int, k, v, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize-on-write of the new slots (the cast kernel on CUDA, torch's cast elsewhere)
        → the whole code buffers k8, v8."""
        from engines.kernels.fp8_kv import FP8, quantize_on_write, quantize_reference

        # The Triton interpreter flushes e4m3 subnormals to zero where GPUs and torch round them:
        # off CUDA the cast is torch's, so both paths hold the same codes.
        to_fp8 = quantize_on_write if k.is_cuda else quantize_reference
        if self.k8 is None or self.v8 is None:
            self.k8 = torch.zeros(self.k.shape, dtype=FP8, device=k.device)
            self.v8 = torch.zeros(self.v.shape, dtype=FP8, device=k.device)
        # index_copy_ has no fp8 kernels: write the codes' bytes
        self.k8[layer].view(torch.uint8).index_copy_(2, slots, to_fp8(k).view(torch.uint8))
        self.v8[layer].view(torch.uint8).index_copy_(2, slots, to_fp8(v).view(torch.uint8))
        return self.k8, self.v8


@dataclass
class IntPerTokenKV(KVFormat):
    """Uniform int-b per token: min-max over each (token, head) vector of D channels, no
    full-precision window. int8 is near lossless; int4 and int2 are the naive baselines that
    KVQuant shows collapse (REFERENCE.md §2)."""

    bits: int = 8

    def __post_init__(self) -> None:
        self.name = f"int{self.bits}"

    def encode(self, k, v, seq_start, layer=0):
        return minmax_quant(k.float(), self.bits, -1).to(k.dtype), minmax_quant(v.float(), self.bits, -1).to(v.dtype)

    def bits_per_element(self, head_dim):
        b = self.bits + 2 * FP16_BITS / head_dim  # fp16 scale + zero per vector
        return b, b


@dataclass
class KiviKV(KVFormat):
    """KIVI (jy-yuan/KIVI): keys per channel over groups of G tokens, values per token over
    groups of G channels. Keys wait in a full-precision residual of up to R tokens and are
    flushed (quantized) R at a time, so 1…R recent keys are full precision; values leave their
    R-token full-precision window one token at a time."""

    bits: int
    group: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        self.name = f"kivi-{self.bits}"

    @property
    def windowed(self) -> bool:
        return True

    def boundary_k(self, n):
        return ((n - 1).clamp(min=0) // self.residual) * self.residual

    def boundary_v(self, n):
        return (n - 1 - self.residual).clamp(min=0)

    def encode(self, k, v, seq_start, layer=0):
        kq = k.clone()
        B, H, S, D = k.shape
        G = self.group
        for b in range(B):  # rows start at different slots under left padding
            s0 = int(seq_start[b])
            n_groups = (S - s0) // G
            if n_groups:
                blk = k[b, :, s0 : s0 + n_groups * G].float().reshape(H, n_groups, G, D)
                kq[b, :, s0 : s0 + n_groups * G] = (minmax_quant(blk, self.bits, 2)
                                                    .reshape(H, n_groups * G, D).to(k.dtype))
        if D % G == 0:
            vg = v.float().reshape(B, H, S, D // G, G)
            vq = minmax_quant(vg, self.bits, -1).reshape(B, H, S, D).to(v.dtype)
        else:
            vq = minmax_quant(v.float(), self.bits, -1).to(v.dtype)
        return kq, vq

    def bits_per_element(self, head_dim):
        """Quantized part only; the full-precision window (up to R keys, R values) comes on top."""
        per_group = 2 * FP16_BITS / self.group  # scale + zero per G elements, on either axis
        return self.bits + per_group, self.bits + per_group

    def new_store(self, k, v) -> KVStore:
        return KiviStore(self, k, v)


class KiviStore(DequantizedStore):
    """Key groups span tokens, so a pass re-encodes whole groups of the slots it reads, and a
    query reads slot j compressed iff j < boundary(n), n its sequence length (two-tier attention).
    Decode steps where the kernels run take the two-tier kernel instead, over packed codes written
    as slots leave the full-precision window (made on first use; the next multi-token pass
    re-encodes all groups)."""

    fmt: KiviKV

    def __init__(self, fmt: KiviKV, k, v):
        super().__init__(fmt, k, v)
        self.packed: dict[str, torch.Tensor] = {}
        L = k.shape[0]
        self.packed_k, self.packed_v = [0] * L, [0] * L  # per layer: leading slots whose codes are written

    def buffers(self):
        return [*super().buffers(), *self.packed.values()]

    def attend(self, layer, q, k, v, slots, mask, seq_start, decode_step):
        if decode_step and kernels_fit(q):
            return self._kernel_attend(layer, q, slots)
        S = mask.shape[-1]
        keys, values = self.k[layer, :, :, :S], self.v[layer, :, :, :S]
        self.kq[layer, :, :, :S], self.vq[layer, :, :, :S] = self.fmt.encode(keys, values, seq_start, layer)
        kq, vq = self.kq[layer, :, :, :S], self.vq[layer, :, :, :S]
        ck = _compressed_mask(slots, S, seq_start, self.fmt.boundary_k)
        cv = _compressed_mask(slots, S, seq_start, self.fmt.boundary_v)
        return two_tier_attention(q, keys, values, kq, vq, mask, ck, cv)

    def _kernel_attend(self, layer: int, q, slots):
        """KIVI codes written by the quantize-on-write kernels as slots leave the full-precision
        window (keys in whole flushes, values token by token); attention by the two-tier kernel."""
        from engines.kernels.kivi_kv import GROUP, decode_attention, quantize_keys, quantize_values

        bits = self.fmt.bits
        L, B, Hkv, S_max, D = self.k.shape
        if not self.packed:
            words, groups = D * bits // 32, -(-S_max // GROUP)
            z = lambda *shape, dtype=torch.float32: torch.zeros(L, B, Hkv, *shape, dtype=dtype, device=q.device)  # noqa: E731
            self.packed = {"kc": z(S_max, words, dtype=torch.int32), "ks": z(groups, D), "kz": z(groups, D),
                           "vc": z(S_max, words, dtype=torch.int32), "vs": z(S_max, D // GROUP),
                           "vz": z(S_max, D // GROUP)}
        c = self.packed
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


def _compressed_mask(slots: torch.Tensor, S: int, seq_start: torch.Tensor, boundary) -> torch.Tensor:
    # [B, 1, T, S]: query at slot t (sequence length n = t − start + 1) reads j compressed
    # iff (j − start) < boundary(n).
    start = seq_start[:, None, None]  # [B, 1, 1]
    n = slots[None, :, None] - start + 1  # [B, T, 1]
    j = torch.arange(S, device=slots.device)[None, None, :] - start  # [B, 1, S]
    return (j < boundary(n))[:, None]


# -- TurboQuant (codebooks and rotation: engines/quant/turbo.py) ----------------------------------
@dataclass
class TurboKV(KVFormat):
    """TurboQuant (arXiv 2504.19874). bits may be fractional: D/4 outlier channels get ⌈b⌉ bits,
    the rest ⌊b⌋, each part with its own rotation and norm. The outlier channels are fixed per
    layer and head from the projection weights (``calibrate``: row energy of k_proj — RoPE pairs
    kept together — and of v_proj), so a token's code never depends on other requests.
    inner_product=True: keys use MSE at b−1 bits plus the 1-bit QJL residual (unbiased inner
    products); values stay MSE at b bits."""

    bits: float
    inner_product: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        self.name = f"turbo-ip-{self.bits:g}" if self.inner_product else f"turbo-{self.bits:g}"
        self.fractional = self.bits != int(self.bits)
        self.rotated = not (self.inner_product or self.fractional)
        self.outliers: dict[tuple[int, str], torch.Tensor] = {}  # (layer, "k"|"v") → [Hkv, D/4] channel ids

    def calibrate(self, model) -> None:
        """Outlier channels per layer and head from the weights (data-free, order-free)."""
        if not self.fractional:
            return
        a = model.args
        D, Hkv = a.head_dim, a.n_kv_heads
        for i, layer in enumerate(model.model.layers):
            wk = layer.self_attn.k_proj.weight.detach().float().reshape(Hkv, D, -1).pow(2).sum(-1)  # [Hkv, D]
            pair = wk[:, : D // 2] + wk[:, D // 2 :]  # RoPE rotates channel i with i + D/2
            top = pair.topk(D // 8, dim=-1).indices
            self.outliers[(i, "k")] = torch.cat([top, top + D // 2], dim=-1).sort(-1).values
            wv = layer.self_attn.v_proj.weight.detach().float().reshape(Hkv, D, -1).pow(2).sum(-1)
            self.outliers[(i, "v")] = wv.topk(D // 4, dim=-1).indices.sort(-1).values

    def _outlier_mask(self, x: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        D = x.shape[-1]
        idx = self.outliers.get((layer, which))
        if idx is None:  # uncalibrated (a format used on its own): this call's own energy
            idx = x.float().abs().mean(dim=(0, 2)).topk(D // 4, dim=-1).indices
        mask = torch.zeros(x.shape[1], D, dtype=torch.bool, device=x.device)
        return mask.scatter_(1, idx.to(x.device), True)

    def _mse(self, x: torch.Tensor, layer: int, which: str, bits: float) -> torch.Tensor:
        if bits == int(bits):
            return turbo_mse(x, int(bits), self.seed)
        mask = self._outlier_mask(x, layer, which)  # [Hkv, D]
        out = torch.empty_like(x, dtype=torch.float32)
        hi_bits, lo_bits = math.ceil(bits), math.floor(bits)
        for h in range(x.shape[1]):
            m = mask[h]
            out[:, h][..., m] = turbo_mse(x[:, h][..., m], hi_bits, self.seed + 1)
            out[:, h][..., ~m] = turbo_mse(x[:, h][..., ~m], lo_bits, self.seed + 2)
        return out

    def rotation(self, d: int, device) -> torch.Tensor:
        return rotation_on(d, self.seed, device)

    def encode(self, k, v, seq_start, layer=0):
        if self.rotated:  # stored in the rotated domain: codes × norms (Π·k̂, Π·v̂)
            return (turbo_mse_rotated(k, int(self.bits), self.seed).to(k.dtype),
                    turbo_mse_rotated(v, int(self.bits), self.seed).to(v.dtype))
        if self.inner_product:
            k_mse = self._mse(k, layer, "k", self.bits - 1)
            kq = k_mse + qjl_residual(k.float() - k_mse, self.seed + 3)
        else:
            kq = self._mse(k, layer, "k", self.bits)
        return kq.to(k.dtype), self._mse(v, layer, "v", self.bits).to(v.dtype)

    def new_store(self, k, v) -> KVStore:
        return RotatedTurboStore(self, k, v) if self.rotated else DequantizedStore(self, k, v)

    def code_bits(self, bits: float) -> float:
        # fractional: D/4 channels at ⌈b⌉, 3D/4 at ⌊b⌋ → ⌊b⌋ + 1/4 code bits per element
        return math.floor(bits) + 0.25 if bits != int(bits) else float(bits)

    def bits_per_element(self, head_dim):
        """Exact, norms included. The nominal width (2.5, 3.5) is the total at head_dim 128
        (REFERENCE.md §2: 32 channels at 3 bits + 96 at 2, plus two fp16 norms = 2.5); with a
        smaller head_dim the norms cost more per element."""
        norms = 2 if self.fractional else 1  # one fp16 norm per (sub)vector
        v_bits = self.code_bits(self.bits) + norms * FP16_BITS / head_dim
        if self.inner_product:  # b−1 bit MSE codes + 1 QJL sign bit, plus the residual's norm
            return self.code_bits(self.bits - 1) + 1 + (norms + 1) * FP16_BITS / head_dim, v_bits
        return v_bits, v_bits


class RotatedTurboStore(DequantizedStore):
    """TurboQuant at whole bits keeps each slot in the rotated domain (codes × norms, Π·k̂, Π·v̂):
    attention rotates the query once (rotated_attention). Where the kernels run, also the packed
    codes [2 (k, v), L, B, Hkv, S, bits, D/32] int32 (bit-planes, engines/kernels/turbo_kv.py) and
    norms [2, L, B, Hkv, S] fp32, written as slots are (made on first use); decode steps read them
    with the TurboQuant decode kernel."""

    fmt: TurboKV
    codes: torch.Tensor | None = None
    norms: torch.Tensor | None = None

    def buffers(self):
        return [*super().buffers(), *(t for t in (self.codes, self.norms) if t is not None)]

    def attend(self, layer, q, k, v, slots, mask, seq_start, decode_step):
        packed = self._write_codes(layer, k, v, slots) if kernels_fit(q) else None
        self.write(layer, k, v, slots, seq_start)
        S = mask.shape[-1]
        if decode_step and packed is not None:
            from engines.kernels.turbo_kv import decode_attention

            codes, norms = packed
            out = decode_attention(q[:, :, 0], codes[0, layer, :, :, :S], norms[0, layer, :, :, :S],
                                   codes[1, layer, :, :, :S], norms[1, layer, :, :, :S], _lengths(q, slots),
                                   int(self.fmt.bits), self.fmt.seed)
            return out[:, :, None].to(q.dtype)
        rotation = self.fmt.rotation(q.shape[-1], q.device)
        return rotated_attention(q, self.kq[layer, :, :, :S], self.vq[layer, :, :, :S], rotation.to(q.dtype), mask)

    def _write_codes(self, layer: int, k, v, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize-on-write of the new slots (bit-planes and norms by the Triton kernel) → the
        whole code and norm buffers."""
        from engines.kernels.turbo_kv import quantize_on_write

        L, B, Hkv, S_max, D = self.k.shape
        T = len(slots)
        bits = int(self.fmt.bits)
        if self.codes is None or self.norms is None:
            self.codes = torch.zeros(2, L, B, Hkv, S_max, bits, D // 32, dtype=torch.int32, device=k.device)
            self.norms = torch.zeros(2, L, B, Hkv, S_max, device=k.device)
        for i, x in enumerate((k, v)):
            c, n = quantize_on_write(x.reshape(-1, D), bits, self.fmt.seed)
            self.codes[i, layer].index_copy_(2, slots, c.reshape(B, Hkv, T, bits, D // 32))
            self.norms[i, layer].index_copy_(2, slots, n.reshape(B, Hkv, T))
        return self.codes, self.norms


def kv_format(name: str, compute_dtype: torch.dtype) -> KVFormat:
    floats = {"auto": compute_dtype, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    if name in floats:
        return FloatKV(floats[name], compute_dtype)
    if name == "fp8":
        return Fp8KV()
    if name in ("int8", "int4", "int2"):
        return IntPerTokenKV(int(name.removeprefix("int")))
    if name.startswith("kivi-"):
        return KiviKV(int(name.removeprefix("kivi-")))
    if name.startswith("turbo-ip-"):
        return TurboKV(float(name.removeprefix("turbo-ip-")), inner_product=True)
    if name.startswith("turbo-"):
        return TurboKV(float(name.removeprefix("turbo-")))
    raise ValueError(f"kv_cache: '{name}' has no format in the reference engine")
