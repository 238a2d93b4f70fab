"""Weight quantization of the reference engine: round-to-nearest (RTN) at 8, 4, 3 or 2 bits and
AWQ at 4 bits (engines/reference/awq.py), each in place on the model's linears, with the packed
int4 layers kept for the W4A16 kernels and the bytes the quantized weights would take."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from engines.quant import dequantize_groupwise, quantize_groupwise, quantized_bytes
from engines.reference.model import DecoderLayer, Transformer, layer_linears

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

RTN_BITS = {"int8": 8, "rtn-int4": 4, "rtn-int3": 3, "rtn-int2": 2}


@dataclass
class Quantized:
    """What quantizing a model's linears left: its int4 layers packed as (q, zero, scale) by
    name, and how many parameters it quantized into how many bytes."""

    packed: dict[str, tuple] = field(default_factory=dict)
    params: int = 0
    bytes: int = 0

    def count(self, out_f: int, in_f: int, bits: int) -> None:
        self.params += out_f * in_f
        self.bytes += quantized_bytes(out_f, in_f, bits)


def rtn(model: Transformer, bits: int) -> Quantized:
    """Every decoder linear quantized group-wise to `bits` and stored dequantized, in place."""
    out = Quantized()
    with torch.no_grad():
        for i, layer in enumerate(cast("Iterable[DecoderLayer]", model.model.layers)):
            for name, lin in layer_linears(layer):
                q, scale, zero = quantize_groupwise(lin.weight, bits)
                lin.weight.copy_(dequantize_groupwise(q, scale, zero).to(lin.weight.dtype))
                if bits == 4:
                    out.packed[f"model.layers.{i}.{name}"] = (q, zero, scale)
                out_f, in_f = lin.weight.shape
                out.count(out_f, in_f, bits)
    return out


def checkpoint_quantized(model: Transformer, bits_per_weight: float) -> Quantized:
    """What a config's own checkpoint holds, for the memory figures: every decoder linear at its
    weights axis' bits per weight (scales and zeros included), as its producer quantizes them all
    and keeps the embeddings and the head (llm-compressor's recipes ignore lm_head). load_model
    dequantized them; nothing is quantized again."""
    out = Quantized()
    for layer in cast("Iterable[DecoderLayer]", model.model.layers):
        for _, lin in layer_linears(layer):
            out.params += lin.weight.numel()
            out.bytes += math.ceil(lin.weight.numel() * bits_per_weight / 8)
    return out


def calibration_ids(tokenizer: PreTrainedTokenizerBase, start_id: int, calibration: Sequence[str] | None, n: int,
                    t: int) -> torch.Tensor:
    """[n', t] token ids for AWQ's search: up to n windows of t tokens, cut from the texts joined end
    to end (each after the start token); n' < n when the texts run out."""
    if not calibration:
        raise ValueError("weights: 'awq-int4' needs calibration text from the domain; the worker passes the "
                         "suite's documents that the run's first draw did not take and no labelled item quotes "
                         "(a suite with more documents than it draws gives some)")
    ids: list[int] = []
    for text in calibration:
        ids += [start_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n * t:
            break
    n = min(n, len(ids) // t)
    if n == 0:
        raise ValueError(f"weights: 'awq-int4' calibration text has {len(ids)} tokens, fewer than one window of {t}")
    return torch.tensor(ids[: n * t]).reshape(n, t)


def awq(model: Transformer, ids: torch.Tensor, model_path: str, tag: str = "") -> tuple[Quantized, bool]:
    """AWQ int4 on the calibration windows `ids`, in place; (what it left, whether the search's
    outcome came from the on-disk cache of this model, these ids and `tag`)."""
    from engines.reference.awq import awq_cache_dir, awq_cache_key, awq_quantize, load_awq_cache, store_awq_cache

    cache_dir, key = awq_cache_dir(), awq_cache_key(model_path, ids) + tag
    packed = load_awq_cache(model, key, cache_dir)
    from_cache = packed is not None
    if packed is None:
        packed = awq_quantize(model, ids)
        store_awq_cache(model, packed, key, cache_dir)
    out = Quantized(packed)
    for q, _, _ in packed.values():
        out_f, in_f = q.shape
        out.count(out_f, in_f, 4)
    return out, from_cache


def use_w4a16_kernels(model: Transformer, packed: dict[str, tuple], device: torch.device,
                      batch1: str = "auto") -> str:
    """Where kernels run, int4 linears multiply straight from the packed AutoAWQ layout
    (engines/kernels/w4a16.py) instead of the dequantized copy: the fused model's qkv, o,
    gate-up and down projections, in place. batch1 (engine_options.int4_gemv) picks the kernel of
    a single row; → which kernel serves a single row, said as describe() notes it."""
    from engines.kernels.w4a16 import W4A16Linear

    for i, layer in enumerate(cast("Iterable[DecoderLayer]", model.model.layers)):
        # W4A16Linear takes nn.Linear's place (the same forward), which the model's annotations do not allow
        attn, mlp = cast(Any, layer.self_attn), cast(Any, layer.mlp)
        qkv = [packed[f"model.layers.{i}.self_attn.{n}_proj"] for n in ("q", "k", "v")]
        attn.qkv_proj = W4A16Linear.from_parts(qkv, attn.qkv_proj.bias, device, batch1)
        attn.o_proj = W4A16Linear.from_parts([packed[f"model.layers.{i}.self_attn.o_proj"]], attn.o_proj.bias, device,
                                             batch1)
        if f"model.layers.{i}.mlp.gate_proj" not in packed:  # a mixture's experts keep their dequantized copies
            continue
        gu = [packed[f"model.layers.{i}.mlp.{n}_proj"] for n in ("gate", "up")]
        mlp.gate_up_proj = W4A16Linear.from_parts(gu, None, device, batch1)
        mlp.down_proj = W4A16Linear.from_parts([packed[f"model.layers.{i}.mlp.down_proj"]], None, device, batch1)
    return batch1_note(model)


def batch1_note(model: Transformer) -> str:
    """Which kernel multiplies a single row through the int4 linears (describe()'s note)."""
    from engines.kernels.w4a16 import W4A16Linear

    kinds = sorted({m.batch1 for m in model.modules() if isinstance(m, W4A16Linear)})
    names = {"tinygemm": "torch tinygemm (aten._weight_int4pack_mm, bf16 activations)",
             "triton": "the Triton W4A16 GEMV"}
    return "int4 batch-1 GEMV: " + (" and ".join(names[k] for k in kinds) or "none (no int4 kernels)")
