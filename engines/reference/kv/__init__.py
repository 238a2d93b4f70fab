"""KV-cache formats (docs/reference.md §2). Each format says what a cache slot holds after it is
written (``encode``: the dequantized value a kernel would read back), how many leading positions
of a sequence are held compressed when its length is n (``boundary``: KIVI keeps a recent
full-precision window; the others compress every slot, the current one included), and its exact
storage cost (``bits_per_element``, metadata amortized).

Each format also owns its storage in a cache (``new_store``): the buffers it keeps beside the
cache's raw keys and values, how new slots are written into them, and the attention a query runs
over them. The reference engine stores dequantized values (a faithful simulation of the
arithmetic); where the Triton kernels of engines/kernels run, a format also keeps the packed
codes the bit counts describe and its decode steps (one new token per row, no left padding) read
those. engines/reference/cache.py holds only slots and masks: a new format is a module of this
package (its KVFormat and its store) and a line in kv_format.

Shapes: L layers, B batch, H query heads, Hkv key/value heads, T new tokens, S slots, D head dim.
"""

from __future__ import annotations

import torch

from engines.reference.kv.base import FP16_BITS, DequantizedStore, KVFormat, KVStore, kernels_fit
from engines.reference.kv.floats import FloatKV, Fp8KV, Fp8Store, IntPerTokenKV
from engines.reference.kv.kivi import KiviKV, KiviStore
from engines.reference.kv.turbo import RotatedTurboStore, TurboKV

__all__ = ["FP16_BITS", "DequantizedStore", "FloatKV", "Fp8KV", "Fp8Store", "IntPerTokenKV", "KVFormat", "KVStore",
           "KiviKV", "KiviStore", "RotatedTurboStore", "TurboKV", "kernels_fit", "kv_format"]


def kv_format(name: str, compute_dtype: torch.dtype, weights_dtype: torch.dtype | None = None) -> KVFormat:
    """The format for kv_cache `name`; "auto" stores the weights' float type (vLLM's meaning),
    which is the compute type unless fp16/bf16 weights compute in fp32 (a CPU without native
    half-precision matmul; see FloatKV for what that rounds)."""
    floats = {"auto": weights_dtype or compute_dtype, "fp16": torch.float16, "bf16": torch.bfloat16,
              "fp32": torch.float32}
    if name in floats:
        return FloatKV(floats[name], compute_dtype, weights_dtype)
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
