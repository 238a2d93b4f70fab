"""A document's first window through the model, layer by layer (engines.protocol.LayerStates):
the residual stream before and after each layer, each attention output, and the keys and values
each layer's KV cache holds for the window afterwards, as a later token reads them back. Read
with forward hooks on the model's own modules and a cache that notes what it was given, so the
pass is the one perplexity runs (a lossy format's prefill through its store, a lossless one's
causal pass)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from torch import nn

from engines.protocol import LayerStates, RollingRequest, tokenize_with_spans
from engines.reference.attention import Causal
from engines.reference.cache import KVCache, NoCache
from engines.reference.kv import KVFormat

if TYPE_CHECKING:
    from engines.reference.host import DecodeHost
    from engines.reference.model import DecoderLayer

# tokens of the first window read: two engines' states of every layer are held at once, as float32
# on the CPU (hidden states, attention outputs, keys and values: an 8B model's 512 tokens, about 0.7 GiB a side)
MAX_TOKENS = 512


class _ReadBack:
    """A cache in front of the pass's own: notes, per layer, the keys and values as the format
    gives them back to a later token (KVFormat.read_back; [T, Hkv·D], float32 on the CPU), then
    attends through the real one."""

    def __init__(self, cache: KVCache | NoCache, fmt: KVFormat):
        self.cache, self.fmt = cache, fmt
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal | int | None) -> torch.Tensor:
        kb, vb = k, v
        if self.fmt.lossy:
            kb, vb = self.fmt.read_back(k, v, torch.zeros(k.shape[0], dtype=torch.long, device=k.device), layer)
        for out, x in ((self.keys, kb), (self.values, vb)):  # [1, Hkv, T, D] → [T, Hkv·D]
            out.append(x[0].transpose(0, 1).reshape(x.shape[2], -1).float().cpu().numpy().copy())
        return self.cache.attend(layer, q, k, v, slots, mask)


@torch.inference_mode()
def layer_states(engine: DecodeHost, request: RollingRequest) -> LayerStates:
    """The request's first window (at most window.max_length and MAX_TOKENS tokens, the start
    token first)."""
    ids, _ = tokenize_with_spans(engine.tokenizer, request.text)
    if not ids:
        raise ValueError(f"document '{request.doc_id}' has no tokens")
    seq = ([engine.start_id] + ids)[: min(request.window.max_length, engine.args.max_seq_len, MAX_TOKENS)]
    T, device, model = len(seq), engine.device, engine.model
    x = torch.tensor([seq], device=device)
    slots = torch.arange(T, device=device)
    cache: KVCache | NoCache
    mask: torch.Tensor | None
    if engine.kv.lossy:  # through the format's store, as prefill_windows scores a lossy window
        cache, mask = engine.new_cache(1, T), torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    else:
        cache, mask = NoCache(), None
    readback = _ReadBack(cache, engine.kv)
    hidden: list[np.ndarray] = []  # before each layer (its input norm's input), then after the last
    attention: list[np.ndarray] = []

    def note_hidden(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        hidden.append(args[0][0].float().cpu().numpy().copy())  # a copy: the pass's tensors are its own

    def note_attention(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        attention.append(out[0].float().cpu().numpy().copy())

    layers = list(cast("Iterable[DecoderLayer]", model.model.layers))
    hooks = [layer.input_layernorm.register_forward_pre_hook(note_hidden) for layer in layers]
    hooks.append(model.model.norm.register_forward_pre_hook(note_hidden))
    hooks += [layer.self_attn.register_forward_hook(note_attention) for layer in layers]
    try:
        model(x, slots[None], slots, readback, mask, hidden=True)
    finally:
        for hook in hooks:
            hook.remove()
    return LayerStates(tuple(seq), np.stack(hidden), np.stack(attention), np.stack(readback.keys),
                       np.stack(readback.values))
