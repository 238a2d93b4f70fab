"""The reference engine's one decode loop, a scheduler as vLLM's (EngineCore.step: schedule →
execute → update, in miniature), driven by both front ends:

- engine-serve (workers/engine_server/engine_thread.py): sequences join the running batch
  between decode steps while it has a free row (`join`) and leave it when they finish (`remove`);
  over the lossless RowCache a joining prompt is prefilled in the next step's forward, beside the
  running rows' next tokens (RowCache.mixed, as vLLM's scheduler mixes prefills into a decode
  step), so a burst of joins costs one pass over the weights, not one each;
- the engine's own generate() (`waves=True`): up to `concurrency` requests join at once as one
  wave (`add_wave`), prefilled together into a static batch whose decode step is captured as a
  CUDA graph per batch bucket; the next wave joins when the batch is empty. With speculative
  decoding, one request at a time, its verify pass captured at one width on CUDA.

`step` runs one batched decode step over every unfinished row and picks each row's next token.
Picks, sampling generators, penalties and log-probs are per request (pick / adjust,
engines/sampling.py), so a request's tokens do not depend on which others share its steps, up to
the numerics of a batched matmul. Where the rows keep their keys and values is engines/reference/
rows.py: WaveRows (generate()'s static batch), RowCache (engine-serve, lossless), DecoderRows (a
lossy format: a decode.Decoder per row), SpeculativeRows (a cache per row for speculative decoding
over a lossy format, and for generate()'s one request).

Speculative decoding is a row mode of the same loop: each row proposes its own drafts (an n-gram
lookup over its own tokens, or its own draft-model cache of batch 1), one forward of the target
verifies every row's last token and drafts together (k + 1 positions per row, a row with fewer
drafts padded, each query seeing its row's slots up to its own), and each row accepts with its own
generator (speculative_verify.accept), so a row's tokens and acceptance counts are those of the
request alone. Rejected drafts stay in the row's slots past its length, unread, and are
overwritten by the next pass.

engine-serve does not batch under a canary fault drill (`unbatchable` says why not): the drill's
hooks wrap generate(), which serves one request at a time there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import TYPE_CHECKING, Any, cast

import torch

from engines.protocol import SAMPLING_EPS, GenerationRequest, GenerationResult, SpeculativeStats
from engines.reference.decode import _sdpa_backends
from engines.reference.packed import PackedLinears
from engines.reference.rows import DecoderRows, RowCache, SpeculativeRows, WaveRows
from engines.reference.speculative import DraftModelProposer, NgramProposer, SpeculativeCounters
from engines.reference.speculative_verify import accept, propose
from engines.sampling import adjust, pick, token_logprob

if TYPE_CHECKING:
    from engines.reference.host import DecodeHost

# the prompt tokens one step prefills beside its decode rows at most (vLLM's max_num_batched_tokens
# bounds a step the same way, prefill and decode tokens together): a burst of long prompts joining
# at once does not stall the running rows' next token for the whole burst
MIXED_PROMPT_TOKENS = 2048


def unbatchable(engine: Any) -> str | None:  # any engine, probed by attribute (the reference engine's kv and fault)
    """None when `engine` can decode requests in a continuous batch, else why not."""
    if getattr(engine, "kv", None) is None or getattr(engine, "fault", None) is None:
        return "not the reference engine"
    if engine.fault.fault is not None:
        return "a canary fault drill is active"
    return None


def greedy_below_eps(request: GenerationRequest) -> GenerationRequest:
    """vLLM's rule (SamplingParams, _SAMPLING_EPS): a temperature under 1e-5 is greedy. Dividing
    logits by 3e-300 overflows to ±inf and softmax to NaN; the limit of softmax(x / T) is the argmax."""
    return replace(request, temperature=0.0) if request.temperature < SAMPLING_EPS else request


class PrefillFailed(Exception):
    """A step that prefilled joining rows failed: those rows have left the batch (their rows are
    free; `seqs` names them, `__cause__` says why), and the running rows are as before the step."""

    def __init__(self, seqs: list[Sequence], cause: Exception):
        super().__init__(str(cause))
        self.seqs = seqs


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
    """Up to `rows` sequences decoded together, joining and leaving between steps.

    waves: as the engine's generate() runs requests (it wraps a canary drill's hooks around the
    loop, so a drill does not stop it): `add_wave` admits up to `rows` requests at once into a
    static batch (WaveRows); with speculative decoding, one request at a time (rows must be 1)
    through SpeculativeRows' one-request passes."""

    def __init__(self, engine: DecodeHost, rows: int, waves: bool = False):
        if not waves and (why := unbatchable(engine)) is not None:
            raise ValueError(f"continuous batching: {why}")
        a = engine.args
        self.engine = engine
        speculative = engine.proposer is not None
        self.cache: RowCache | DecoderRows | SpeculativeRows | WaveRows
        if waves:
            self.cache = SpeculativeRows(engine, rows, one_request=True) if speculative else WaveRows(engine, rows)
        elif speculative and engine.kv.lossy:
            self.cache = SpeculativeRows(engine, rows)
        elif engine.kv.lossy:
            self.cache = DecoderRows(engine, rows)
        else:
            self.cache = RowCache(a.n_layers, rows, a.n_kv_heads, a.head_dim, a.max_seq_len, engine.compute_dtype,
                                  engine.device)
        self.seqs: dict[int, Sequence] = {}  # row → its sequence
        self.eos = engine.tokenizer.eos_token_id
        # speculative decoding: k drafts at most per row and step, and the slots they need past an answer
        self.k: int = engine.proposer.k if engine.proposer is not None else 0
        self.extra = self.k + 1 if self.k else 0
        if self.k and not waves:
            engine.verify.reason = "off: continuous batching verifies every row's drafts in one eager pass"
        # the last greedy step's picks, still on the device, and the rows they are for: the next
        # step feeds them back without a copy from the host (the step's one host sync is reading them)
        self._picked: tuple[list[int], torch.Tensor] | None = None
        # engine-serve's joined rows whose prompts the next step prefills beside the decode rows
        # (`join`; a lossless RowCache without speculative decoding: RowCache.mixed)
        self._mixes = isinstance(self.cache, RowCache) and not self.k
        # the lossless rows' forwards multiply by oneDNN-packed weights (packed.py)
        self._linears = PackedLinears(engine.model) if isinstance(self.cache, RowCache) else None
        self._joining: list[Sequence] = []

    @property
    def free_rows(self) -> int:
        return len(self.cache.lengths) - len(self.seqs)

    def _free_row(self) -> int:
        return next(r for r in range(len(self.cache.lengths)) if r not in self.seqs)

    def held(self) -> int:
        """Token positions the rows hold (prompts and the tokens written after them)."""
        return sum(self.cache.lengths[r] for r in self.seqs)

    @torch.inference_mode()
    def add(self, request: GenerationRequest, before_prefill: Callable[[], None] = lambda: None) -> Sequence:
        """Prefill `request` into a free row and pick its first token (the sequence is `done`
        at once when that token is EOS or max_new_tokens is 1). Its TTFT counts from just before the
        prefill, once the prompt is tokenized and its proposer ready; before_prefill() runs there
        (a canary drill's TTFT delay). ValueError: the input does not fit."""
        seq = self._admit(request)
        engine = self.engine
        ids = torch.tensor([seq.prompt], device=engine.device)  # [1, T]
        width = len(seq.prompt) + request.max_new_tokens + self.extra
        before_prefill()
        with _sdpa_backends(engine.device), self._packed(len(seq.prompt)):
            logits = cast(RowCache | DecoderRows | SpeculativeRows, self.cache).prefill(engine.model, seq.row, ids,
                                                                                       width)  # _admit: not WaveRows
        self.seqs[seq.row] = seq
        self._take(logits, [seq])
        return seq

    def join(self, request: GenerationRequest) -> Sequence:
        """engine-serve's admission: `request` takes a free row now, and where the rows are a
        lossless RowCache without speculative decoding its prompt is prefilled by the next `step`,
        in the same forward as the running rows' decode step (RowCache.mixed), which also picks its
        first token; elsewhere it is prefilled at once, as `add` does. ValueError: the input does
        not fit."""
        if not self._mixes:
            return self.add(request)
        seq = self._admit(request)
        self.seqs[seq.row] = seq
        self._joining.append(seq)
        return seq

    def _admit(self, request: GenerationRequest) -> Sequence:
        """A free row's sequence for `request`, its prompt tokenized and its width checked (not yet in the batch)."""
        engine = self.engine
        request = greedy_below_eps(request)
        prompt = engine.prompt_token_ids(request)
        if not prompt:
            raise ValueError("the prompt has no tokens")
        width = len(prompt) + request.max_new_tokens + self.extra
        if width > engine.args.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({request.max_new_tokens})"
                             f"{f' + k + 1 ({self.extra}, speculative decoding)' if self.extra else ''} exceed the "
                             f"model's context of {engine.args.max_seq_len}")
        if isinstance(self.cache, WaveRows):
            raise RuntimeError("ContinuousBatch.add: a batch of waves admits requests with add_wave")
        if not self.free_rows:
            raise RuntimeError("ContinuousBatch.add: every row is taken")
        generator = torch.Generator(device=engine.device).manual_seed(request.seed)
        proposer = engine.proposer.fresh() if engine.proposer is not None else None
        if proposer is not None:
            proposer.reset(width)
        return Sequence(request, self._free_row(), prompt, generator, time.perf_counter(), proposer=proposer,
                        counters=SpeculativeCounters() if proposer is not None else None)

    @torch.inference_mode()
    def add_wave(self, requests: list[GenerationRequest],
                 before_prefill: Callable[[], None] = lambda: None) -> list[Sequence]:
        """generate()'s wave: up to `rows` requests join an empty batch together, their prompts
        prefilled at once (left-padded) into a static batch, each picking its first token. Their
        TTFT counts from the wave's start, once the decode step is prepared (on CUDA, captured);
        before_prefill() runs at that start. ValueError: the wave does not fit the context."""
        engine, store = self.engine, self.cache
        if not isinstance(store, WaveRows):
            raise RuntimeError("ContinuousBatch.add_wave: a batch made with waves=True and no speculative decoding")
        if self.seqs or not 0 < len(requests) <= len(store.lengths):
            raise RuntimeError(f"ContinuousBatch.add_wave: 1 to {len(store.lengths)} requests join an empty batch")
        requests = [greedy_below_eps(r) for r in requests]
        prompts = [engine.prompt_token_ids(r) for r in requests]
        if not all(prompts):
            raise ValueError("the prompt has no tokens")
        P, steps = max(len(p) for p in prompts), max(r.max_new_tokens for r in requests)
        if P + steps > engine.args.max_seq_len:
            raise ValueError(f"prompt ({P} tokens) + max_new_tokens ({steps}) exceed the model's context of "
                             f"{engine.args.max_seq_len}")
        gens = [torch.Generator(device=engine.device).manual_seed(r.seed) for r in requests]
        logits, started = store.prefill_wave(prompts, steps, before_prefill)
        seqs = [Sequence(r, b, p, g, started) for b, (r, p, g) in enumerate(zip(requests, prompts, gens, strict=True))]
        self.seqs.update((s.row, s) for s in seqs)
        self._take(logits, seqs)
        return seqs

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One decode step over every unfinished row: each gets its next token, and each row that
        joined since the last step (`join`) its prefill and first token, in the same forward.
        Returns them: the decode rows, then the joining ones."""
        joining = self._next_joining()
        active = [s for _, s in sorted(self.seqs.items()) if not s.done and s.tokens]
        if not active and not joining:
            return []
        device = self.engine.device
        if self.k:
            self._speculate(active)
            return active
        rows = [s.row for s in active]
        tokens: torch.Tensor | None = None  # [B, 1]
        if self._picked is not None and self._picked[0] == rows:  # last step's greedy picks, on the device
            tokens = self._picked[1][:, None]
        elif active:
            tokens = torch.tensor([[s.tokens[-1]] for s in active], device=device)
        lengths = list(self.cache.lengths)
        try:
            with _sdpa_backends(device), self._packed(len(rows) + sum(len(s.prompt) for s in joining)):
                if joining:
                    logits = cast(RowCache, self.cache).mixed(self.engine.model, tokens, rows,
                                                              [(s.row, s.prompt) for s in joining])  # [B + J, V]
                else:
                    logits = self.cache.decode(self.engine.model, cast(torch.Tensor, tokens), rows)  # [B, V]
        except Exception as e:
            if not joining:
                raise
            # the prompts' step failed (memory for a long one, say): they leave the batch, and the
            # running rows are as before it (the slots it wrote are rewritten by the next step)
            self.cache.lengths[:] = lengths
            for s in joining:
                del self.seqs[s.row]
            raise PrefillFailed(joining, e) from e
        self._take(logits, active + joining)
        return active + joining

    def _packed(self, tokens: int) -> contextlib.AbstractContextManager[None]:
        """The packed weights for a forward of `tokens` tokens (one token: the plain weights' GEMV)."""
        return self._linears.active() if self._linears is not None and tokens > 1 else contextlib.nullcontext()

    def _next_joining(self) -> list[Sequence]:
        """The joined rows this step prefills: the oldest first, while their prompts total at most
        MIXED_PROMPT_TOKENS (the first always goes, whatever its length); the rest wait a step."""
        taken, total = 0, 0
        for s in self._joining:
            if taken and total + len(s.prompt) > MIXED_PROMPT_TOKENS:
                break
            taken, total = taken + 1, total + len(s.prompt)
        out, self._joining = self._joining[:taken], self._joining[taken:]
        return out

    def _speculate(self, active: list[Sequence]) -> None:
        """One speculative step over the active rows: each proposes (at most what its answer has
        room for, less the correction or bonus token), one target pass verifies every row's last
        token and drafts, and each accepts with its own generator (speculative_verify.accept)."""
        proposed = [propose(cast(NgramProposer | DraftModelProposer, s.proposer), s.prompt + s.tokens, s.request,
                            s.tokens, s.generator) for s in active]
        width = 1 + max(len(d) for d, _ in proposed)
        # a row with fewer drafts is padded with its last token: those positions' logits are not read
        tokens = torch.tensor([[s.tokens[-1], *d, *[s.tokens[-1]] * (width - 1 - len(d))]
                               for s, (d, _) in zip(active, proposed, strict=True)], device=self.engine.device)
        cache = cast(RowCache | SpeculativeRows, self.cache)
        rows = [s.row for s in active]
        with _sdpa_backends(self.engine.device), self._packed(tokens.numel()):
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
        """Each row's pick from its logits [B, V]."""
        self._picked = None
        if all(s.greedy for s in seqs):  # one argmax over the batch: the step's one host sync
            picked = logits.argmax(-1)
            picks = cast(list[int], picked.tolist())
            # kept in row order, as the next step lists its rows (a mixed step's joiners came last)
            order = sorted(range(len(seqs)), key=lambda b: seqs[b].row)
            if order != list(range(len(seqs))):
                picked = picked[torch.tensor(order, device=picked.device)]
            self._picked = ([seqs[b].row for b in order], picked)
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
        """Free the sequence's row (finished, or its client left, perhaps before its prefill)."""
        del self.seqs[seq.row]
        if seq in self._joining:
            self._joining.remove(seq)
        self.cache.release(seq.row)
        if isinstance(seq.proposer, DraftModelProposer):  # the draft model's own cache counts as one more
            self.engine.usage.tokens(seq.proposer.held, seq.proposer.cache, seq.proposer.model.args.max_seq_len)

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
