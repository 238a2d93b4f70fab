"""Quality by position: a document's loss summed apart per position bucket, so that a loss that
starts deep in the context (a compressed KV cache read far back, a RoPE or window bug) shows in
the late buckets while the early ones stay clean, instead of being averaged over the whole
document.

A scored token's position is the slot, within its perplexity window, of the token that predicts
it: the number of context tokens it is predicted from, less one (engines/protocol.py
strided_windows; every engine scores the same windows, so the same tokens fall in the same
bucket on both sides of a comparison). The buckets split [0, window) at POSITION_EDGES.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from engines.protocol import WindowSpec, strided_windows

POSITION_EDGES = (128, 512, 2048, 8192, 32768)  # bucket bounds (slots), cut at the window's length
ANSWER_EDGES = (16, 64, 256, 1024, 4096, 16384)  # bucket bounds by token index in a generated answer
OPEN_END = 2**31  # the end of the last answer bucket: no end
# first slot (an answer's: first token index), the one after the last, Σ of the figure (−log p, a KLD), tokens
PositionBucket = tuple[int, int, float, int]


def position_buckets(window: WindowSpec) -> list[tuple[int, int]]:
    """[lo, hi) slot ranges covering a window: e.g. [(0, 128), (128, 256)] for a 256-token window."""
    edges = [0, *(e for e in POSITION_EDGES if e < window.max_length), window.max_length]
    return list(itertools.pairwise(edges))


def token_positions(n_tokens: int, window: WindowSpec) -> list[int]:
    """The slot of the predicting token for each of a document's n_tokens scored tokens, in
    document order: a window (begin, end, n) scores its last n predictions, from slots
    end − begin − n … end − begin − 1."""
    out: list[int] = []
    for begin, end, n in strided_windows(n_tokens, window):
        out.extend(range(end - begin - n, end - begin))
    return out


def position_nll(logprobs: Sequence[float], window: WindowSpec) -> tuple[PositionBucket, ...]:
    """(lo, hi, Σ −log p, token count) for each bucket of position_buckets(window), in order."""
    return position_totals([-lp for lp in logprobs], window)


def position_totals(values: Sequence[float], window: WindowSpec) -> tuple[PositionBucket, ...]:
    """(lo, hi, Σ value, token count) for each bucket of position_buckets(window), in order: a
    per-token figure of a document's scored tokens (−log p, a KLD) summed by position."""
    buckets = position_buckets(window)
    total, count = [0.0] * len(buckets), [0] * len(buckets)
    for value, pos in zip(values, token_positions(len(values), window), strict=True):
        b = next(i for i, (_, hi) in enumerate(buckets) if pos < hi)
        total[b] += value
        count[b] += 1
    return tuple((lo, hi, t, n) for (lo, hi), t, n in zip(buckets, total, count, strict=True))


def bucket_label(lo: int, hi: int) -> str:
    """How a bucket [lo, hi) reads: its first and last slot, "128–255" ("16384+" with no end)."""
    return f"{lo}+" if hi >= OPEN_END else f"{lo}–{hi - 1}"


def answer_totals(values: Sequence[float]) -> tuple[PositionBucket, ...]:
    """(lo, hi, Σ value, token count) of a generated answer's per-token figures (−log p) by the
    token's index in the answer, for each bucket of ANSWER_EDGES the answer reaches, in order: an
    answer of 20 tokens gives (0, 16, …, 16) and (16, 64, …, 4). The last bucket runs past the last
    edge."""
    edges = [0, *ANSWER_EDGES, OPEN_END]
    return tuple((lo, hi, float(sum(values[lo:hi])), len(values[lo:hi]))
                 for lo, hi in itertools.pairwise(edges) if lo < len(values))
