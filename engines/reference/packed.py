"""The model's linear weights prepacked for oneDNN, for engine-serve's batched steps on the CPU.

A decode step of a batch of B > 1 rows multiplies [B, K] activations by every [N, K] weight once.
MKL's GEMM repacks the weight into its panel layout on every such call, so a step of the tiny
model reads and writes its 22 MB of weights once more than it needs to. Every linear of that
model, one thread of a 2-core AMD EPYC (benchmarks/packed_linears.py): at 8 rows 3.1 ms against
2.2 ms packed once (1.48×), at 32 rows 8.0 against 4.9 ms (1.62×).
vLLM's CPU backend packs its linear weights for oneDNN at load for the same reason. Here the packed
copy is made with engine-serve's batch (batching.ContinuousBatch over rows.RowCache, the lossless
rows) and used only inside `active()`, which the batch enters around its forwards of more than
one token. A one-token forward (a decode step of one row) keeps the plain weights: a GEMV, as
fast as it is. Everything outside the batch (generate(), the scorers' passes, the prompt
log-probs) never sees the packed weights, so the in-process figures are unchanged to the bit.
engine-serve's own passes do change in the last bits, its serial server (`--max-num-seqs 1`, a
batch of one row) included: its prefill is a forward of many tokens.

oneDNN sums in another order than MKL: a batched forward's outputs differ from the plain
weights' by a few ulps (at most 9e-7 of the largest output on the tiny model's linears,
benchmarks/packed_linears.py), of the same kind as a batch of 8 rows against one row alone
already differs.

The packed copy is taken when the batch is made: a weight changed after that is not seen inside
`active()` (engine-serve's weights are fixed once it has loaded; a fault drill, which does change
what the model computes, does not batch).

Only exact nn.Linear modules with fp32 or bf16 weights on the CPU are packed (a quantized layer
keeps its own forward), and only while their weights total at most PACKED_LINEAR_BYTES: the packed
copy doubles what the linear weights take.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

PACKED_LINEAR_BYTES = 1 << 30  # the linear weights a model may have packed beside its own
PACKED_FOR_ROWS = 32  # the batch oneDNN is told to expect (the servers' default --max-num-seqs)


def _packed_linear(module: nn.Linear, packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.numel() == x.shape[-1]:  # one token: the plain weights' GEMV
        return F.linear(x, module.weight, module.bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")


class PackedLinears:
    """Each packable linear of a model with its oneDNN-packed weight; `active()` routes their
    forwards through the packed weights and restores the plain ones on leaving."""

    def __init__(self, model: nn.Module, budget: int = PACKED_LINEAR_BYTES):
        linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"
                   and m.weight.dtype in (torch.float32, torch.bfloat16)]
        packable = torch.backends.mkldnn.is_available() and sum(m.weight.nbytes for m in linears) <= budget
        self.modules: list[tuple[nn.Linear, torch.Tensor]] = [
            (m, torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().contiguous(), PACKED_FOR_ROWS))
            for m in linears] if packable else []

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        for module, packed in self.modules:
            module.forward = partial(_packed_linear, module, packed)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for module, _ in self.modules:
                del module.forward
