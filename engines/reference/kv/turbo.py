"""TurboQuant (arXiv 2504.19874): a random rotation, then Lloyd-Max codes per channel."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from engines.quant import qjl_residual, rotation_on, turbo_mse, turbo_mse_rotated
from engines.reference.attention import Causal, rotated_attention
from engines.reference.kv.base import FP16_BITS, DequantizedStore, KVFormat, KVStore, kernels_fit

if TYPE_CHECKING:
    from engines.reference.model import DecoderLayer, Transformer


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

    @property
    def slots_on_their_own(self) -> bool:
        """Fractional bits pick their outlier channels from the weights once calibrated; before,
        from the energy of each call's keys (_outlier_mask), so a slot's code depends on the pass."""
        return not self.fractional or bool(self.outliers)

    @property
    def graph_blocker(self) -> str | None:
        if self.fractional or self.inner_product:
            return f"kv_cache {self.name}: per-channel selection has data-dependent shapes"
        return None

    def calibrate(self, model: Transformer) -> None:
        """Outlier channels per layer and head from the weights (data-free, order-free)."""
        if not self.fractional:
            return
        a = model.args
        D, Hkv = a.head_dim, a.n_kv_heads
        for i, layer in enumerate(cast("Iterable[DecoderLayer]", model.model.layers)):
            k_norm = getattr(layer.self_attn, "k_norm", None)
            if k_norm is not None:  # Qwen3: each head's key is normalised, then scaled by k_norm's weight
                wk = k_norm.weight.detach().float().pow(2)[None].expand(Hkv, D)
            else:
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

    def rotation(self, d: int, device: str | torch.device) -> torch.Tensor:
        return rotation_on(d, self.seed, device)

    def read_back(self, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor,
                  layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        kq, vq = self.encode(k, v, seq_start, layer)
        if not self.rotated:
            return kq, vq
        rot = self.rotation(k.shape[-1], k.device)  # stored Π·x (x @ Πᵀ): back by x = y @ Π
        return (kq.float() @ rot).to(k.dtype), (vq.float() @ rot).to(v.dtype)

    def encode(self, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor,
               layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotated:  # stored in the rotated domain: codes × norms (Π·k̂, Π·v̂)
            return (turbo_mse_rotated(k, int(self.bits), self.seed).to(k.dtype),
                    turbo_mse_rotated(v, int(self.bits), self.seed).to(v.dtype))
        if self.inner_product:
            k_mse = self._mse(k, layer, "k", self.bits - 1)
            kq = k_mse + qjl_residual(k.float() - k_mse, self.seed + 3)
        else:
            kq = self._mse(k, layer, "k", self.bits)
        return kq.to(k.dtype), self._mse(v, layer, "v", self.bits).to(v.dtype)

    def new_store(self, k: torch.Tensor, v: torch.Tensor) -> KVStore:
        return RotatedTurboStore(self, k, v) if self.rotated else DequantizedStore(self, k, v)

    def code_bits(self, bits: float) -> float:
        # fractional: D/4 channels at ⌈b⌉, 3D/4 at ⌊b⌋ → ⌊b⌋ + 1/4 code bits per element
        return math.floor(bits) + 0.25 if bits != int(bits) else float(bits)

    def bits_per_element(self, head_dim: int) -> tuple[float, float]:
        """Exact, norms included. The nominal width (2.5, 3.5) is the total at head_dim 128
        (docs/reference.md §2: 32 channels at 3 bits + 96 at 2, plus two fp16 norms = 2.5); with a
        smaller head_dim the norms cost more per element."""
        norms = 2 if self.fractional else 1  # one fp16 norm per (sub)vector
        v_bits = self.code_bits(self.bits) + norms * FP16_BITS / head_dim
        if self.inner_product:  # b−1 bit MSE codes + 1 QJL sign bit, plus the residual's norm
            return self.code_bits(self.bits - 1) + 1 + (norms + 1) * FP16_BITS / head_dim, v_bits
        return v_bits, v_bits


class RotatedTurboStore(DequantizedStore):
    """TurboQuant at whole bits keeps each slot in the rotated domain (codes × norms, Π·k̂, Π·v̂):
    attention rotates the query once (rotated_attention). Where the kernels run it starts with only
    the packed codes [2 (k, v), L, B, Hkv, S, D·F/32] int32 (F-bit fields, a nibble at 3 bits:
    engines/kernels/turbo_kv.py) and norms [2, L, B, Hkv, S] fp32: one kernel launch for the keys
    and the values writes a slot's codes and norm; decode steps read the codes with the TurboQuant
    decode kernel, and an unpadded first pass dequantizes the slots it reads, one layer at a time
    (dequantize_rotated: the same ĉ·‖x‖ in the same fp32 arithmetic as the write kernel's DEQUANT
    output). A pass that reads the whole cache again and again (left-padded decode, speculative
    verify, masked prefill chunks) makes the rotated-domain shadow once, which the write kernel
    then fills beside the codes. Elsewhere the rotated-domain values only, as DequantizedStore."""

    fmt: TurboKV

    def __init__(self, fmt: TurboKV, k: torch.Tensor, v: torch.Tensor):
        self.kernels = kernels_fit(k)
        super().__init__(fmt, k, v)
        if self.kernels:
            from engines.kernels.turbo_kv import code_words

            L, B, Hkv, S_max, D = k.shape
            self.codes = torch.zeros(2, L, B, Hkv, S_max, code_words(D, int(fmt.bits)), dtype=torch.int32,
                                     device=k.device)
            self.norms = torch.zeros(2, L, B, Hkv, S_max, device=k.device)

    @property
    def shadow_at_start(self) -> bool:
        return not self.kernels

    def dequantized(self, layer: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        from engines.kernels.turbo_kv import dequantize_rotated

        bits, c, n = int(self.fmt.bits), self.codes[:, layer, :, :, :S], self.norms[:, layer, :, :, :S]
        return (dequantize_rotated(c[0], n[0], bits).to(self.k.dtype),
                dequantize_rotated(c[1], n[1], bits).to(self.v.dtype))

    def buffers(self) -> list[torch.Tensor]:
        return [self.codes, self.norms, *super().buffers()] if self.kernels else super().buffers()

    def rope_in_kernels(self) -> bool:
        """Where the kernels run and no shadow is kept (the write kernel would fill it from the rotated
        keys; a pass that made it reads it with torch attention): RoPE in the write kernel for the
        keys and in the attention kernel for the queries."""
        return self.kernels and not self.has_shadow

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, seq_start: torch.Tensor) -> None:
        if self.kernels:
            self._write_codes(layer, k, v, slots)  # the shadow too, once made (the write kernel's DEQUANT)
        else:
            self.write(layer, k, v, slots, seq_start)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal, seq_start: torch.Tensor, lengths: torch.Tensor | None,
               stored: bool = False, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if rope is not None and (lengths is None or not self.rope_in_kernels()):
            raise ValueError("RotatedTurboStore.attend: RoPE in the kernels is for a decode step where they run "
                             "and no shadow is kept (rope_in_kernels)")
        if rope is not None:
            self._write_codes(layer, k, v, slots, rope)
        else:
            self.fill(layer, k, v, slots, seq_start)
        S = mask.shape[-1]
        if self.kernels and lengths is not None:
            from engines.kernels.turbo_kv import decode_attention

            out = decode_attention(q[:, :, 0], self.codes[0, layer, :, :, :S], self.norms[0, layer, :, :, :S],
                                   self.codes[1, layer, :, :, :S], self.norms[1, layer, :, :, :S],
                                   lengths, int(self.fmt.bits), self.fmt.seed, rope=rope)
            return out[:, :, None].to(q.dtype)
        if self.kernels and not self.has_shadow and isinstance(mask, Causal):  # once per sequence: keep nothing
            kq, vq = self.dequantized(layer, S)
        else:  # a pass that reads the whole cache again and again: the shadow, made once from the codes
            self.ensure_shadow()
            kq, vq = self.kq[layer, :, :, :S], self.vq[layer, :, :, :S]
        rotation = self.fmt.rotation(q.shape[-1], q.device)
        return rotated_attention(q, kq, vq, rotation.to(q.dtype), mask)

    def _write_codes(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Quantize-on-write of the new slots by the Triton kernel: codes and norms, and the
        rotated-domain values into the shadow once it exists (DEQUANT on only then); rope: the
        keys come before RoPE, which the kernel applies as it reads them."""
        from engines.kernels.turbo_kv import write_slots

        xs = [x if x.stride(-1) == 1 else x.contiguous() for x in (k, v)]
        shadow = [self.kq[layer], self.vq[layer]] if self.has_shadow else None
        write_slots(xs, slots, self.codes[:, layer], self.norms[:, layer], shadow, int(self.fmt.bits), self.fmt.seed,
                    rope=rope)
