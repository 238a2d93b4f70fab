"""Canary drills: seeded faults of known size inside the reference engine (`engine_options.fault`,
shaped and validated in engines/spec.py). A drill proves that the canary catches a fault of a
given size; it is never a deployment setting. Without a fault every hook returns its input as it
is, so a config without one computes exactly what it did before.

  weight-noise σ    every decoder linear's weight W (q, k, v, o, gate, up, down) + N(0, (σ·std W)²),
                    drawn once at load from `seed`, before any quantization (a damaged checkpoint)
  kv-corrupt k, σ   the KV cache of the first k layers: each written slot's key (value) + σ·s·z,
                    s the std of the keys (values) that write holds, z a fixed N(0, 1) table per
                    layer, KV head, slot and channel drawn from `seed` (so a slot's noise does not
                    depend on batching or call order), zero below `from_slot` (default 0). The
                    format turns lossy, so perplexity windows go through the cache too; k = 0 is
                    no fault
  token-corrupt p   after verification and sampling, each emitted token is replaced with
                    probability p by another vocabulary id (uniform over the rest), decided per
                    (seed, request id, position); the text is decoded from the corrupted ids, the
                    model goes on from the tokens it picked (a sampler-to-output or detokenizer bug).
                    Requested generation log-probs stay those of the picked tokens
  ttft-delay d      a sleep of d ms after a generation's clock starts, before its prefill: each
                    request's ttft_ms grows by at least d (once per batch of `concurrency` requests)
  logprob-shift s   every prompt log-prob (loglikelihood_rolling, and the served echo) lowered by s
                    nats: the perplexity ratio against the same engine without it is exactly e^s
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch

from engines.drills import (
    Fault,
    KVCorruptFault,
    LogprobShiftFault,
    TokenCorruptFault,
    TTFTDelayFault,
    WeightNoiseFault,
    parse_fault,
)
from engines.protocol import GenerationResult, SpeculativeStats
from engines.reference.kv.base import DequantizedStore, KVFormat, KVStore

if TYPE_CHECKING:
    from engines.reference.model import DecoderLayer, Transformer

OnTokens = Callable[[str, list[int], "SpeculativeStats | None"], None]


class EngineFault:
    """The hooks the reference engine calls at load, per cache, per generation and per score."""

    def __init__(self, options: dict | None, kv_cache: str, vocab_size: int, decode: Callable[[list[int]], str]):
        self.fault: Fault | None = parse_fault(options, kv_cache) if options is not None else None
        self.vocab_size, self.decode = vocab_size, decode

    @property
    def notes(self) -> tuple[str, ...]:
        """What describe() says about the drill, so no figure of it passes for a real config's."""
        if self.fault is None:
            return ()
        size = ", ".join(f"{k}={v}" for k, v in self.fault.model_dump().items() if k != "kind")
        return (f"canary drill: fault {self.fault.kind} ({size}) injected; not a deployment setting",)

    @property
    def weights_tag(self) -> str:
        """Appended to the AWQ cache key: noised weights are another model, never the clean one's entry."""
        fault = self.fault
        return f"-weight-noise-{fault.sigma}-{fault.seed}" if isinstance(fault, WeightNoiseFault) else ""

    # -- load ------------------------------------------------------------------------------------------
    def corrupt_weights(self, model: Transformer) -> None:
        if not isinstance(self.fault, WeightNoiseFault):
            return
        from engines.reference.model import layer_linears
        gen = torch.Generator().manual_seed(self.fault.seed)
        with torch.no_grad():
            for layer in cast("Iterable[DecoderLayer]", model.model.layers):
                for _, lin in layer_linears(layer):
                    w = lin.weight
                    w.add_(self.fault.sigma * w.std() * torch.randn(w.shape, generator=gen, dtype=w.dtype))

    def corrupt_kv(self, fmt: KVFormat, n_layers: int, context: int) -> KVFormat:
        if not isinstance(self.fault, KVCorruptFault) or self.fault.layers == 0:
            return fmt
        if self.fault.layers > n_layers:
            raise ValueError(f"engine_options.fault.layers: {self.fault.layers} exceeds this model's {n_layers} "
                             f"layers; use 0 to {n_layers}")
        if self.fault.from_slot >= context:  # the drill would inject nothing
            raise ValueError(f"engine_options.fault.from_slot: {self.fault.from_slot} is past this model's context of "
                             f"{context} slots; use 0 to {context - 1}")
        return CorruptedKV(fmt, self.fault)

    # -- generation ------------------------------------------------------------------------------------
    def before_first_token(self) -> None:
        if isinstance(self.fault, TTFTDelayFault) and self.fault.delay_ms > 0:
            time.sleep(self.fault.delay_ms / 1000)

    def _emitted(self, request_id: str, ids: Sequence[int], start: int = 0) -> list[int]:
        """The ids as emitted: token i (at position start + i) replaced with probability `rate`."""
        fault = self.fault
        if not isinstance(fault, TokenCorruptFault):
            return list(ids)
        out = []
        for position, token in enumerate(ids, start):
            rng = random.Random(f"{fault.seed}:{request_id}:{position}")  # str seeds hash with SHA-512: stable
            if rng.random() < fault.rate:
                other = rng.randrange(self.vocab_size - 1)
                token = other + (other >= token)  # uniform over every id but the picked one
            out.append(token)
        return out

    def stream(self, on_tokens: OnTokens | None) -> OnTokens | None:
        """The streaming hook, seeing the ids as emitted (one generate() call)."""
        if on_tokens is None or not isinstance(self.fault, TokenCorruptFault):
            return on_tokens
        sent: dict[str, int] = {}
        hook = on_tokens

        def emit(request_id: str, ids: list[int], step: SpeculativeStats | None) -> None:
            start = sent.get(request_id, 0)
            sent[request_id] = start + len(ids)
            hook(request_id, self._emitted(request_id, ids, start), step)

        return emit

    def results(self, results: list[GenerationResult]) -> list[GenerationResult]:
        if not isinstance(self.fault, TokenCorruptFault):
            return results
        out = []
        for result in results:
            ids = self._emitted(result.request_id, result.token_ids)
            out.append(replace(result, token_ids=tuple(ids), text=self.decode(ids)))
        return out

    # -- scoring ---------------------------------------------------------------------------------------
    def prompt_logprobs(self, logprobs: list[float]) -> list[float]:
        if not isinstance(self.fault, LogprobShiftFault):
            return logprobs
        return [x - self.fault.nats for x in logprobs]


class CorruptedKV(KVFormat):
    """`inner` as it stores each slot, then noise on the first `fault.layers` layers (kv-corrupt).
    Always lossy, so every pass reads the cache; stored through the torch path (no kernels, no
    CUDA graphs: a drill's speed is not what it measures)."""

    lossy = True

    def __init__(self, inner: KVFormat, fault: KVCorruptFault):
        self.inner, self.fault = inner, fault
        self.name = inner.name
        self.noise: torch.Tensor | None = None  # [layers, 2 (k, v), Hkv, context, D], set by calibrate

    @property
    def graph_blocker(self) -> str | None:
        return f"kv_cache {self.name} with a kv-corrupt canary drill"

    @property
    def slots_on_their_own(self) -> bool:
        return False  # the noise is drawn per slot: a slot must be its position

    def calibrate(self, model: Transformer) -> None:
        self.inner.calibrate(model)
        a = model.args
        gen = torch.Generator().manual_seed(self.fault.seed)
        self.noise = torch.randn(self.fault.layers, 2, a.n_kv_heads, a.max_seq_len, a.head_dim, generator=gen)
        self.noise[:, :, :, : self.fault.from_slot] = 0  # slots before from_slot stay clean

    def encode(self, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor,
               layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.encode(k, v, seq_start, layer) if self.inner.lossy else (k, v)

    def bits_per_element(self, head_dim: int) -> tuple[float, float]:
        return self.inner.bits_per_element(head_dim)

    def new_store(self, k: torch.Tensor, v: torch.Tensor) -> KVStore:
        return CorruptedStore(self, k, v)


class CorruptedStore(DequantizedStore):
    fmt: CorruptedKV

    def __init__(self, fmt: CorruptedKV, k: torch.Tensor, v: torch.Tensor):
        super().__init__(fmt, k, v)
        if fmt.noise is None:
            raise RuntimeError("kv-corrupt: calibrate(model) draws the noise table before a cache is made")
        self.noise = fmt.noise.to(device=k.device, dtype=torch.float32)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, seq_start: torch.Tensor) -> None:
        kq_new, vq_new = self.fmt.encode(k, v, seq_start, layer)  # [B, Hkv, T, D]
        if layer < self.fmt.fault.layers:
            sigma = self.fmt.fault.sigma
            z = self.noise[layer].index_select(2, slots)  # [2, Hkv, T, D]
            kq_new = (kq_new.float() + sigma * k.float().std() * z[0]).to(kq_new.dtype)
            vq_new = (vq_new.float() + sigma * v.float().std() * z[1]).to(vq_new.dtype)
        self.kq[layer].index_copy_(2, slots, kq_new)
        self.vq[layer].index_copy_(2, slots, vq_new)
