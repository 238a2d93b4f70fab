"""Float formats (fp16, bf16, fp32, fp8 e4m3) and uniform per-token integers (int8, int4, int2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.kernels import fp8_native, on_kernel_path
from engines.quant import minmax_quant
from engines.reference.attention import Causal, masked_gqa_attention
from engines.reference.kv.base import FP16_BITS, DequantizedStore, KVFormat, KVStore, kernels_fit


@dataclass
class FloatKV(KVFormat):
    """Keys and values stored as `dtype`. Lossy (each value rounded as it is stored) only when that
    type is narrower than what the model computes in and is not the weights' own type: fp16 KV for
    fp16 weights computed in fp32 on a CPU stores what an fp16 engine would, so it rounds nothing
    more than the rest of the model's activations do (engines/reference/engine.py compute_dtype_for)."""

    dtype: torch.dtype
    compute_dtype: torch.dtype
    weights_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[self.dtype]
        self.lossy = self.dtype not in (self.compute_dtype, self.weights_dtype)

    def encode(self, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor,
               layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return k.to(self.dtype).to(k.dtype), v.to(self.dtype).to(v.dtype)

    def bits_per_element(self, head_dim: int) -> tuple[float, float]:
        bits = torch.finfo(self.dtype).bits
        return float(bits), float(bits)


class Fp8KV(KVFormat):
    """fp8 e4m3 with unit scale (vLLM's kv_cache_dtype="fp8" without calibrated scales)."""

    name = "fp8"

    def encode(self, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor,
               layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        f8 = torch.float8_e4m3fn
        return k.float().clamp(-448, 448).to(f8).to(k.dtype), v.float().clamp(-448, 448).to(f8).to(v.dtype)

    def bits_per_element(self, head_dim: int) -> tuple[float, float]:
        return 8.0, 8.0

    def new_store(self, k: torch.Tensor, v: torch.Tensor) -> KVStore:
        return Fp8Store(self, k, v)


class Fp8Store(DequantizedStore):
    """Where the kernels run and the GPU has the type (fp8_native: compute capability ≥ 8.9), the
    fp8 codes k8, v8 [L, B, Hkv, S, D]: each slot is cast once as it is written, decode steps read
    the codes with the fp8 decode kernel, and an unpadded first pass widens the slots it reads
    (fp8 → the compute type is exact: what a dequantized copy would hold); passes that read the
    whole cache again and again make the shadow once (DequantizedStore.ensure_shadow). Elsewhere
    each slot's dequantized value only, as DequantizedStore."""

    def __init__(self, fmt: KVFormat, k: torch.Tensor, v: torch.Tensor):
        self.kernels = kernels_fit(k) and fp8_native(str(k.device))
        super().__init__(fmt, k, v)
        if self.kernels:
            from engines.kernels.fp8_kv import FP8

            self.k8 = torch.zeros(k.shape, dtype=FP8, device=k.device)
            self.v8 = torch.zeros(v.shape, dtype=FP8, device=v.device)

    @property
    def shadow_at_start(self) -> bool:
        return not self.kernels

    def dequantized(self, layer: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k8[layer, :, :, :S].to(self.k.dtype), self.v8[layer, :, :, :S].to(self.v.dtype)

    def buffers(self) -> list[torch.Tensor]:
        return [self.k8, self.v8, *super().buffers()] if self.kernels else super().buffers()

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, seq_start: torch.Tensor) -> None:
        if self.kernels:
            self._write_codes(layer, k, v, slots)
        if self.has_shadow:
            self.write(layer, k, v, slots, seq_start)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal, seq_start: torch.Tensor, lengths: torch.Tensor | None,
               stored: bool = False, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if not stored:
            self.fill(layer, k, v, slots, seq_start)
        S = mask.shape[-1]
        if self.kernels and lengths is not None:
            from engines.kernels.fp8_kv import decode_attention

            out = decode_attention(q[:, :, 0], self.k8[layer, :, :, :S], self.v8[layer, :, :, :S],
                                   lengths)
            return out[:, :, None].to(q.dtype)
        if self.kernels and not self.has_shadow and isinstance(mask, Causal):  # once per sequence: widen, keep nothing
            kq, vq = self.dequantized(layer, S)
            return masked_gqa_attention(q, kq, vq, mask)
        self.ensure_shadow()
        return masked_gqa_attention(q, self.kq[layer, :, :, :S], self.vq[layer, :, :, :S], mask)

    def code_destination(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fp8 codes, where the kernels run on CUDA (or are planned on meta) and no shadow is
        kept beside them (a shadow is filled by write, which the fused kernel does not do). Not
        under the interpreter: its e4m3 cast rounds ties away and drops rounding carries, so
        there the codes are torch's cast (_write_codes)."""
        if self.kernels and not self.has_shadow and on_kernel_path(self.k8):
            return self.k8[layer], self.v8[layer]
        return None

    def _write_codes(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Quantize-on-write of the new slots into k8, v8 (the cast kernel on CUDA, torch's cast elsewhere)."""
        from engines.kernels.fp8_kv import quantize_on_write, quantize_reference

        # The Triton interpreter flushes e4m3 subnormals to zero where GPUs and torch round them:
        # off CUDA the cast is torch's, so both paths hold the same codes.
        to_fp8 = quantize_on_write if on_kernel_path(k) else quantize_reference
        # index_copy_ has no fp8 kernels: write the codes' bytes
        self.k8[layer].view(torch.uint8).index_copy_(2, slots, to_fp8(k).view(torch.uint8))
        self.v8[layer].view(torch.uint8).index_copy_(2, slots, to_fp8(v).view(torch.uint8))


@dataclass
class IntPerTokenKV(KVFormat):
    """Uniform int-b per token: min-max over each (token, head) vector of D channels, no
    full-precision window. int8 is near lossless; int4 and int2 are the naive baselines that
    KVQuant shows collapse (docs/reference.md §2)."""

    bits: int = 8

    def __post_init__(self) -> None:
        self.name = f"int{self.bits}"

    def encode(self, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor,
               layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return minmax_quant(k.float(), self.bits, -1).to(k.dtype), minmax_quant(v.float(), self.bits, -1).to(v.dtype)

    def bits_per_element(self, head_dim: int) -> tuple[float, float]:
        b = self.bits + 2 * FP16_BITS / head_dim  # fp16 scale + zero per vector
        return b, b
