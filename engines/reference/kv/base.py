"""The format interface (KVFormat) and the storage every format builds on: KVStore (the raw
slots) and DequantizedStore (dequantized values beside them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engines.kernels import use_triton
from engines.reference.attention import Causal, masked_gqa_attention

if TYPE_CHECKING:
    from engines.reference.model import Transformer

FP16_BITS = 16


class KVFormat:
    name = "base"
    lossy = True
    rotated = False  # stored values live in a rotated domain (TurboQuant): attention rotates q once

    def encode(self, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor,
               layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, Hkv, S, D] raw → what the cache holds for them (same shapes)."""
        raise NotImplementedError

    def read_back(self, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor,
                  layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """What the cache gives back for raw k, v [B, Hkv, S, D] to the token after them, in their
        own domain (a format that stores a rotated domain rotates back; one that keeps a recent
        window in full precision gives that window raw)."""
        return self.encode(k, v, seq_start, layer)

    def boundary_k(self, n: torch.Tensor) -> torch.Tensor:
        """Leading key positions held compressed when the sequence holds n tokens (all of them,
        the current one included, unless the format keeps a full-precision window)."""
        return n

    def boundary_v(self, n: torch.Tensor) -> torch.Tensor:
        return n

    @property
    def windowed(self) -> bool:
        return False

    @property
    def slots_on_their_own(self) -> bool:
        """Whether each slot is stored from its own key and value alone, whatever else a pass
        holds and wherever the slot lies: then a pass may lay its sequences at any slots (several
        windows end to end in a row, a choice tree). Not a windowed format (KIVI reads a slot raw
        or compressed by its place)."""
        return not self.windowed

    @property
    def raw_slots(self) -> int:
        """How many slots a pass may hold with every one of them read raw, by any query: none for
        a format that compresses each slot as it is written; a windowed one's full-precision window
        (a pass that short is lossless, and its slots may lie anywhere in the cache)."""
        return 0

    @property
    def causal_prefill(self) -> bool:
        """Whether a first pass with no padding may attend under attention.Causal (SDPA's causal
        kernel over what the cache holds, no mask built): every format whose stored slots read
        the same for every query. A windowed one reads a slot raw or compressed by the query's
        position, so it needs attention of its own for this (KIVI has one), else a mask, a chunk
        of queries at a time."""
        return not self.windowed

    @property
    def graph_blocker(self) -> str | None:
        """Why a decode step over this format cannot be captured as a CUDA graph, or None."""
        if self.windowed:
            return f"kv_cache {self.name}: whole token groups are re-encoded on the host's schedule"
        return None

    @property
    def keeps_raw(self) -> bool:
        """Whether a cache of this format keeps the raw keys and values beside its store. A
        lossless format reads them; a windowed one (KIVI) reads recent slots raw and re-encodes
        whole groups from them. Every other lossy format reads only what its store holds (codes,
        or each slot's dequantized value), so its cache keeps no raw copy."""
        return not self.lossy or self.windowed

    def calibrate(self, model: Transformer) -> None:
        """Choices a format makes from the model's weights before use (fractional TurboQuant's outlier channels)."""

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

    # True while a decode loop runs a step it called before_step for (decode.Decoder)
    steps_prepared = False

    def buffers(self) -> list[torch.Tensor]:
        """Tensors held beside the raw cache, counted in the cache's bytes."""
        return []

    def graph_blocker(self, left_padded: bool) -> str | None:
        """Why a decode step over this store cannot be captured as a CUDA graph, or None."""
        return self.fmt.graph_blocker

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, seq_start: torch.Tensor) -> None:
        """Store new slots k, v [B, Hkv, T, D] at `slots` [T] as attend would, without attending
        (decode.Decoder.fill_synthetic): nothing beyond the raw cache here."""

    def reset(self) -> None:
        """A new sequence starts at slot 0 (decode.Decoder's prefill): forget what was derived from
        an earlier one (KIVI's count of slots already coded). Slots themselves are rewritten as written."""

    def before_step(self, slot: int) -> None:
        """Work a decode step at `slot` (known on the host) needs done first, outside a captured
        graph: nothing here (KIVI flushes whole key groups on the host's schedule)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal, seq_start: torch.Tensor, lengths: torch.Tensor | None,
               stored: bool = False, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q: [B, H, T, D]; k, v: [B, Hkv, T, D] new, already in the raw cache at `slots` [T];
        mask: [B, 1, T, S] or Causal; seq_start: [B] first real slot per row; lengths: [B] sequence
        lengths on the device for a decode step (one new token per row, no left padding: where a
        decode kernel may run), else None; stored: the new slots' codes are already in the store
        (written by the fused RoPE kernel at code_destination); rope: (cos, sin) [B, 1, 1, D] when q
        and k come unrotated and the store's kernels apply RoPE themselves (rope_in_kernels) →
        [B, H, T, D]."""
        S = mask.shape[-1]
        return float_attention(q, self.k[layer, :, :, :S], self.v[layer, :, :, :S], mask, lengths)

    def rope_in_kernels(self) -> bool:
        """Whether a decode step may hand this store its queries and keys before RoPE, with cos and
        sin (attend's rope): its write and attention kernels rotate them as they read them, so the
        fused step makes no RoPE launch of its own (TurboQuant's quantize-on-write). None here."""
        return False

    def code_destination(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a fused RoPE kernel may write a step's new keys and values itself, as this store
        holds them (engines/kernels/fused.rope_store: a float type, or fp8 e4m3 saturated), or None
        when the store encodes them its own way. Then attend is called with stored=True."""
        return None


class DequantizedStore(KVStore):
    """A lossy format whose slots encode on their own: each slot's dequantized value kq, vq
    [L, B, Hkv, S, D] (the shadow), encoded once when the slot is written; every readable slot is
    read compressed, the current one too. A store whose kernels read packed codes (fp8 and
    whole-bit TurboQuant where the kernels run) starts with the codes only: its decode steps and an
    unpadded first pass read them; the first pass that needs the whole cache dequantized again and
    again (a left-padded decode step, a speculative verify pass, a masked prefill chunk) makes the
    shadow from the codes once (ensure_shadow), and from then on each write fills both."""

    kq: torch.Tensor
    vq: torch.Tensor

    def __init__(self, fmt: KVFormat, k: torch.Tensor, v: torch.Tensor):
        super().__init__(fmt, k, v)
        self.has_shadow = False
        if self.shadow_at_start:
            self._allocate_shadow()

    @property
    def shadow_at_start(self) -> bool:
        """Whether the shadow is made with the store (the torch path reads nothing else)."""
        return True

    def _allocate_shadow(self) -> None:
        # torch.zeros, not zeros_like: a cache without a raw copy passes an expanded k
        self.kq = torch.zeros(self.k.shape, dtype=self.k.dtype, device=self.k.device)
        self.vq = torch.zeros(self.v.shape, dtype=self.v.dtype, device=self.v.device)
        self.has_shadow = True

    def ensure_shadow(self) -> None:
        """Make the shadow from the codes written so far, once (a store that starts with it has it)."""
        if not self.has_shadow:
            self._allocate_shadow()
            for layer in range(self.k.shape[0]):
                self.kq[layer], self.vq[layer] = self.dequantized(layer, self.k.shape[3])

    def dequantized(self, layer: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots 0…S−1 of a layer dequantized from the codes, in the cache's dtype (stores with codes)."""
        raise NotImplementedError

    def buffers(self) -> list[torch.Tensor]:
        return [self.kq, self.vq] if self.has_shadow else []

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, seq_start: torch.Tensor) -> None:
        kq_new, vq_new = self.fmt.encode(k, v, seq_start, layer)
        self.kq[layer].index_copy_(2, slots, kq_new)
        self.vq[layer].index_copy_(2, slots, vq_new)

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, seq_start: torch.Tensor) -> None:
        """Store new slots as attend does, without attending (a synthetic cache's fill)."""
        self.write(layer, k, v, slots, seq_start)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal, seq_start: torch.Tensor, lengths: torch.Tensor | None,
               stored: bool = False, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        self.write(layer, k, v, slots, seq_start)
        S = mask.shape[-1]
        return float_attention(q, self.kq[layer, :, :, :S], self.vq[layer, :, :, :S], mask, lengths)


def float_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor | Causal | None, lengths: torch.Tensor | None) -> torch.Tensor:
    """Attention over a cache held as floats (raw, or each slot's dequantized value): a decode
    step takes the grouped decode kernel where kernels run (on CUDA: 2 launches instead of
    masked SDPA's, which on H200 took 50 µs a layer at 1K and 1.3 ms at 32K:
    benchmarks/results/gpu), else masked GQA attention. lengths: [B] for a decode step, else None."""
    if lengths is not None and kernels_fit(q):
        from engines.kernels.decode import float_decode_attention

        return float_decode_attention(q[:, :, 0], keys, values, lengths)[:, :, None]
    return masked_gqa_attention(q, keys, values, mask)


def kernels_fit(q: torch.Tensor) -> bool:
    """Kernels run for this device (engines/kernels.use_triton) and their packed layouts fit
    the head_dim: a power of two from 32 to 128; other shapes take the torch path."""
    D = q.shape[-1]
    return 32 <= D <= 128 and D & (D - 1) == 0 and use_triton(q.device)


def decode_lengths(q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[B] sequence lengths of a decode step, on the device (no host sync)."""
    return (slots[-1:] + 1).expand(q.shape[0]).contiguous()
