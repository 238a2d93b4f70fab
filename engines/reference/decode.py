"""The decode loop, built the way gpt-fast builds one.

- The KV cache, the positions and the slot index are preallocated; a decode step reads the
  whole static cache under a mask computed on the device from the slot index, so every step has
  the same shapes and allocates nothing the host has to wait for.
- Prefill without left padding and with a lossless cache runs causal SDPA (flash or memory-
  efficient) on the new keys with no mask. A lossy format on CUDA does the same over what its
  cache holds (attention.Causal: every slot written first, then read compressed, the current one
  too; KIVI's window by attention.windowed_causal_attention); with padding, or on the CPU by
  default, queries run a chunk at a time under a mask [B, 1, chunk, S] over the slots written so far, so a 32K prompt
  never holds a [P, P] mask or score matrix (attention.query_chunk sizes the chunk). On an H200
  the chunked path had not finished an fp8-KV 128K prefill in 150 s (benchmarks/results/gpu).
- On CUDA the decode step is captured once as a CUDA graph and replayed, for every sequence the
  decoder serves (the engine keeps one per batch bucket: ReferenceEngine.pooled_decoder; their
  graphs share one memory pool) (docs/reference.md §12: eager
  decoding at batch 1 is bound by kernel launches, not by the GPU). `prepare(pad)` captures it
  before the caller's clock starts, at the last slot: the warm-up writes land there, masked until
  the sequence reaches that slot, whose real step overwrites them before reading. A format whose
  step needs the host (fractional TurboQuant picks channels by mask; KIVI re-encodes whole token
  groups, except where its kernels run: then before_step writes a step's codes outside the
  graph, on the host's schedule, and the captured step reads them) runs eagerly, and so does
  any step whose capture failed (remembered per process, per format and batch, so it is not
  retried); `graphs_reason` says why.
- The only host sync a caller needs per step is reading the chosen token out.

Shapes: B batch, P prompt tokens, S cache slots, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

import torch

from engines.reference.attention import Causal, query_chunk
from engines.reference.cache import KVCache
from engines.reference.kv import KVFormat

if TYPE_CHECKING:
    from engines.reference.model import Transformer


def _sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """On CUDA, keep SDPA off the cuDNN backend: its per-call plan costs ~1.2 ms of host time
    (docs/reference.md §12); flash and memory-efficient attention take static shapes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


_failed_captures: dict[tuple, str] = {}  # (format, batch, device) → why the capture failed


def capture_graph(fn: Callable[[], torch.Tensor], device: torch.device,
                  pool: torch.cuda._POOL_HANDLE | None = None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn() run twice on a side stream (Triton autotuning and lazily made buffers happen there),
    then captured as a CUDA graph → (the graph, fn's output tensor, rewritten by each replay).
    fn must write the same values each time it runs. Raises what the capture raised, with the
    caller's stream restored and waited for."""
    with torch.cuda.device(device):
        caller = torch.cuda.current_stream()
        stream = torch.cuda.Stream()
        try:
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            caller.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                out = fn()
            return graph, out
        finally:
            torch.cuda.set_stream(caller)  # torch.cuda.graph leaves its stream current when capture_end raises
            try:
                caller.synchronize()
            except Exception:  # noqa: BLE001 — a failed capture can leave the stream in error: the caller says why
                pass


class Decoder:
    """Prefill once, then one token per step for a batch of B sequences in a static cache.

    model: a fused engines.reference.model.Transformer; fmt: the KV format; slots: prompt width +
    new tokens. graphs: capture the decode step as a CUDA graph (default: on CUDA)."""

    def __init__(self, model: Transformer, fmt: KVFormat, batch: int, slots: int, device: str | torch.device,
                 dtype: torch.dtype, graphs: bool | None = None, prefill_chunk: int | None = None,
                 causal_prefill: bool | None = None, graph_pool: torch.cuda._POOL_HANDLE | None = None) -> None:
        a = model.args
        self.model, self.fmt, self.batch, self.slots = model, fmt, batch, slots
        self.prefill_chunk = prefill_chunk  # queries per masked prefill pass (default: attention.query_chunk)
        self.device = torch.device(device)
        # a lossy format's unpadded prefill under attention.Causal (default: on CUDA, where the
        # format allows it); the CPU keeps the chunked masked pass its tests' figures come from
        self.causal_prefill = fmt.causal_prefill and (self.device.type == "cuda" if causal_prefill is None
                                                      else causal_prefill)
        self.cache = KVCache(a.n_layers, batch, slots, a.n_kv_heads, a.head_dim, dtype, self.device, fmt)
        self.j = torch.arange(slots, device=self.device)  # [S] slot ids
        self.pad = torch.zeros(batch, dtype=torch.long, device=self.device)  # [B] first real slot per row
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)  # [B, 1] the step's input
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)  # [1] the slot the step writes
        self.next_slot = 0  # the same, on the host, for bounds checks only
        want = self.device.type == "cuda" if graphs is None else graphs
        why_not = self.cache.store.graph_blocker(False)
        if want and self.device.type != "cuda":
            why_not = "CUDA graphs need a CUDA device"
        self._key = (fmt.name, batch, str(self.device))
        if want and why_not is None and self._key in _failed_captures:
            why_not = _failed_captures[self._key]
        self.graphs_wanted = want and why_not is None
        self.graphs_reason = (why_not or "wanted, not captured yet") if want else "off"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_logits: torch.Tensor | None = None
        # a memory pool shared with other decoders' graphs (torch.cuda.graph_pool_handle()): safe
        # while they replay one at a time and each step's logits are read before another replays
        self.graph_pool = graph_pool
        self.captured_padded = False  # the padding kind the captured step was made for

    @property
    def eager_unmasked(self) -> bool:
        """A step reads only the written slots, with no mask (see _step): eager on the CPU, a
        lossless format, no left padding. Elsewhere a step reads the whole static cache under a
        mask made on the device, so its shapes never change (what a CUDA graph needs)."""
        return self.device.type == "cpu" and not self.fmt.lossy and not self.cache.left_padded

    @property
    def graphs_active(self) -> bool:
        return self.graph is not None

    @property
    def capture_refused(self) -> bool:
        """Graphs were wanted, and the store blocked the capture or it failed."""
        return self.graph is None and self.graphs_reason not in ("off", "wanted, not captured yet")

    def prepare(self, pad: torch.Tensor | None = None) -> None:
        """Set the rows' left padding [B] and, where graphs are wanted, capture the decode step
        now (warm-up, Triton autotuning and the capture stay out of the caller's timings). A
        decoder may serve sequence after sequence (the engine keeps one per batch bucket): the
        step captured for the first is replayed for the rest, whose padding must then be of the
        same kind (some rows padded, or none), since the capture froze the kernel-or-SDPA choice."""
        if self.graph is not None and (pad is not None and bool(pad.any())) != self.captured_padded:
            raise ValueError("prepare: rows padded where the captured decode step had none, or the reverse")
        if pad is None:
            self.pad.zero_()
        else:
            self.pad.copy_(pad)
        self.cache.seq_start = self.pad  # in place from here on: a captured step reads this tensor
        self.slot.fill_(self.slots - 1)
        self._capture_if_wanted()

    def prefill(self, ids: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, P] (left-padded where pad [B] > 0; default: the padding given to prepare, or
        none) → logits [B, V] of the last position."""
        P = ids.shape[1]
        if P > self.slots:
            raise ValueError(f"prompt of {P} tokens does not fit a cache of {self.slots} slots")
        if pad is not None and (self.graph is None or torch.equal(pad.to(self.pad), self.pad)):
            self.pad.copy_(pad)
        elif pad is not None:
            raise ValueError("prefill: the padding differs from the one the decode step was captured with (prepare)")
        self.cache.seq_start = self.pad
        self.cache.store.reset()  # a new sequence: nothing the store derived from an earlier one stands
        pos = (self.j[None, :P] - self.pad[:, None]).clamp(min=0)  # [B, P]
        with _sdpa_backends(self.device):
            if not (self.cache.left_padded or self.fmt.lossy):  # causal flash / memory-efficient SDPA, no mask
                logits = self.model(ids, pos, self.j[:P], self.cache, None, last_only=True)[:, -1]
            elif self.causal_prefill and not self.cache.left_padded:  # the same over what the lossy cache holds
                logits = self.model(ids, pos, self.j[:P], self.cache, Causal(P), last_only=True)[:, -1]
            else:
                # a mask is needed: queries go `chunk` at a time over the slots written so far,
                # so the mask [B, 1, C, S] and the scores stay O(chunk × P), never O(P²)
                chunk = self.prefill_chunk or query_chunk(self.batch * self.model.args.n_heads, P)
                bounds = list(range(0, P, chunk))
                if len(bounds) > 1 and P - bounds[-1] == 1:
                    bounds.pop()  # no 1-token chunk: the cache would take it for a decode step
                for t0, t1 in zip(bounds, [*bounds[1:], P], strict=True):
                    slots = self.j[t0:t1]
                    # key j visible to query t iff pad_b ≤ j ≤ t (a padded query sees only itself)
                    jj, tt = self.j[None, None, :t1], slots[None, :, None]
                    mask = ((jj <= tt) & (jj >= self.pad[:, None, None])) | (jj == tt)  # [B, C, t1]
                    logits = self.model(ids[:, t0:t1], pos[:, t0:t1], slots, self.cache, mask[:, None],
                                        last_only=True)[:, -1]
        self.slot.fill_(P)
        self.next_slot = P
        return logits

    def fill_synthetic(self, length: int, seed: int = 0) -> None:
        """Instead of a prefill: slots 0…length−1 of every row and layer hold random keys and
        values N(0, 1), written through the format's own write path (KVCache.write: its
        quantize-on-write kernel where kernels run), with no forward pass and no attention. A
        decode step then reads a cache of `length` tokens as it would after a prompt of that
        length (benchmarks/gpu_slot.py: a batch 16 × 16K cache in seconds, not a prefill's
        minutes). No padding; the next step writes slot `length`."""
        if not 0 < length < self.slots:
            raise ValueError(f"fill_synthetic: length {length} must leave a slot of the {self.slots} free")
        a = self.model.args
        self.pad.zero_()
        self.cache.seq_start = self.pad
        self.cache.store.reset()
        g = torch.Generator(device=self.device).manual_seed(seed)
        slots = self.j[:length]
        dtype = self.cache.k.dtype
        for layer in range(a.n_layers):
            k, v = (torch.randn(self.batch, a.n_kv_heads, length, a.head_dim, generator=g, device=self.device,
                                dtype=torch.float32).to(dtype) for _ in range(2))
            self.cache.write(layer, k, v, slots)
            del k, v
        self.slot.fill_(length)
        self.next_slot = length

    def _step(self) -> torch.Tensor:
        """One decode step on the static buffers: tokens [B, 1] at self.slot → logits [B, V]."""
        if self.eager_unmasked:
            # on the CPU with a lossless cache and no padding: the slots written so far are all
            # visible, so attention reads just those (the host knows how many), with no mask
            with _sdpa_backends(self.device):
                return self.model(self.tokens, self.slot[None, :].expand(self.batch, 1), self.slot, self.cache,
                                  self.next_slot + 1, last_only=True)[:, -1]
        pos, mask = self.step_inputs()
        with _sdpa_backends(self.device):
            return self.model(self.tokens, pos, self.slot, self.cache, mask, last_only=True)[:, -1]

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A masked decode step's positions [B, 1] and mask [B, 1, 1, S] at self.slot, made on
        the device: slot j visible to row b iff pad_b ≤ j ≤ slot."""
        pos = (self.slot[None, :] - self.pad[:, None]).clamp(min=0)  # [B, 1]
        mask = (self.j[None, :] <= self.slot) & (self.j[None, :] >= self.pad[:, None])  # [B, S]
        return pos, mask[:, None, None]

    def advance(self) -> None:
        """The step at self.slot is done: the next one writes the slot after it."""
        self.slot.add_(1)
        self.next_slot += 1

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] (on the device) → logits [B, V] of the next position. With a CUDA graph the
        same output tensor is rewritten by every step: use it before the next one."""
        if self.next_slot >= self.slots:
            raise ValueError(f"the cache's {self.slots} slots are full")
        self.tokens.copy_(tokens.reshape(self.batch, 1))
        with self.prepared_step():
            self._capture_if_wanted()
            if self.graph is not None:
                with torch.cuda.device(self.device):
                    self.graph.replay()
                logits = cast(torch.Tensor, self.graph_logits)  # set by the capture with the graph
            else:
                logits = self._step()
        self.advance()
        return logits

    @contextlib.contextmanager
    def prepared_step(self) -> Iterator[None]:
        """A decode step whose host-scheduled work the store did first (before_step, outside any
        graph; KIVI's codes), and whose attention may count on it (steps_prepared). Skipped under
        left padding, where decode steps take the torch path and read no codes. Prefill passes,
        a one-token chunk included, stay unprepared: the store does such work inline there."""
        store = self.cache.store
        if not self.cache.left_padded:
            store.before_step(self.next_slot)
        store.steps_prepared = True
        try:
            yield
        finally:
            store.steps_prepared = False

    def _capture_if_wanted(self) -> None:
        """Capture the decode step at self.slot unless captured, not wanted, or the store says
        it cannot be for this padding (then the reason is kept and graphs are off for this decoder)."""
        if not self.graphs_wanted or self.graph is not None:
            return
        blocker = self.cache.store.graph_blocker(self.cache.left_padded)
        if blocker is not None:
            self.graphs_wanted, self.graphs_reason = False, blocker
            return
        store = self.cache.store
        prepared, store.steps_prepared = store.steps_prepared, True  # warm-up steps read no host value
        try:
            self._capture()
        finally:
            store.steps_prepared = prepared

    def _capture(self) -> None:
        """Warm up on a side stream (Triton autotuning and lazily made buffers happen here),
        then capture one step. A step rewrites the same slot with the same values, so the warm-up
        steps change nothing the real step would not. A capture that fails leaves the decoder
        eager, with the reason in graphs_reason, the caller's stream restored, and the failure
        remembered so that later decoders of the same format and batch do not try again."""
        self.graphs_wanted = False
        try:
            self.graph, self.graph_logits = capture_graph(self._step, self.device, self.graph_pool)
            self.graphs_reason = "captured"
            self.captured_padded = self.cache.left_padded
        except Exception as e:  # noqa: BLE001 — a capture failure must not fail the request
            self.graph, self.graph_logits = None, None
            self.graphs_reason = f"capture failed, decoding eagerly: {type(e).__name__}: {e}"[:500]
            _failed_captures[self._key] = self.graphs_reason
