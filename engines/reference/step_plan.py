"""A decode step's device launches, counted on the meta device (engines/kernels/launches.py).

plan_decode_step builds a model of the given shape on `meta` (no weights in memory), a Decoder
whose cache holds `context` tokens, and runs one decode step on the kernel path a CUDA step
takes (launches.planning()). The layers' launches are the difference between a model of
2·L and one of L layers, divided by L: what the step does once (embedding, the mask, the
final norm, lm_head) cancels out, so a bound per layer holds at any depth.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from engines.kernels import launches
from engines.reference.decode import Decoder
from engines.reference.kv import kv_format
from engines.reference.model import ModelArgs, Transformer, rope_inv_freq


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Launches of one decode step: `per_layer` (and `layer_ops`, by name) and `once` (the rest)."""

    per_layer: float
    once: int
    layer_ops: dict[str, float]


def _step_ledger(args: ModelArgs, kv: str, batch: int, context: int, dtype: torch.dtype) -> launches.Ledger:
    meta = torch.device("meta")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with meta:
            model = Transformer(args)
    finally:
        torch.set_default_dtype(old)
    model.inv_freq = rope_inv_freq(args).to(meta)
    # no_grad, not inference_mode: under inference mode a dispatch mode sees composite operators
    # (to, contiguous) before they decompose, so a cast would hide its copy
    with torch.no_grad(), launches.planning():
        model.fuse()
        dec = Decoder(model, kv_format(kv, dtype, dtype), batch, context + 2, meta, dtype, graphs=False)
        dec.prepare()
        dec.slot.fill_(context)  # as after a prompt of `context` tokens (nothing is stored on meta)
        dec.next_slot = context
        tokens = torch.zeros(batch, dtype=torch.long, device=meta)
        dec.step(tokens)  # the first step makes what is made once (rotations, codebooks on the device)
        with launches.count() as ledger:
            dec.step(tokens)
    return ledger


def plan_decode_step(args: ModelArgs, kv: str = "fp16", batch: int = 1, context: int = 1024,
                     dtype: torch.dtype = torch.float16) -> StepPlan:
    """The launches of one decode step of a model shaped as `args` with a `kv` cache holding
    `context` tokens per row, as the CUDA kernel path makes them."""
    L = args.n_layers
    one = _step_ledger(args, kv, batch, context, dtype)
    two = _step_ledger(dataclasses.replace(args, n_layers=2 * L), kv, batch, context, dtype)
    per_op = Counter(two.by_name)
    per_op.subtract(one.by_name)
    return StepPlan(per_layer=(two.total - one.total) / L, once=2 * one.total - two.total,
                    layer_ops={k: v / L for k, v in sorted(per_op.items()) if v})
