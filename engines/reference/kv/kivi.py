"""KIVI (jy-yuan/KIVI): per-channel keys and per-token values, with a full-precision recent window."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engines.quant import minmax_quant
from engines.reference.attention import Causal, masked_gqa_attention, two_tier_attention, windowed_causal_attention
from engines.reference.kv.base import FP16_BITS, DequantizedStore, KVFormat, KVStore, kernels_fit


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

    @property
    def causal_prefill(self) -> bool:
        """An unpadded first pass knows every query's window from its position alone: far slots
        through one causal flash pass, the near window in blocks (windowed_causal_attention)."""
        return True

    @property
    def raw_slots(self) -> int:
        """boundary_k(n) and boundary_v(n) are 0 for n ≤ R: up to R tokens, every key and value is read raw."""
        return self.residual

    def boundary_k(self, n: torch.Tensor) -> torch.Tensor:
        return ((n - 1).clamp(min=0) // self.residual) * self.residual

    def boundary_v(self, n: torch.Tensor) -> torch.Tensor:
        return (n - 1 - self.residual).clamp(min=0)

    def encode(self, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor,
               layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
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

    def read_back(self, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor,
                  layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """What the token after these S reads back: keys coded up to the last multiple of R
        (boundary_k), values up to R before the end (boundary_v); the rest full precision."""
        kq, vq = self.encode(k, v, seq_start, layer)
        n = torch.tensor(k.shape[2] + 1)
        kb, vb = int(self.boundary_k(n)), int(self.boundary_v(n))
        kq[:, :, kb:], vq[:, :, vb:] = k[:, :, kb:], v[:, :, vb:]
        return kq, vq

    def bits_per_element(self, head_dim: int) -> tuple[float, float]:
        """Quantized part only; the full-precision window (up to R keys, R values) comes on top."""
        per_group = 2 * FP16_BITS / self.group  # scale + zero per G elements, on either axis
        return self.bits + per_group, self.bits + per_group

    def new_store(self, k: torch.Tensor, v: torch.Tensor) -> KVStore:
        return KiviStore(self, k, v)


class KiviStore(DequantizedStore):
    """Key groups span tokens, so a pass re-encodes whole groups of the slots it reads (a
    transient copy, one layer at a time: nothing dequantized is kept between passes), and a
    query reads slot j compressed iff j < boundary(n), n its sequence length (two-tier attention).
    Decode steps where the kernels run take the two-tier kernel instead, over packed codes written
    as slots leave the full-precision window (made with the store where kernels run; the next
    multi-token pass re-encodes all groups). The raw cache stays: the window is read from it and
    groups are coded from it."""

    fmt: KiviKV

    def __init__(self, fmt: KiviKV, k: torch.Tensor, v: torch.Tensor):
        super().__init__(fmt, k, v)
        self.packed: dict[str, torch.Tensor] = {}
        self._bounds: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (lengths, nk, nv) of a pass
        L = k.shape[0]
        self.packed_k, self.packed_v = [0] * L, [0] * L  # per layer: leading slots whose codes are written
        if kernels_fit(k):
            self._packed()

    @property
    def shadow_at_start(self) -> bool:
        return False  # and never made: a pass re-encodes the slots it reads from the raw cache

    def buffers(self) -> list[torch.Tensor]:
        return list(self.packed.values())

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, seq_start: torch.Tensor) -> None:
        """Nothing beyond the raw cache: codes are written as slots leave the window (before_step)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal, seq_start: torch.Tensor, lengths: torch.Tensor | None,
               stored: bool = False, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if lengths is not None and kernels_fit(q):
            return self._kernel_attend(layer, q, slots, lengths)
        S = mask.shape[-1]
        keys, values = self.k[layer, :, :, :S], self.v[layer, :, :, :S]
        if S <= self.fmt.raw_slots:  # no query of a pass this short reads a slot compressed: nothing to encode
            return masked_gqa_attention(q, keys, values, mask)
        kq, vq = self.fmt.encode(keys, values, seq_start, layer)
        if isinstance(mask, Causal):  # slots 0…S−1, no padding: no [S, S] mask or scores
            return windowed_causal_attention(q, keys, values, kq, vq, self.fmt.residual)
        ck = _compressed_mask(slots, S, seq_start, self.fmt.boundary_k)
        cv = _compressed_mask(slots, S, seq_start, self.fmt.boundary_v)
        return two_tier_attention(q, keys, values, kq, vq, mask, ck, cv)

    def graph_blocker(self, left_padded: bool) -> str | None:
        """Where the kernels run and no row is left-padded, a decode step is the two-tier kernel
        over codes that before_step wrote: capturable. Elsewhere groups re-encode on the host."""
        return None if kernels_fit(self.k) and not left_padded else self.fmt.graph_blocker

    def reset(self) -> None:
        self.packed_k, self.packed_v = [0] * len(self.packed_k), [0] * len(self.packed_v)

    def before_step(self, slot: int) -> None:
        """Where the kernels run: the codes of the slots that leave the full-precision window when
        the sequence reaches slot + 1 tokens (a whole key group every R steps, one value a step).
        Every layer in one call where all stand at the same slots and the flush is a step's (a
        handful of launches a step, not a handful per layer); layer by layer for the first flush
        after a long prefill, which copies what it codes (all layers at once: 16 GiB at 128K on
        an 8B shape). Those slots were all written by earlier passes."""
        if not kernels_fit(self.k):
            return
        nk, nv = self._boundaries(slot)
        R = self.fmt.residual
        if (len(set(self.packed_k)) == 1 and len(set(self.packed_v)) == 1
                and nk - self.packed_k[0] <= R and nv - self.packed_v[0] <= R):
            self._flush(slice(None), slot)
        else:
            for layer in range(self.k.shape[0]):
                self._flush(layer, slot)

    def _boundaries(self, t: int) -> tuple[int, int]:
        """(keys, values) read compressed by the query at slot t: boundary_k and boundary_v at n = t + 1."""
        n = torch.tensor(t + 1)  # a CPU scalar: no device read
        return int(self.fmt.boundary_k(n)), int(self.fmt.boundary_v(n))

    def _flush(self, layer: int | slice, t: int) -> None:
        """KIVI codes written by the quantize-on-write kernels for the query at slot t: keys in
        whole flushes, values token by token, each once; `layer` one layer or slice(None), all
        (standing at the same slots)."""
        from engines.kernels.kivi_kv import GROUP, quantize_keys, quantize_values

        bits, D = self.fmt.bits, self.k.shape[-1]
        layers = range(self.k.shape[0])[layer] if isinstance(layer, slice) else [layer]
        c = self._packed()
        nk, nv = self._boundaries(t)
        lo = self.packed_k[layers[0]]
        if nk > lo:  # a flush: whole groups of GROUP tokens
            keys = self.k[layer, ..., lo:nk, :]  # [(L,) B, Hkv, nk − lo, D]: rows of one group stay together
            codes, scale, zero = quantize_keys(keys.reshape(-1, D), bits)
            lead, n_g = keys.shape[:-2], (nk - lo) // GROUP
            c["kc"][layer, ..., lo:nk, :] = codes.reshape(*lead, nk - lo, -1)
            c["ks"][layer, ..., lo // GROUP : nk // GROUP, :] = scale.reshape(*lead, n_g, D)
            c["kz"][layer, ..., lo // GROUP : nk // GROUP, :] = zero.reshape(*lead, n_g, D)
            for i in layers:
                self.packed_k[i] = nk
        lo = self.packed_v[layers[0]]
        if nv > lo:
            values = self.v[layer, ..., lo:nv, :]
            codes, scale, zero = quantize_values(values.reshape(-1, D), bits)
            lead = values.shape[:-2]
            c["vc"][layer, ..., lo:nv, :] = codes.reshape(*lead, nv - lo, -1)
            c["vs"][layer, ..., lo:nv, :] = scale.reshape(*lead, nv - lo, -1)
            c["vz"][layer, ..., lo:nv, :] = zero.reshape(*lead, nv - lo, -1)
            for i in layers:
                self.packed_v[i] = nv

    def _packed(self) -> dict[str, torch.Tensor]:
        """The code buffers, made on first use (a capture's warm-up step makes them, before any flush)."""
        from engines.kernels.kivi_kv import GROUP

        if not self.packed:
            L, B, Hkv, S_max, D = self.k.shape
            words, groups = D * self.fmt.bits // 32, -(-S_max // GROUP)
            z = lambda *shape, dtype=torch.float32: torch.zeros(L, B, Hkv, *shape, dtype=dtype, device=self.k.device)  # noqa: E731
            self.packed = {"kc": z(S_max, words, dtype=torch.int32), "ks": z(groups, D), "kz": z(groups, D),
                           "vc": z(S_max, words, dtype=torch.int32), "vs": z(S_max, D // GROUP),
                           "vz": z(S_max, D // GROUP)}
        return self.packed

    def _kernel_attend(self, layer: int, q: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The two-tier kernel over the codes written as slots left the full-precision window.
        With steps_prepared (decode.Decoder calls before_step) nothing here reads the host: the
        lengths [B] (the cache's, made once per pass) and the boundaries are on the device, so the
        step can be captured. The boundaries too are made once per pass (for its first layer's
        lengths tensor) and read by every layer."""
        from engines.kernels.kivi_kv import decode_attention

        if not self.steps_prepared:
            self._flush(layer, int(slots[-1]))
        c = self._packed()
        if self._bounds is None or self._bounds[0] is not lengths:
            self._bounds = (lengths, self.fmt.boundary_k(lengths), self.fmt.boundary_v(lengths))
        _, nk, nv = self._bounds
        out = decode_attention(q[:, :, 0], self.k[layer], self.v[layer],
                               c["kc"][layer], c["ks"][layer], c["kz"][layer], c["vc"][layer], c["vs"][layer],
                               c["vz"][layer], lengths, nk, nv, self.fmt.bits)
        return out[:, :, None].to(q.dtype)


def _compressed_mask(slots: torch.Tensor, S: int, seq_start: torch.Tensor,
                     boundary: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    # [B, 1, T, S]: query at slot t (sequence length n = t − start + 1) reads j compressed
    # iff (j − start) < boundary(n).
    start = seq_start[:, None, None]  # [B, 1, 1]
    n = slots[None, :, None] - start + 1  # [B, T, 1]
    j = torch.arange(S, device=slots.device)[None, None, :] - start  # [B, 1, S]
    return (j < boundary(n))[:, None]
