"""Where the scheduler's rows keep their keys and values (engines/reference/batching.py drives
them). Each store plugs into the model's forward in place of a KVCache (the model calls its
`attend` for every layer) and knows what the next pass writes and reads; each has `lengths` (the
slots a row holds), `prefill`, `decode`, `release` and `nbytes`.

- WaveRows: generate()'s static batch. A wave of requests admitted together is prefilled at once,
  left-padded, into one pooled decode.Decoder, whose lockstep decode step is captured as a CUDA
  graph per batch bucket (ReferenceEngine.pooled_decoder). A row that has finished keeps being fed
  its greedy pick, unread, so every step has the shapes the graph was captured with.
- RowCache: engine-serve's rows of a lossless format: k, v [L, R, Hkv, S, D], one sequence per row
  with its own length, joining and leaving between steps; a step may prefill joining rows' prompts
  in the same forward as the others' next tokens (`mixed`).
- DecoderRows: the same rows for a lossy KV format, whose store (codes, token groups, kernels) is
  made for one batch: each row is its own decode.Decoder of batch 1, sized as a wave of one
  request sizes it, so a row's prefill, its codes and its attention are a lone request's own; a
  decode step multiplies the weights for every row at once and runs attention row by row.
- SpeculativeRows: speculative decoding with a cache per row (KVCache of batch 1: prompt +
  max_new_tokens + k + 1 slots); a verify pass is one forward over every row's last token and
  drafts, attention row by row over each row's own tokens. With one row (`one_request`, as
  generate() runs speculative decoding) a pass is the target's own forward over that cache, and
  on CUDA its verify pass runs at one width, captured as a graph (speculative_verify.StaticVerify).

Shapes: L layers, R rows, B active rows, Hkv key/value heads, S slots per row, D head dim, V vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from itertools import accumulate
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from engines.reference.attention import Causal, masked_gqa_attention
from engines.reference.cache import KVCache
from engines.reference.decode import Decoder
from engines.reference.speculative import causal_mask
from engines.reference.speculative_verify import StaticVerify

if TYPE_CHECKING:
    from engines.reference.host import DecodeHost
    from engines.reference.model import Transformer


class WaveRows:
    """generate()'s rows: the requests of one wave share a static batch of B = len(wave) rows in a
    pooled decode.Decoder (slots: the longest prompt + the most new tokens), prefilled together with
    left padding and stepped in lockstep until every row has finished. The next wave reuses the
    rows once this one has left (`release` of its last row hands the cache's figures to the
    engine's KVUsage)."""

    def __init__(self, engine: DecodeHost, rows: int):
        self.engine = engine
        self.lengths = [0] * rows  # slots written per row (host): its prompt, then one per step
        self.decoder: Decoder | None = None
        self._batch = 0  # the wave's rows
        self._width = 0  # the wave's prompt width (its longest prompt)
        self._prompt_tokens = 0  # the wave's prompt tokens, padding not counted
        self._live: set[int] = set()  # rows of the wave not yet released
        self._logits: torch.Tensor | None = None  # [B, V] every row's logits from the last pass

    def nbytes(self) -> int:
        return self.decoder.cache.nbytes() if self.decoder is not None else 0

    def prefill_wave(self, prompts: list[list[int]], new_tokens: int,
                     before_prefill: Callable[[], None]) -> tuple[torch.Tensor, float]:
        """The wave's prompts (rows 0…B−1) prefilled together → (logits [B, V] of each row's last
        prompt token, when the clock started). The decoder is prepared (on CUDA its step captured)
        before the clock; before_prefill() runs after it (a canary drill's TTFT delay)."""
        import time

        engine = self.engine
        if self._live:
            raise RuntimeError("WaveRows.prefill_wave: the last wave's rows have not all left")
        B, P = len(prompts), max(len(p) for p in prompts)
        device = engine.device
        pad = torch.tensor([P - len(p) for p in prompts], device=device)
        ids = torch.tensor([[engine.start_id] * (P - len(p)) + p for p in prompts], device=device)
        self.decoder = engine.pooled_decoder(B, P + new_tokens, P > min(len(p) for p in prompts))
        self.decoder.prepare(pad)  # on CUDA: the decode step's graph is captured here (once per bucket)
        started = time.perf_counter()
        before_prefill()
        logits = self.decoder.prefill(ids)
        self._batch, self._width, self._prompt_tokens = B, P, sum(len(p) for p in prompts)
        self._live = set(range(B))
        self._logits = logits
        for b, p in enumerate(prompts):
            self.lengths[b] = len(p)
        return logits, started

    def decode(self, model: Transformer, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """One token per row of `rows` (tokens [b, 1]) → logits [b, V]. Every row of the wave
        steps: one that has finished is fed its greedy pick from the last pass, and its logits are
        dropped (a finished row's input changes no other row's values, but a mixture of experts
        groups tokens by expert: fed as before, the others' expert batches stay as they were)."""
        decoder = cast(Decoder, self.decoder)
        fed = tokens.reshape(-1)
        if len(rows) != self._batch:
            index = torch.tensor(rows, device=fed.device)
            fed = cast(torch.Tensor, self._logits).argmax(-1).index_copy(0, index, fed)
        logits = decoder.step(fed)
        self._logits = logits  # on CUDA the captured step's output, read before the next replay
        for r in rows:
            self.lengths[r] += 1
        return logits if len(rows) == self._batch else logits.index_select(0, index)

    def release(self, row: int) -> None:
        """Row `row` leaves; after the wave's last, its cache's figures go to the engine's KVUsage:
        every row's prompt (no padding) and one slot per decode step (the last token picked is
        never written)."""
        self.lengths[row] = 0
        self._live.discard(row)
        if self._live or self.decoder is None:
            return
        decoder, engine = self.decoder, self.engine
        engine.decode_graphs = decoder.graphs_reason
        engine.usage.cache(decoder.cache)
        engine.usage.tokens(self._prompt_tokens + self._batch * (decoder.next_slot - self._width), decoder.cache)
        self.decoder = None


class RowCache:
    """k, v: [L, R, Hkv, S, D]; row r holds one sequence in slots 0…lengths[r]−1. S starts small
    and doubles up to the model's context as rows grow, so a server with many rows of a long-
    context model does not hold rows × context slots it may never use."""

    def __init__(self, n_layers: int, rows: int, n_kv_heads: int, head_dim: int, context: int,
                 dtype: torch.dtype, device: torch.device, width: int = 256):
        self.context = context
        shape = (n_layers, rows, n_kv_heads, min(width, context), head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * rows  # slots written per row (host)
        self._mode = ""  # "prefill" or "decode": what the next forward does
        self._row = 0  # prefill: the row
        self._rows = torch.zeros(0, dtype=torch.long)  # decode: [B] the active rows
        self._span: slice | None = None  # decode: the same rows as a slice, when they are consecutive
        self._at = torch.zeros(0, dtype=torch.long)  # decode: [B] the slot each row writes
        self._mask: torch.Tensor | None = None  # decode: [B, 1, 1, W] slot j visible to row b iff j ≤ _at[b]
        self._slots = torch.zeros(0, dtype=torch.long)  # verify: [B, T] the slot each row's token t writes
        self._width = 0  # decode: slots read per row
        self._joining: list[tuple[int, int]] = []  # mixed: (row, prompt tokens) of each row joining
        self._decoding = 0  # mixed: the decode rows ahead of the joining prompts

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prefill(self, model: Transformer, row: int, ids: torch.Tensor, width: int) -> torch.Tensor:
        """Row `row`'s prompt ids [1, T] → the last position's logits [1, V] (`width`, the row's
        prompt + new tokens, is grown into as the row decodes)."""
        pos = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, T]
        self.prefill_row(row, ids.shape[1])
        return model(ids, pos, pos[0], self, None, last_only=True)[:, -1]

    def decode(self, model: Transformer, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """One token per row of `rows` (tokens [B, 1]) → logits [B, V]."""
        pos = self.decode_rows(rows)  # [B, 1]
        return model(tokens, pos, pos[:, 0], self, None, last_only=True)[:, -1]

    def mixed(self, model: Transformer, tokens: torch.Tensor | None, rows: list[int],
              joining: list[tuple[int, list[int]]]) -> torch.Tensor:
        """One forward over the decode rows' next tokens (tokens [B, 1] for `rows`, or none) and
        the prompts of rows joining the batch ((row, prompt ids) each, written at slots 0…T−1), laid
        end to end as one sequence of N tokens, as vLLM's scheduler mixes prefills into a decode
        step: the linear layers multiply the weights once for every token, and attention runs per
        part (the decode rows together, as `decode` runs them; each prompt causally over itself,
        as `prefill`). → logits [B + J, V]: each decode row's, then each joining row's last prompt
        token's."""
        device = self.k.device
        pos = self.mixed_rows(rows, [(row, len(ids)) for row, ids in joining])  # [1, N]
        prompts = torch.tensor([t for _, ids in joining for t in ids], device=device)
        ids = torch.cat([tokens.reshape(-1), prompts]) if tokens is not None else prompts
        h = model(ids[None], pos, pos[0], self, None, hidden=True)[0]  # [N, dim]
        ends = torch.tensor(list(accumulate(len(ids) for _, ids in joining)), device=device) + len(rows) - 1
        last = torch.cat([torch.arange(len(rows), device=device), ends])
        return model.lm_head(h.index_select(0, last))

    def verify(self, model: Transformer, tokens: torch.Tensor, rows: list[int],
               widths: list[int] | None = None) -> torch.Tensor:
        """T tokens per row of `rows` (tokens [B, T]: each row's last token and its drafts,
        padded; `widths`, each row's unpadded count, changes nothing here: a padded position is
        written past the row's length and overwritten later) → logits [B, T, V]. The rows'
        lengths stay: `keep` sets each once its drafts are accepted or rejected."""
        pos = self.verify_rows(rows, tokens.shape[1])  # [B, T]
        return model(tokens, pos, pos[0], self, None)

    def keep(self, row: int, n: int) -> None:
        """Row `row` holds its first n slots (the rest of what a verify pass wrote is dropped)."""
        self.lengths[row] = n

    def release(self, row: int) -> None:
        self.lengths[row] = 0

    def _fit(self, width: int) -> None:
        """Grow S to hold `width` slots per row (doubling, at most the context), keeping what rows hold."""
        S = self.k.shape[3]
        if width <= S:
            return
        if width > self.context:
            raise ValueError(f"a row of {width} slots exceeds the model's context of {self.context}")
        grown = min(self.context, max(width, 2 * S))
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:3], grown, old.shape[4]))
            new[:, :, :, :S] = old
            setattr(self, name, new)

    def prefill_row(self, row: int, n: int) -> None:
        """The next forward is row `row`'s prompt of n tokens, written at slots 0…n−1."""
        self._fit(n)
        self._mode, self._row = "prefill", row
        self.lengths[row] = n

    def decode_rows(self, rows: list[int]) -> torch.Tensor:
        """The next forward is one token per row of `rows`, each written at its row's length.
        Returns their positions [B, 1] (a row's next slot is its next RoPE position)."""
        at = [self.lengths[r] for r in rows]
        self._width = max(at) + 1
        self._fit(self._width)
        device = self.k.device
        self._set_rows(rows)
        self._at = torch.tensor(at, device=device)
        # rows of one length see every slot read: no mask (the engine's own unpadded decode step)
        self._mask = None
        if min(at) != max(at):
            self._mask = (torch.arange(self._width, device=device)[None, :] <= self._at[:, None])[:, None, None]
        self._mode = "decode"
        for r in rows:
            self.lengths[r] += 1
        return self._at[:, None]

    def mixed_rows(self, rows: list[int], joining: list[tuple[int, int]]) -> torch.Tensor:
        """The next forward is one token per row of `rows` (as decode_rows sets it up), then the
        prompt of each joining (row, n), written at that row's slots 0…n−1. Returns every token's
        position [1, N]."""
        if not joining:
            raise ValueError("RowCache.mixed_rows: no row joins (a plain step is decode_rows)")
        self._fit(max(n for _, n in joining))
        parts = [self.decode_rows(rows)[:, 0]] if rows else []
        for row, n in joining:
            self.lengths[row] = n
            parts.append(torch.arange(n, device=self.k.device))
        self._joining, self._decoding = joining, len(rows)
        self._mode = "mixed"
        return torch.cat(parts)[None]

    def verify_rows(self, rows: list[int], width: int) -> torch.Tensor:
        """The next forward is `width` tokens per row of `rows`: token t of row b written at slot
        lengths[r] + t, seeing its row's slots up to that one (causal within the new tokens).
        Returns their positions [B, T]."""
        at = [self.lengths[r] for r in rows]
        self._width = max(at) + width
        self._fit(self._width)
        device = self.k.device
        self._set_rows(rows)
        self._at = torch.tensor(at, device=device)
        self._slots = self._at[:, None] + torch.arange(width, device=device)[None]  # [B, T]
        self._mask = (torch.arange(self._width, device=device)[None, None, :] <= self._slots[:, :, None])[:, None]
        self._mode = "verify"
        return self._slots

    def _set_rows(self, rows: list[int]) -> None:
        self._rows = torch.tensor(rows, device=self.k.device)
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        self._span = slice(rows[0], rows[0] + len(rows)) if consecutive else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal | int | None) -> torch.Tensor:
        """q: [B, H, T, D]; k, v: [B, Hkv, T, D]. `slots` and `mask` are the forward's and unused:
        prefill_row / decode_rows / verify_rows set what this pass writes and reads."""
        if self._mode == "prefill":
            return self._attend_prompt(layer, self._row, q, k, v)
        if self._mode == "mixed":  # q: [1, H, N, D]: the decode rows' B tokens, then each joining prompt
            B, outs = self._decoding, []
            if B:  # the decode rows as [B, ·, 1, D], as a decode step gives them
                rows_q, rows_k, rows_v = (x[0, :, :B].transpose(0, 1)[:, :, None] for x in (q, k, v))
                outs.append(self._attend_rows(layer, rows_q, rows_k, rows_v)[:, :, 0].transpose(0, 1)[None])
            at = B
            for row, n in self._joining:
                outs.append(self._attend_prompt(layer, row, q[:, :, at:at + n], k[:, :, at:at + n],
                                                v[:, :, at:at + n]))
                at += n
            return torch.cat(outs, 2)
        if self._mode not in ("decode", "verify"):
            raise RuntimeError("RowCache.attend: call prefill_row, decode_rows, mixed_rows or verify_rows before "
                               "the forward")
        return self._attend_rows(layer, q, k, v)

    def _attend_prompt(self, layer: int, row: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: [1, ·, T, ·] — row `row`'s prompt written at slots 0…T−1, attending itself
        causally, as the engine's prefill does."""
        T = k.shape[2]
        self.k[layer, row, :, :T] = k[0]
        self.v[layer, row, :, :T] = v[0]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def _attend_rows(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The decode or verify rows' new keys and values written at their slots, and their
        queries [B, H, T, D] over each row's slots up to their own."""
        kl, vl = self.k[layer], self.v[layer]  # [R, Hkv, S, D]
        if self._mode == "verify":  # row b's token t at slot _slots[b, t]: [B, T, Hkv, D]
            kl[self._rows[:, None], :, self._slots] = k.transpose(1, 2)
            vl[self._rows[:, None], :, self._slots] = v.transpose(1, 2)
        else:
            kl[self._rows, :, self._at] = k[:, :, 0]  # row b's new key at its own slot _at[b]: [B, Hkv, D]
            vl[self._rows, :, self._at] = v[:, :, 0]
        W = self._width
        if self._span is not None:  # a view: no copy of the rows' keys and values
            keys, values = kl[self._span, :, :W], vl[self._span, :, :W]
        else:
            keys, values = kl[:, :, :W].index_select(0, self._rows), vl[:, :, :W].index_select(0, self._rows)
        return masked_gqa_attention(q, keys, values, self._mask)  # [B, H, T, D]


class DecoderRows:
    """A lossy KV format's rows: row r is a decode.Decoder of batch 1 over its own KVCache, made
    when the row's request joins (slots: prompt + max_new_tokens) and dropped when it leaves.
    Prefill is the Decoder's own. A decode step is one forward over every active row's token; its
    attention (this object stands in for the cache) runs row by row through each Decoder's cache,
    with the Decoder's own step positions, mask and prepared-step work (KIVI's codes)."""

    def __init__(self, engine: DecodeHost, rows: int):
        self.engine = engine
        self.decoders: list[Decoder | None] = [None] * rows
        self.lengths = [0] * rows  # slots written per row (host)
        self._active: list[tuple[Decoder, torch.Tensor]] = []  # decode: each row's Decoder and mask

    def nbytes(self) -> int:
        return sum(d.cache.nbytes() for d in self.decoders if d is not None)

    def prefill(self, model: Transformer, row: int, ids: torch.Tensor, width: int) -> torch.Tensor:
        decoder = self.engine.decoder(1, width, graphs=False)  # its steps run inside the batch's forward
        decoder.prepare()
        logits = decoder.prefill(ids)
        self.decoders[row] = decoder
        self.lengths[row] = ids.shape[1]
        self.engine.usage.bytes(self.nbytes())  # every row's cache at once, not the largest row
        return logits

    def decode(self, model: Transformer, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        decoders = [cast(Decoder, self.decoders[r]) for r in rows]
        for d in decoders:
            if d.next_slot >= d.slots:
                raise ValueError(f"the row's cache of {d.slots} slots is full")
        inputs = [d.step_inputs() for d in decoders]  # (positions [1, 1], mask [1, 1, 1, S]) per row
        self._active = [(d, mask) for d, (_, mask) in zip(decoders, inputs, strict=True)]
        pos = torch.cat([p for p, _ in inputs])  # [B, 1]
        try:
            with contextlib.ExitStack() as prepared:
                for d in decoders:
                    prepared.enter_context(d.prepared_step())
                logits = model(tokens, pos, pos[:, 0], self, None, last_only=True)[:, -1]
        finally:
            self._active = []
        for r, d in zip(rows, decoders, strict=True):
            d.advance()
            self.lengths[r] += 1
        self.engine.usage.bytes(self.nbytes())  # the kernels' code buffers are made on first use
        self.engine.decode_graphs = "off: continuous batching decodes each row's loop eagerly"
        return logits

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal | int | None) -> torch.Tensor:
        """q: [B, H, 1, D]; k, v: [B, Hkv, 1, D]: row b's new key and value written at its Decoder's
        slot and attended through its cache (the forward's `slots` and `mask` are unused)."""
        return torch.cat([d.cache.attend(layer, q[b : b + 1], k[b : b + 1], v[b : b + 1], d.slot, row_mask)
                          for b, (d, row_mask) in enumerate(self._active)])

    def release(self, row: int) -> None:
        self.decoders[row] = None
        self.lengths[row] = 0


class SpeculativeRows:
    """Speculative decoding with a cache per row: row r is a KVCache of batch 1 (slots: prompt +
    max_new_tokens + k + 1). A verify pass is one forward over every active row's last token and
    drafts; its attention runs row by row through each row's cache, over that row's own tokens
    (a shorter row's padding is not written there), the weights multiplied for every row at once.

    one_request (generate()'s speculative decoding, one request at a time): the one row's passes
    are the target's own forward over its cache: the prompt unmasked where the format is lossless,
    a pass of one token over the slots written so far, drafts under a causal mask as wide as the
    slots they reach; on CUDA (engine.static_verify) every verify pass has one width and is
    captured as a CUDA graph once per request (speculative_verify.StaticVerify). A batched row
    equals such a row; on CUDA it differs from the captured pass at kernel precision, as a batched
    row of bf16 does."""

    def __init__(self, engine: DecodeHost, rows: int, one_request: bool = False):
        if one_request and rows != 1:
            raise ValueError("SpeculativeRows: one_request takes one row")
        self.engine, self.one_request = engine, one_request
        self.caches: list[KVCache | None] = [None] * rows
        self.lengths = [0] * rows  # slots a row holds (host): prompt and accepted tokens
        self.high = [0] * rows  # slots a row's passes have written (rejected drafts included)
        self._static: StaticVerify | None = None  # one_request on CUDA: the request's fixed-width verify pass
        self._active: list[tuple[KVCache, torch.Tensor, torch.Tensor, int]] = []  # verify: cache, slots, mask, width

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.caches if c is not None)

    def prefill(self, model: Transformer, row: int, ids: torch.Tensor, width: int) -> torch.Tensor:
        engine = self.engine
        cache = engine.new_cache(1, width)
        slots = torch.arange(ids.shape[1], device=ids.device)
        if self.one_request:
            # one prompt token over a lossy cache: the one-token pass's int mask, as a later pass of one token
            mask = (None if not engine.kv.lossy else 1 if ids.shape[1] == 1 else causal_mask(slots, ids.shape[1]))
            logits = model(ids, slots[None], slots, cache, mask)[0].float()[-1:]
            k = cast(int, engine.spec.speculative.k)  # type: ignore[union-attr]  # a proposer exists
            self._static = (StaticVerify(engine, cache, k, engine.spec.option("cuda_graphs") is not False)
                            if engine.static_verify and engine.kv.graph_blocker is None else None)
            engine.verify.reason = (self._static.reason if self._static is not None
                                    else "off: verify passes as wide as their drafts")
        else:
            logits = model(ids, slots[None], slots, cache, causal_mask(slots, ids.shape[1]), last_only=True)[:, -1]
        self.caches[row] = cache
        self.lengths[row] = self.high[row] = ids.shape[1]
        engine.usage.bytes(self.nbytes())  # every row's cache at once, not the largest row
        return logits

    def decode(self, model: Transformer, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """A step in which no row drafted: one token per row → logits [B, V]."""
        return self.verify(model, tokens, rows, [1] * len(rows))[:, 0]

    def verify(self, model: Transformer, tokens: torch.Tensor, rows: list[int], widths: list[int]) -> torch.Tensor:
        """tokens [B, T]: each row's last token and its widths[b] − 1 drafts, padded → logits
        [B, T, V] (a padded position's are not to be read). Lengths stay until `keep`."""
        at = [self.lengths[r] for r in rows]
        for r, start, w in zip(rows, at, widths, strict=True):
            self.high[r] = max(self.high[r], start + w)
        if self.one_request:
            return self._one_pass(model, tokens[0, : widths[0]], at[0])[None]
        device = tokens.device
        pos = torch.tensor(at, device=device)[:, None] + torch.arange(tokens.shape[1], device=device)[None]  # [B, T]
        # each row's slots and causal mask, made once for every layer
        self._active = [(cast(KVCache, self.caches[r]), pos[b, :w], causal_mask(pos[b, :w], start + w), w)
                        for b, (r, start, w) in enumerate(zip(rows, at, widths, strict=True))]
        try:
            logits = model(tokens, pos, pos[0], self, None)
        finally:
            self._active = []
        self.engine.usage.bytes(self.nbytes())  # the kernels' code buffers are made on first use
        return logits

    def _one_pass(self, model: Transformer, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """The one row's pass over tokens [T] written from slot `start` → logits [T, V]."""
        if self._static is not None:
            logits = self._static(tokens.tolist(), start)
            self.engine.verify.reason = self._static.reason
            return logits
        cache = cast(KVCache, self.caches[0])
        n = tokens.shape[0]
        slots = torch.arange(start, start + n, device=tokens.device)
        # one token (a pass without a draft) attends every slot written so far: the plain decode
        # step's int mask (KVCache.attend), with no mask tensor built
        mask = start + 1 if n == 1 else causal_mask(slots, start + n)
        return model(tokens[None], slots[None], slots, cache, mask)[0].float()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal | int | None) -> torch.Tensor:
        """q: [B, H, T, D]; k, v: [B, Hkv, T, D]: row b's first widths[b] tokens written at its
        slots and attended through its cache, causally (the forward's `slots` and `mask` are unused)."""
        out = q.new_zeros(q.shape)
        for b, (cache, row_slots, row_mask, w) in enumerate(self._active):
            out[b : b + 1, :, :w] = cache.attend(layer, q[b : b + 1, :, :w], k[b : b + 1, :, :w], v[b : b + 1, :, :w],
                                                 row_slots, row_mask)
        return out

    def keep(self, row: int, n: int) -> None:
        """Row `row` holds its first n slots (what a verify pass wrote past them is overwritten later)."""
        self.lengths[row] = n

    def release(self, row: int) -> None:
        """The row leaves: its passes' high-water mark counts toward the engine's kv_cache_usage."""
        cache = self.caches[row]
        if cache is not None:
            self.engine.usage.tokens(self.high[row], cache)
        self.caches[row] = None
        self.lengths[row] = self.high[row] = 0
        self._static = None
