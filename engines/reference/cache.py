"""Static KV cache: slots and masks.

k, v: [L, B, Hkv, S, D]. A forward pass writes its new keys/values at their slots, then every
query attends over the slots its mask allows. Writes go through `index_copy_` at a slot tensor
and reads span the mask's width, so a decode step with a fixed-width mask has static shapes and
no host sync (engines/reference/decode.py captures it as a CUDA graph). The KV format (kv.py)
owns everything else: the buffers it keeps beside the raw keys and values (its store), how a
written slot is encoded into them, and the attention a query runs over them — its torch path,
or its decode kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.reference.attention import Causal
from engines.reference.kv import KVFormat
from engines.reference.kv.base import decode_lengths, float_attention


class KVCache:
    def __init__(self, n_layers: int, batch: int, slots: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, fmt: KVFormat):
        shape = (n_layers, batch, n_kv_heads, slots, head_dim)
        # raw keys and values only where the format reads them (KVFormat.keeps_raw); otherwise k
        # and v are one zero broadcast to the cache's shape (2 bytes: shapes and devices still
        # answer), never written, and the store holds everything the cache has
        self.keeps_raw = fmt.keeps_raw
        if self.keeps_raw:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.k = self.v = torch.zeros((), dtype=dtype, device=device).expand(shape)
        self.fmt = fmt
        self.store = fmt.new_store(self.k, self.v)
        self.seq_start = torch.zeros(batch, dtype=torch.long, device=device)
        self._lengths: tuple[torch.Tensor, torch.Tensor] | None = None  # (slots, lengths) of the pass at layer 0

    def nbytes(self) -> int:
        """Bytes held: the raw cache where the format keeps one, and every buffer of the format's
        store (dequantized values, or the kernels' packed codes)."""
        raw = self.k.nbytes + self.v.nbytes if self.keeps_raw else 0
        return raw + sum(t.nbytes for t in self.store.buffers())

    def zero_(self) -> None:
        """Every slot and every buffer of the store back to zeros (a cache reused for a new sequence)."""
        if self.keeps_raw:
            self.k.zero_()
            self.v.zero_()
        for t in self.store.buffers():
            t.zero_()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store k, v [B, Hkv, T, D] at `slots` [T] as a pass would, without attending: the raw
        cache (where kept) and the format's store (decode.Decoder.fill_synthetic)."""
        if self.keeps_raw:
            self.k[layer].index_copy_(2, slots, k)
            self.v[layer].index_copy_(2, slots, v)
        self.store.fill(layer, k, v, slots, self.seq_start)

    @property
    def seq_start(self) -> torch.Tensor:
        """[B] first real slot per row (left padding)."""
        return self._seq_start

    @seq_start.setter
    def seq_start(self, value: torch.Tensor) -> None:
        self._seq_start = value
        # read once here, never inside a decode step (a cache on the meta device, sized only, has none)
        self.left_padded = False if value.is_meta else bool(value.any())

    def rope_destination(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a fused RoPE kernel may store a decode step's new keys and values itself
        (engines/kernels/fused.rope_store), the step then attending with stored=True: the raw
        cache where one is kept (lossless formats, KIVI), or the store's codes where it keeps them
        in a type the kernel writes (fp8); None for a store that encodes its own way (TurboQuant,
        the int formats)."""
        if self.keeps_raw:  # the raw cache: a lossless format's, or KIVI's (its store reads it and codes from it)
            return self.k[layer], self.v[layer]
        return self.store.code_destination(layer)

    def rope_in_store(self) -> bool:
        """Whether a decode step may pass q and k before RoPE with attend's rope=(cos, sin): the
        store's kernels rotate them as they read them (TurboQuant: KVStore.rope_in_kernels)."""
        return not self.left_padded and self.store.rope_in_kernels()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal | int | None, stored: bool = False,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q: [B, H, T, D]; k, v: [B, Hkv, T, D] for `slots` [T]; mask: [B, 1, T, S], or None
        for a first pass over slots 0…T−1 with no padding (causal over the new tokens; Causal: the
        same, read through a lossy format's store, as decode.Decoder's CUDA prefill asks), or an int
        n for one new token per row that attends all of slots 0…n−1 (an eager decode step with no
        left padding: a lossless format reads just those slots with no mask; a lossy one gets the
        all-True mask as wide). stored: k and v are already where rope_destination said. rope:
        (cos, sin), q and k come before RoPE, for a decode step where rope_in_store()."""
        if rope is not None and self.keeps_raw:
            raise ValueError("KVCache.attend: rope (keys before RoPE) where the raw cache would store them unrotated")
        if self.keeps_raw and not stored:
            self.k[layer].index_copy_(2, slots, k)
            self.v[layer].index_copy_(2, slots, v)
        if isinstance(mask, int):
            if not self.fmt.lossy and not self.left_padded:
                lengths = self._step_lengths(layer, q, slots) if q.shape[2] == 1 else None
                return float_attention(q, self.k[layer, :, :, :mask], self.v[layer, :, :, :mask], None, lengths)
            mask = torch.ones(q.shape[0], 1, q.shape[2], mask, dtype=torch.bool, device=q.device)
        S = mask.shape[-1] if mask is not None else len(slots)
        if mask is None and not self.fmt.lossy:  # prefill: causal flash / memory-efficient SDPA, no mask
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if mask is None:
            mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()[None, None]
        # a decode step: one new token per row, no left padding (the decode kernels' case)
        lengths = self._step_lengths(layer, q, slots) if q.shape[2] == 1 and not self.left_padded else None
        return self.store.attend(layer, q, k, v, slots, mask, self.seq_start, lengths, stored, rope)

    def _step_lengths(self, layer: int, q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """A decode step's [B] sequence lengths, made once per pass (at layer 0, which every
        forward pass starts with) and read by every later layer: one launch a step, not one a layer."""
        if layer == 0 or self._lengths is None or self._lengths[0] is not slots:
            self._lengths = (slots, decode_lengths(q, slots))
        return self._lengths[1]


class NoCache:
    """A single causal pass with a lossless KV format needs no cache (perplexity windows):
    attention runs on the new keys and values directly, with the causal SDPA kernel. lengths:
    the pass holds several sequences end to end in one row (no padding), each causal on its own."""

    def __init__(self, lengths: list[int] | None = None):
        self.lengths = lengths

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal | int | None) -> torch.Tensor:
        if self.lengths is None or len(self.lengths) == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return torch.cat([F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                          for qs, ks, vs in zip(q.split(self.lengths, 2), k.split(self.lengths, 2),
                                                v.split(self.lengths, 2), strict=True)], dim=2)
