"""Continuous batching for the reference engine, as a serving loop uses it (vLLM's scheduler, in
miniature): sequences join a running batch between decode steps and leave it when they finish,
each in its own row of a cache.

- RowCache: k, v [L, R, Hkv, S, D], one sequence per row r with its own length. It plugs into
  the model's forward in place of KVCache (the model calls `cache.attend` for every layer) and
  ignores the forward's `slots` / `mask`: what a pass writes and reads is set just before it, by
  `prefill_row` (one row's prompt) or `decode_rows` (one new token for each active row).
- ContinuousBatch: the rows' sequences. `add` prefills one request and picks its first token;
  `step` runs one batched decode step over every unfinished row and picks each row's next token;
  `remove` frees a row. Picks, sampling generators, penalties and log-probs are the engine's own
  (pick / adjust, engines/sampling.py), per request, so a request's tokens do
  not depend on which others share its steps, up to the numerics of a batched matmul.

- DecoderRows: the same rows for a lossy KV format, whose store (codes, token groups, kernels)
  is made for one batch: each row is its own decode.Decoder of batch 1, sized as the engine's
  generate() sizes one request, so a row's prefill, its codes and its attention are the
  one-request path's own; a decode step multiplies the weights for every row at once and runs
  attention row by row through each row's cache.

- Speculative decoding: each row proposes its own drafts (an n-gram
  lookup over its own tokens, or its own draft-model cache of batch 1), then one forward of the
  target verifies every row's last token and drafts together (`verify_rows`: k + 1 positions per
  row, a row with fewer drafts padded, each query seeing its row's slots up to its own), and each
  row accepts as the one-request loop does (speculative_loop.accept, with the row's own generator), so
  a row's tokens and its acceptance counts are those of the request alone. Rejected drafts stay
  in the row's slots past its length, unread, and are overwritten by the next pass.
  Over a lossy KV format the rows are SpeculativeRows: each row's own KVCache of batch 1, prefilled and
  verified as the one-request loop does its cache, attention row by row over each row's own
  tokens (padding is not written there), the weights multiplied for every row at once.

Not with a fault drill (`unbatchable` says why not): it keeps the engine's own
one-request-at-a-time generate().

Shapes: L layers, R rows, B active rows, Hkv key/value heads, S slots per row, D head dim, V vocab.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from engines.protocol import SAMPLING_EPS, GenerationRequest, GenerationResult, SpeculativeStats
from engines.reference.attention import masked_gqa_attention
from engines.reference.cache import KVCache
from engines.reference.decode import Decoder, _sdpa_backends
from engines.reference.speculative import DraftModelProposer, NgramProposer, SpeculativeCounters, causal_mask
from engines.reference.speculative_loop import accept, propose
from engines.sampling import adjust, pick, token_logprob

if TYPE_CHECKING:
    from engines.reference.engine import ReferenceEngine


def unbatchable(engine) -> str | None:
    """None when `engine` can decode requests in a continuous batch, else why not."""
    if getattr(engine, "kv", None) is None or getattr(engine, "fault", None) is None:
        return "not the reference engine"
    if engine.fault.fault is not None:
        return "a canary fault drill is active"
    return None


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

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def prefill(self, model, row: int, ids: torch.Tensor, width: int) -> torch.Tensor:
        """Row `row`'s prompt ids [1, T] → the last position's logits [1, V] (`width`, the row's
        prompt + new tokens, is grown into as the row decodes)."""
        pos = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, T]
        self.prefill_row(row, ids.shape[1])
        return model(ids, pos, pos[0], self, None, last_only=True)[:, -1]

    def decode(self, model, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """One token per row of `rows` (tokens [B, 1]) → logits [B, V]."""
        pos = self.decode_rows(rows)  # [B, 1]
        return model(tokens, pos, pos[:, 0], self, None, last_only=True)[:, -1]

    def verify(self, model, tokens: torch.Tensor, rows: list[int], widths: list[int] | None = None) -> torch.Tensor:
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

    def attend(self, layer: int, q, k, v, slots: torch.Tensor, mask) -> torch.Tensor:
        """q: [B, H, T, D]; k, v: [B, Hkv, T, D]. `slots` and `mask` are the forward's and unused:
        prefill_row / decode_rows / verify_rows set what this pass writes and reads."""
        if self._mode == "prefill":
            # q, k, v: [1, ·, T, ·] — the prompt attends itself causally, as the engine's prefill does
            T = k.shape[2]
            self.k[layer, self._row, :, :T] = k[0]
            self.v[layer, self._row, :, :T] = v[0]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if self._mode not in ("decode", "verify"):
            raise RuntimeError("RowCache.attend: call prefill_row, decode_rows or verify_rows before the forward")
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

    def __init__(self, engine: ReferenceEngine, rows: int):
        self.engine = engine
        self.decoders: list[Decoder | None] = [None] * rows
        self.lengths = [0] * rows  # slots written per row (host)
        self._active: list[tuple[Decoder, torch.Tensor]] = []  # decode: each row's Decoder and mask

    def nbytes(self) -> int:
        return sum(d.cache.nbytes() for d in self.decoders if d is not None)

    def prefill(self, model, row: int, ids: torch.Tensor, width: int) -> torch.Tensor:
        decoder = self.engine.decoder(1, width, graphs=False)  # its steps run inside the batch's forward
        decoder.prepare()
        logits = decoder.prefill(ids)
        self.decoders[row] = decoder
        self.lengths[row] = ids.shape[1]
        self.engine.usage.bytes(self.nbytes())  # every row's cache at once, not the largest row
        return logits

    def decode(self, model, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
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

    def attend(self, layer: int, q, k, v, slots: torch.Tensor, mask) -> torch.Tensor:
        """q: [B, H, 1, D]; k, v: [B, Hkv, 1, D]: row b's new key and value written at its Decoder's
        slot and attended through its cache (the forward's `slots` and `mask` are unused)."""
        return torch.cat([d.cache.attend(layer, q[b : b + 1], k[b : b + 1], v[b : b + 1], d.slot, row_mask)
                          for b, (d, row_mask) in enumerate(self._active)])

    def release(self, row: int) -> None:
        self.decoders[row] = None
        self.lengths[row] = 0


class SpeculativeRows:
    """Speculative decoding over a lossy KV format: row r is a KVCache of batch 1 (slots: prompt
    + max_new_tokens + k + 1), prefilled, written and read as the one-request loop does its own
    (speculative_loop.generate_speculative: a causal mask over the slots up to each pass's last token).
    A verify pass is one forward over every active row's last token and drafts; its attention runs
    row by row through each row's cache, over that row's own tokens only, as the one-request loop
    writes them (a shorter row's padding is not written into its cache). The rows equal the eager
    loop's; on CUDA, where that loop verifies at a fixed width (speculative_loop.StaticVerify), a row
    differs from it at kernel precision, as a batched row of bf16 does."""

    def __init__(self, engine: ReferenceEngine, rows: int):
        self.engine = engine
        self.caches: list[KVCache | None] = [None] * rows
        self.lengths = [0] * rows  # slots a row holds (host): prompt and accepted tokens
        self._active: list[tuple[KVCache, torch.Tensor, torch.Tensor, int]] = []  # verify: cache, slots, mask, width

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.caches if c is not None)

    def prefill(self, model, row: int, ids: torch.Tensor, width: int) -> torch.Tensor:
        cache = self.engine.new_cache(1, width)  # as the one-request loop makes its own
        slots = torch.arange(ids.shape[1], device=ids.device)
        logits = model(ids, slots[None], slots, cache, causal_mask(slots, ids.shape[1]), last_only=True)[:, -1]
        self.caches[row] = cache
        self.lengths[row] = ids.shape[1]
        self.engine.usage.bytes(self.nbytes())  # every row's cache at once, not the largest row
        return logits

    def decode(self, model, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """A step in which no row drafted: one token per row → logits [B, V]."""
        return self.verify(model, tokens, rows, [1] * len(rows))[:, 0]

    def verify(self, model, tokens: torch.Tensor, rows: list[int], widths: list[int]) -> torch.Tensor:
        """tokens [B, T]: each row's last token and its widths[b] − 1 drafts, padded → logits
        [B, T, V] (a padded position's are not to be read). Lengths stay until `keep`."""
        at = [self.lengths[r] for r in rows]
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

    def attend(self, layer: int, q, k, v, slots: torch.Tensor, mask) -> torch.Tensor:
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
        self.caches[row] = None
        self.lengths[row] = 0


@dataclass
class Sequence:
    """One request in a row: its prompt, the tokens picked so far and their stamps."""

    request: GenerationRequest
    row: int
    prompt: list[int]
    generator: torch.Generator  # the request's own sampling stream, seeded with its seed
    started: float  # perf_counter when it joined (its TTFT counts from here)
    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)
    scored: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    done: bool = False
    # speculative decoding: the row's own proposer, its counts so far, and its last step's (None
    # when that step had no drafts), which a server adds to its counters
    proposer: NgramProposer | DraftModelProposer | None = None
    counters: SpeculativeCounters | None = None
    last_spec: SpeculativeStats | None = None

    @property
    def greedy(self) -> bool:
        return self.request.temperature <= 0 and not self.request.adjusted


class ContinuousBatch:
    """Up to `rows` sequences decoded together, joining and leaving between steps."""

    def __init__(self, engine: ReferenceEngine, rows: int):
        if (why := unbatchable(engine)) is not None:
            raise ValueError(f"continuous batching: {why}")
        a = engine.args
        self.engine = engine
        self.cache: RowCache | DecoderRows | SpeculativeRows = (
            SpeculativeRows(engine, rows) if engine.kv.lossy and engine.proposer is not None else
            DecoderRows(engine, rows) if engine.kv.lossy else
            RowCache(a.n_layers, rows, a.n_kv_heads, a.head_dim, a.max_seq_len, engine.compute_dtype, engine.device))
        self.seqs: dict[int, Sequence] = {}  # row → its sequence
        self.eos = engine.tokenizer.eos_token_id
        # speculative decoding: k drafts at most per row and step, and the slots they need past an answer
        self.k: int = engine.proposer.k if engine.proposer is not None else 0
        self.extra = self.k + 1 if self.k else 0
        if self.k:
            engine.verify.reason = "off: continuous batching verifies every row's drafts in one eager pass"

    @property
    def free_rows(self) -> int:
        return len(self.cache.lengths) - len(self.seqs)

    def _free_row(self) -> int:
        return next(r for r in range(len(self.cache.lengths)) if r not in self.seqs)

    def held(self) -> int:
        """Token positions the rows hold (prompts and the tokens written after them)."""
        return sum(self.cache.lengths[r] for r in self.seqs)

    @torch.inference_mode()
    def add(self, request: GenerationRequest) -> Sequence:
        """Prefill `request` into a free row and pick its first token (the sequence is `done`
        at once when that token is EOS or max_new_tokens is 1). ValueError: the input does not fit."""
        engine = self.engine
        if request.temperature < SAMPLING_EPS:  # vLLM's greedy threshold, as engine.generate applies it
            request = replace(request, temperature=0.0)
        prompt = engine.prompt_token_ids(request)
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if len(prompt) + request.max_new_tokens + self.extra > engine.args.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({request.max_new_tokens})"
                             f"{f' + k + 1 ({self.extra}, speculative decoding)' if self.extra else ''} exceed the "
                             f"model's context of {engine.args.max_seq_len}")
        if not self.free_rows:
            raise RuntimeError("ContinuousBatch.add: every row is taken")
        row = self._free_row()
        seq = Sequence(request, row, prompt, torch.Generator(device=engine.device).manual_seed(request.seed),
                       time.perf_counter())
        ids = torch.tensor([prompt], device=engine.device)  # [1, T]
        with _sdpa_backends(engine.device):
            logits = self.cache.prefill(engine.model, row, ids, len(prompt) + request.max_new_tokens + self.extra)
        self.seqs[row] = seq
        self._take(logits, [seq])
        if self.k:
            seq.proposer = engine.proposer.fresh()
            seq.proposer.reset(len(prompt) + request.max_new_tokens + self.extra)
            seq.counters = SpeculativeCounters()
        return seq

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One decode step over every unfinished row: each gets its next token. Returns them."""
        active = [s for _, s in sorted(self.seqs.items()) if not s.done]
        if not active:
            return []
        device = self.engine.device
        if self.k:
            self._speculate(active)
            return active
        tokens = torch.tensor([[s.tokens[-1]] for s in active], device=device)  # [B, 1]
        with _sdpa_backends(device):
            logits = self.cache.decode(self.engine.model, tokens, [s.row for s in active])  # [B, V]
        self._take(logits, active)
        return active

    def _speculate(self, active: list[Sequence]) -> None:
        """One speculative step over the active rows: each proposes (at most what its answer has
        room for, less the correction or bonus token), one target pass verifies every row's last
        token and drafts, and each accepts as the one-request loop does (speculative_loop.generate_speculative)."""
        proposed = [propose(cast(NgramProposer | DraftModelProposer, s.proposer), s.prompt + s.tokens, s.request,
                            s.tokens, s.generator) for s in active]
        width = 1 + max(len(d) for d, _ in proposed)
        # a row with fewer drafts is padded with its last token: those positions' logits are not read
        tokens = torch.tensor([[s.tokens[-1], *d, *[s.tokens[-1]] * (width - 1 - len(d))]
                               for s, (d, _) in zip(active, proposed, strict=True)], device=self.engine.device)
        cache = cast(RowCache | SpeculativeRows, self.cache)
        rows = [s.row for s in active]
        with _sdpa_backends(self.engine.device):
            # no row drafted (n-gram lookup found nothing): a plain decode step
            logits = (cache.verify(self.engine.model, tokens, rows, [1 + len(d) for d, _ in proposed]) if width > 1
                      else cache.decode(self.engine.model, tokens, rows)[:, None]).float()  # [B, T, V]
        for b, (s, (drafts, qs)) in enumerate(zip(active, proposed, strict=True)):
            scores = logits[b, : len(drafts) + 1]  # row i predicts the token after drafts[:i]
            step = accept(scores, drafts, qs, s.request, s.tokens, s.generator, cast(SpeculativeCounters, s.counters),
                          self.k, self.eos)
            s.last_spec = step.step
            s.scored += step.scored
            s.tokens += step.tokens
            cache.keep(s.row, len(s.prompt) + len(s.tokens) - 1)  # the last token is written by the next pass
            cast(NgramProposer | DraftModelProposer, s.proposer).accept(len(s.prompt) + len(s.tokens))
            s.stamps.append(time.perf_counter())  # the tokens of one verification arrive together
            s.done = s.tokens[-1] == self.eos or len(s.tokens) >= s.request.max_new_tokens

    def _take(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Each row's pick from its logits [B, V], as the engine picks (_generate_batch)."""
        if all(s.greedy for s in seqs):  # one argmax over the batch: the step's one host sync
            picks = cast(list[int], logits.argmax(-1).tolist())
        else:
            picks = [pick(adjust(logits[b], s.request, s.tokens), s.request, s.generator)
                     for b, s in enumerate(seqs)]
        now = time.perf_counter()
        for b, (s, token) in enumerate(zip(seqs, picks, strict=True)):
            s.tokens.append(token)
            s.stamps.append(now)
            if (want := s.request.logprobs) is not None:
                s.scored.append(token_logprob(logits[b], token, want))
            s.done = token == self.eos or len(s.tokens) >= s.request.max_new_tokens

    def remove(self, seq: Sequence) -> None:
        """Free the sequence's row (finished, or its client left)."""
        del self.seqs[seq.row]
        self.cache.release(seq.row)

    def result(self, seq: Sequence) -> GenerationResult:
        c = seq.counters
        return GenerationResult(
            request_id=seq.request.request_id,
            text=cast(str, self.engine.tokenizer.decode(seq.tokens, skip_special_tokens=True)),
            token_ids=tuple(seq.tokens),
            prompt_tokens=len(seq.prompt),
            ttft_ms=(seq.stamps[0] - seq.started) * 1000,
            itl_ms=tuple((y - x) * 1000 for x, y in pairwise(seq.stamps)),
            total_ms=(seq.stamps[-1] - seq.started) * 1000,
            token_logprobs=tuple(seq.scored),
            finish_reason="stop" if seq.tokens[-1] == self.eos else "length",
            spec=(SpeculativeStats(c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
                                   tuple(c.accepted_per_position)) if c is not None else None),
        )
