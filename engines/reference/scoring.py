"""Scoring documents on the reference engine: the strided windows of a document, each scored
by prefill (the rolling log-likelihood, perplexity) or teacher-forced one token per decode step.

The rolling pass scores a window in one prefill. Servers differ on whether a prompt's prefill
reads its compressed KV cache at all, so a perplexity from the prefill can show nothing for a KV
format that breaks every long answer. `decode_windows` writes each token to the cache and
predicts the next from what the cache gives back, as decoding does: the same windows, the same
scored tokens, one Decoder step per position (decode_nll_ratio).

A job is one window: (document index, input ids, scored count n, the n targets).
Shapes: B windows in a batch, W the widest window's inputs, V vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engines.protocol import (
    ChoiceRequest,
    RollingRequest,
    RollingResult,
    count_words,
    strided_windows,
    token_texts,
    tokenize_with_spans,
)
from engines.reference.cache import NoCache

if TYPE_CHECKING:
    from engines.reference.engine import ReferenceEngine

Job = tuple[int, list[int], int, list[int]]  # (document index, input ids, scored count n, the n targets)
Scores = dict[int, tuple[list[float], list[int], list[float]]]  # job → (log p of its targets, argmax, its log p)


def windows(engine: ReferenceEngine,
            requests: Sequence[RollingRequest]) -> tuple[list[Job], list[list[int]], list[tuple[tuple[int, int], ...]]]:
    """Each document's strided windows as (document index, input ids, scored count, targets),
    with the documents' token ids and character spans."""
    jobs, encoded, spans = [], [], []
    for i, req in enumerate(requests):
        if req.window.max_length > engine.args.max_seq_len:
            raise ValueError(f"perplexity.window: {req.window.max_length} exceeds the model's context of "
                             f"{engine.args.max_seq_len} positions; use a window ≤ {engine.args.max_seq_len}")
        ids, offsets = tokenize_with_spans(engine.tokenizer, req.text)
        spans.append(offsets)
        if not ids:
            raise ValueError(f"document '{req.doc_id}' has no tokens")
        encoded.append(ids)
        seq = [engine.start_id] + ids
        for begin, end, n in strided_windows(len(ids), req.window):
            jobs.append((i, seq[begin:end], n, seq[end - n + 1 : end + 1]))
    return jobs, encoded, spans


def results(engine: ReferenceEngine, requests: Sequence[RollingRequest], jobs: list[Job], out: Scores,
            encoded: list[list[int]], spans: list[tuple[tuple[int, int], ...]]) -> list[RollingResult]:
    """Each document's result from its windows' scores, in the requests' order (a drill's prompt
    log-prob fault applied, engines/reference/faults.py); with each token's text and the greedy
    one's where a request asks for them."""
    logprobs: list[list[float]] = [[] for _ in requests]
    greedy: list[list[int]] = [[] for _ in requests]
    top: list[list[float]] = [[] for _ in requests]
    for j, job in enumerate(jobs):
        logprobs[job[0]].extend(out[j][0])
        greedy[job[0]].extend(out[j][1])
        top[job[0]].extend(out[j][2])
    return [
        RollingResult(req.doc_id, tuple(encoded[i]), tuple(engine.fault.prompt_logprobs(logprobs[i])),
                      tuple(greedy[i]),
                      len(req.text.encode("utf-8")), count_words(req.text), spans[i],
                      greedy_logprobs=tuple(top[i]),
                      token_texts=token_texts(engine.tokenizer, encoded[i]) if req.texts else (),
                      greedy_texts=token_texts(engine.tokenizer, greedy[i]) if req.texts else ())
        for i, req in enumerate(requests)
    ]


def target_logits(logits: torch.Tensor, targets: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's logit of its target, each row's logsumexp) of logits [n, V]: log p = the first less the second."""
    picked = logits.gather(-1, torch.tensor(list(targets), device=logits.device)[:, None]).squeeze(-1)
    return picked, torch.logsumexp(logits, -1)


def slots_movable(engine: ReferenceEngine, width: int | None = None) -> bool:
    """Whether a pass (of `width` slots, where known) may lay its sequences at any slots of the
    cache, not each at slots equal to its positions (several windows end to end in one row, a
    choice tree): where the KV format stores each slot on its own (KVFormat.slots_on_their_own),
    or where the pass is short enough that every slot is read raw (KVFormat.raw_slots: KIVI's
    full-precision window). Never under a KV-corruption drill, whose noise is drawn per slot."""
    return engine.kv.slots_on_their_own or (width is not None and width <= engine.kv.raw_slots)


PACKED_MASK_BYTES = 256 << 20  # a packed pass's mask [B, 1, W, W] stays within this; wider, a window per row


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """First-fit decreasing: the indices of sequences of these lengths in rows of at most `width`
    tokens each (a longer sequence alone in its row), every row's in the order placed."""
    rows: list[list[int]] = []
    room: list[int] = []
    for j in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for r, left in enumerate(room):
            if lengths[j] <= left:
                rows[r].append(j)
                room[r] -= lengths[j]
                break
        else:
            rows.append([j])
            room.append(width - lengths[j])
    return rows


def _batches(engine: ReferenceEngine, jobs: list[Job]) -> list[list[list[int]]]:
    """The prefill passes over these windows: per pass its rows, per row the windows it holds end
    to end. Lossless: one row of batch_size windows (NoCache, no padding). A lossy format's rows
    are right-padded to the pass's widest row: windows packed end to end where its slots may lie
    anywhere (slots_movable: fewer padded slots) and the pass's mask stays small (PACKED_MASK_BYTES),
    else one window per row (KIVI's windows of a rolling pass are never all within its raw window
    on the suites this serves, so it is not asked)."""
    lengths = [len(job[1]) for job in jobs]
    order = sorted(range(len(jobs)), key=lambda j: (lengths[j], j))
    if not engine.kv.lossy:
        return [[order[s : s + engine.batch_size]] for s in range(0, len(order), engine.batch_size)]
    widest = max(lengths, default=0)
    pack = slots_movable(engine) and engine.batch_size * widest**2 <= PACKED_MASK_BYTES
    rows = pack_rows(lengths, widest) if pack and jobs else [[j] for j in order]
    return [rows[s : s + engine.batch_size] for s in range(0, len(rows), engine.batch_size)]


def prefill_windows(engine: ReferenceEngine, jobs: list[Job], keep: dict[int, torch.Tensor] | None = None) -> Scores:
    """{job: (log p of its scored targets, argmax at each, the argmax's log p)}; with keep, also
    each job's log-softmax rows [n, V] on the CPU."""
    out: dict[int, tuple[list[float], list[int], list[float]]] = {}
    for batch in _batches(engine, jobs):
        if engine.kv.lossy:
            width = max(sum(len(jobs[j][1]) for j in members) for members in batch)
            B = len(batch)
            # right padding: a row's windows end to end from slot 0, each at positions 0…, its
            # padding after them (in its last window, unread); a query sees its own window's
            # earlier slots (with one window per row: causal, positions equal slots)
            x = torch.full((B, width), engine.start_id, dtype=torch.long)
            pos = torch.zeros(B, width, dtype=torch.long)
            seg = torch.zeros(B, width, dtype=torch.long)
            places = []  # (batch row, first slot) per window
            for b, members in enumerate(batch):
                at = 0
                for w, j in enumerate(members):
                    n = len(jobs[j][1])
                    x[b, at : at + n] = torch.tensor(jobs[j][1])
                    pos[b, at:] = torch.arange(width - at)
                    seg[b, at:] = w
                    places.append((b, at))
                    at += n
            mask = torch.ones(width, width, dtype=torch.bool, device=engine.device).tril()[None, None]
            if any(len(members) > 1 for members in batch):  # and within a window: [B, 1, W, W]
                seg = seg.to(engine.device)
                mask = mask & (seg[:, :, None] == seg[:, None, :])[:, None]
            slots = torch.arange(width, device=engine.device)
            cache = engine.new_cache(B, width)
            h = engine.model(x.to(engine.device), pos.to(engine.device), slots, cache, mask, hidden=True)
            engine.usage.cache(cache)  # memory, not kv_cache_usage: a scoring window is not a request a server holds
            idx = [j for members in batch for j in members]
        else:
            # packed: the windows end to end in one row with no padding, positions restarting
            # at each, attention causal within each window (NoCache with their lengths)
            [idx] = batch
            lengths = [len(jobs[j][1]) for j in idx]
            x = torch.tensor([[t for j in idx for t in jobs[j][1]]], device=engine.device)
            pos = torch.cat([torch.arange(n, device=engine.device) for n in lengths])[None]
            h = engine.model(x, pos, pos[0], NoCache(lengths), None, hidden=True)
            starts = [0, *itertools.accumulate(lengths)][:-1]
            places = [(0, start) for start in starts]
        for (row, start), j in zip(places, idx, strict=True):
            _, inp, n, tgt = jobs[j]
            # lm_head only on this window's scored positions (no padding), one window at a
            # time so its [n, V] logits stay cache-sized; log p = logit − logsumexp
            logits = engine.model.lm_head(h[row, start + len(inp) - n : start + len(inp)]).float()
            picked, norm = target_logits(logits, tgt)
            best, argmax = logits.max(-1)
            out[j] = ((picked - norm).tolist(), argmax.tolist(), (best - norm).tolist())
            if keep is not None:
                keep[j] = torch.log_softmax(logits, -1).cpu()
    return out


def decode_windows(engine: ReferenceEngine, jobs: list[Job]) -> Scores:
    """jobs as `windows` makes them → {job: (log p of its n targets, argmax token at each, its log p)}, each
    token teacher-forced through a decode step. Windows of a batch are
    right-padded: a row's padding comes after its last input, so no real position reads it."""
    order = sorted(range(len(jobs)), key=lambda j: (len(jobs[j][1]), j))
    out: dict[int, tuple[list[float], list[int], list[float]]] = {}
    for s in range(0, len(order), engine.batch_size):
        idx = order[s : s + engine.batch_size]
        width = max(len(jobs[j][1]) for j in idx)
        pad = engine.start_id
        # the token each position predicts: the next input, and after the last input its target
        x = torch.tensor([jobs[j][1] + [pad] * (width - len(jobs[j][1])) for j in idx], device=engine.device)
        y = torch.tensor([jobs[j][1][1:] + [jobs[j][3][-1]] + [pad] * (width - len(jobs[j][1])) for j in idx],
                         device=engine.device)  # [B, W]
        decoder = engine.decoder(len(idx), width)
        decoder.prepare()
        picked, greedy = torch.empty(len(idx), width), torch.empty(len(idx), width, dtype=torch.long)
        best = torch.empty(len(idx), width)
        logits = decoder.prefill(x[:, :1])
        for t in range(width):
            if t:
                logits = decoder.step(x[:, t])
            logprobs = torch.log_softmax(logits.float(), -1)  # [B, V]
            picked[:, t] = logprobs.gather(-1, y[:, t, None]).squeeze(-1).cpu()
            top, argmax = logprobs.max(-1)
            greedy[:, t], best[:, t] = argmax.cpu(), top.cpu()
        engine.usage.cache(decoder.cache)  # as for prefill_windows: memory, not kv_cache_usage
        for row, j in enumerate(idx):
            length, n = len(jobs[j][1]), jobs[j][2]
            out[j] = (picked[row, length - n : length].tolist(), greedy[row, length - n : length].tolist(),
                      best[row, length - n : length].tolist())
    return out


def with_distributions(engine: ReferenceEngine,
                       requests: Sequence[RollingRequest]) -> list[tuple[RollingResult, np.ndarray]]:
    """The rolling pass, and per document the log-softmax rows [T, V] its scored tokens were drawn from."""
    jobs, encoded, spans = windows(engine, requests)
    rows: dict[int, torch.Tensor] = {}
    found = results(engine, requests, jobs, prefill_windows(engine, jobs, rows), encoded, spans)
    per_doc: list[list[torch.Tensor]] = [[] for _ in requests]
    for j, job in enumerate(jobs):
        per_doc[job[0]].append(rows[j])
    return [(r, np.concatenate([x.float().numpy() for x in doc]) if doc else np.zeros((0, engine.args.vocab_size)))
            for r, doc in zip(found, per_doc, strict=True)]


Tree = tuple[int, list[list[int]], int, list[tuple[tuple[int, int], ...]]]  # (request, each choice's ids, p, spans)


def tree_slots(tree: Tree) -> int:
    """The slots a choice tree takes: the p inputs its choices share, then each choice's own."""
    return tree[2] + sum(len(x) - 1 - tree[2] for x in tree[1])


def choice_trees(engine: ReferenceEngine, requests: Sequence[ChoiceRequest]) -> list[Tree]:
    """Each item whose choices can share its prompt's pass: (its index, each choice's ids with the
    start token first, the inputs all choices share, p, each choice's character spans). An item is
    left out (scored rolling by the caller) where the tokenizer gives no spans, where prompt + a
    choice would not fit one window of the rolling pass (its scores would come from another
    context), or where the tree would not fit the model's context."""
    trees = []
    for i, req in enumerate(requests):
        encoded = [tokenize_with_spans(engine.tokenizer, req.prompt + choice) for choice in req.choices]
        seqs = [[engine.start_id] + ids for ids, _ in encoded]
        if not req.choices or any(not spans or not ids for ids, spans in encoded):
            continue
        if max(len(seq) - 1 for seq in seqs) > min(req.window.max_length, engine.args.max_seq_len):
            continue
        inputs = [seq[:-1] for seq in seqs]  # choice j's targets seq[1:] are read at its inputs seq[:-1]
        p = 0
        while p < min(map(len, inputs)) and all(x[p] == inputs[0][p] for x in inputs):
            p += 1
        if p + sum(len(x) - p for x in inputs) > engine.args.max_seq_len:
            continue
        trees.append((i, seqs, p, [spans for _, spans in encoded]))
    return trees


@torch.inference_mode()
def choices(engine: ReferenceEngine, requests: Sequence[ChoiceRequest]) -> list[tuple[float, ...] | None]:
    """Each item's choices scored over one pass of its prompt: a row holds the inputs its choices
    share (the start token and the prompt's tokens, positions 0…p−1), then each choice's own
    inputs at positions p…, each attending the shared ones and its own earlier ones (a tree mask).
    Choice j's log p of its k-th token is read where the rolling pass over prompt + choice reads
    it (the same token ids, positions and context; a drill's prompt log-prob fault, which shifts
    each log p alike, applied as there), and its score sums the tokens past the prompt's characters,
    the only rows the lm_head reads.
    None where choice_trees leaves an item out, and where the KV format reads a slot by its place
    in the cache, since the tree's slots are not the positions (slots_movable): every item under a
    KV-corruption drill (its noise is drawn per slot), and under KIVI an item whose tree is wider
    than the full-precision window (narrower, every slot is read raw wherever it lies)."""
    out: list[tuple[float, ...] | None] = [None] * len(requests)
    if not (engine.kv.slots_on_their_own or engine.kv.raw_slots):
        return out
    trees = sorted((t for t in choice_trees(engine, requests) if slots_movable(engine, tree_slots(t))), key=tree_slots)
    for s in range(0, len(trees), engine.batch_size):
        batch = trees[s : s + engine.batch_size]
        layouts = []  # per tree: the slot of each choice's first own input
        width = 0
        for _, seqs, p, _ in batch:
            starts, at = [], p
            for seq in seqs:
                starts.append(at)
                at += len(seq) - 1 - p
            layouts.append(starts)
            width = max(width, at)
        B = len(batch)
        x = torch.full((B, width), engine.start_id, dtype=torch.long)
        pos = torch.zeros(B, width, dtype=torch.long)
        mask = torch.eye(width, dtype=torch.bool).repeat(B, 1, 1, 1)  # [B, 1, W, W]; a padding slot sees itself
        for b, ((_, seqs, p, _), starts) in enumerate(zip(batch, layouts, strict=True)):
            x[b, :p] = torch.tensor(seqs[0][:p])
            pos[b, :p] = torch.arange(p)
            mask[b, 0, :p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
            for seq, start in zip(seqs, starts, strict=True):
                m = len(seq) - 1 - p
                x[b, start : start + m] = torch.tensor(seq[p:-1], dtype=torch.long)
                pos[b, start : start + m] = torch.arange(p, p + m)
                mask[b, 0, start : start + m, :p] = True
                mask[b, 0, start : start + m, start : start + m] = torch.ones(m, m, dtype=torch.bool).tril()
        slots = torch.arange(width, device=engine.device)
        cache = engine.new_cache(B, width)
        h = engine.model(x.to(engine.device), pos.to(engine.device), slots, cache, mask.to(engine.device), hidden=True)
        engine.usage.cache(cache)  # memory, not kv_cache_usage: an item is not a request a server holds
        for b, ((i, seqs, p, spans), starts) in enumerate(zip(batch, layouts, strict=True)):
            prompt_chars = len(requests[i].prompt)
            scores = []
            for seq, start, span in zip(seqs, starts, spans, strict=True):
                # only the tokens past the prompt's characters count: the lm_head reads their rows alone
                # (the prompt's tokens, most of a row, are scored by no choice)
                counted = [k for k, (_, end) in enumerate(span) if end > prompt_chars]
                if not counted:
                    scores.append(0.0)
                    continue
                # the input slot each counted target seq[k + 1] is read at: a shared one, then the choice's own
                rows = [k if k < p else start + k - p for k in counted]
                logits = engine.model.lm_head(h[b, rows]).float()
                picked, norm = target_logits(logits, [seq[k + 1] for k in counted])
                scores.append(float(sum(engine.fault.prompt_logprobs((picked - norm).tolist()))))
            out[i] = tuple(scores)
    return out
