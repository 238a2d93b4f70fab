"""Generation health and divergence classes: the ways an output breaks while prompt log-probs stay
exact (an empty answer, a loop, an answer cut short), and whether two greedy outputs part at a
near-tie (the noise of a server that is not batch-invariant) or at a token the baseline model was
sure of (a bug).

Text-based, so that every engine is judged the same way: an HTTP stream gives text, not ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# a tail unit of at most this many characters repeated is a loop ("not not not", "_IN_IN_IN")
MAX_LOOP_PERIOD = 32
MIN_DEGENERATE_CHARS = 8  # shorter answers are judged empty or fine, never a loop
# a phrase of at most this many words repeated back to back (three copies at least) over at least
# MIN_LOOP_SPAN words, anywhere in the answer, is a loop: "a b c a b c a b c" (9 words), "no no no
# no no no" (6); a word said three times ("very very very") is not
MAX_LOOP_WORDS = 8
MIN_LOOP_SPAN = 6
# vLLM's greedy tolerance: a greedy token within this many nats of the reference's best is a tie
# (vLLM tests/v1/e2e/general/accuracy_utils.py, AccuracyTolerance(greedy_atol=0.25))
NEAR_TIE_NATS = 0.25


def is_empty(text: str) -> bool:
    """An answer with no visible text (nothing, or whitespace only)."""
    return not text.strip()


def periodic_tail(text: str, max_period: int = MAX_LOOP_PERIOD) -> tuple[int, int]:
    """(period p, characters covered) of the longest tail of `text` that repeats a unit of p ≤
    max_period characters at least three times (text[i] == text[i − p] over the tail); (0, 0) if none.
    "ab not not not" → (4, 12): the unit " not" covers the last 12 characters."""
    best = (0, 0)
    n = len(text)
    for p in range(1, min(max_period, n // 3) + 1):
        i = n - 1
        while i - p >= 0 and text[i] == text[i - p]:
            i -= 1
        covered = n - 1 - i + p  # the matched run plus the unit it repeats
        if covered >= 3 * p and covered > best[1]:
            best = (p, covered)
    return best


def repeated_phrase(words: Sequence[str], max_words: int = MAX_LOOP_WORDS,
                    min_span: int = MIN_LOOP_SPAN) -> tuple[int, int, int]:
    """(phrase length n, copies, first word) of the longest run ANYWHERE in `words` where a phrase
    of n ≤ max_words words follows itself back to back at least three times, the copies spanning
    at least min_span words; (0, 0, −1) if none. "a b c d c d c d e" has none (6 words? only
    "c d" ×3 = 6 words: yes, (2, 3, 2)); "x y x y" has none (two copies)."""
    best, best_span = (0, 0, -1), 0
    for n in range(1, max_words + 1):
        j = n
        while j < len(words):
            if words[j] != words[j - n]:
                j += 1
                continue
            k = j
            while k < len(words) and words[k] == words[k - n]:
                k += 1
            span = k - j + n  # the first copy and every word that repeats the one n before it
            if span // n >= 3 and span >= min_span and span > best_span:
                best, best_span = (n, span // n, j - n), span
            j = k
    return best


def is_degenerate(text: str) -> bool:
    """A loop or a collapse: the answer (at least MIN_DEGENERATE_CHARS characters) ends in a
    repeating unit of ≤ 32 characters that covers at least half of it; or anywhere in it a phrase
    of 1 to 8 whitespace-separated words (about as many tokens) repeats back to back at least three
    times over at least MIN_LOOP_SPAN words, whether the answer then goes on or not (a loop the
    model broke out of, or one shorter than half the answer); or it has ≥ 10 words of which at most
    a fifth are distinct. A loop of whitespace ("\n\n\n…" to max_tokens) is one too, and empty
    as well."""
    if len(text) < MIN_DEGENERATE_CHARS:
        return False
    period, covered = periodic_tail(text)
    if period and covered >= len(text) / 2:
        return True
    words = text.split()
    if repeated_phrase(words)[0]:
        return True
    return len(words) >= 10 and len(set(words)) / len(words) <= 0.2


@dataclass(frozen=True)
class Scored:
    """An output as the baseline model reads it, teacher-forced after its prompt: its tokens and
    log p of each (the baseline's own tokenizer and weights, so any two outputs of one prompt are
    read the same way), and where the output leaves the model's greedy path (`leaves_greedy`):
    (position, log p of the model's top token − log p of the output's) at each token whose text is
    not the top token's, empty where it never does; `greedy_known` False where the engine gave no
    top token to check against."""

    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    leaves: tuple[tuple[int, float], ...] = ()
    greedy_known: bool = False
    # the first token that is not the model's top one but whose text begins the way the top token's
    # does (the model's own choice read back in other, longer tokens: `greedy_reading`); None where
    # there is none or the greedy path was not checked
    read_back_at: int | None = None

    def leaves_after(self, position: int, tau: float) -> tuple[int, float] | None:
        """The first place at or after `position` where the output leaves the greedy path by more than τ."""
        return next(((i, gap) for i, gap in self.leaves if i >= position and gap > tau), None)


def leaves_greedy(texts: Sequence[str], logprobs: Sequence[float], greedy_texts: Sequence[str],
                  greedy_logprobs: Sequence[float]) -> tuple[tuple[int, float], ...]:
    """Where an output leaves the model's greedy path (greedy_reading's first half)."""
    return greedy_reading(texts, logprobs, greedy_texts, greedy_logprobs)[0]


def greedy_reading(texts: Sequence[str], logprobs: Sequence[float], greedy_texts: Sequence[str],
                   greedy_logprobs: Sequence[float]) -> tuple[tuple[tuple[int, float], ...], int | None]:
    """Where an output, teacher-forced token by token (each token's text and log p), leaves the
    model's greedy path: (position, top log p − its log p) at each token that is not the model's
    top one and whose text does not begin the way the top token's text does, up to the first
    token read back in other tokens than were generated.

    A greedy answer generated as "ation" + "s" reads back as "ations": a token below the model's
    top "ation" though the model chose exactly this text. Reading stops there: the tokens after it
    are read after other tokens than the ones they were generated after, and the model's top
    choice can differ for that alone (seen on the zoo model: "," read after "ations" where "."
    is the top, though "," was the top after "ation" + "s"). So the output is checked from its
    start to its first such token; a departure later is not seen (the conservative reading).

    Returns (those departures, the position of that first token read back otherwise or None)."""
    rest = "".join(texts)
    out: list[tuple[int, float]] = []
    at = 0
    for i, (text, lp, top_text, top_lp) in enumerate(zip(texts, logprobs, greedy_texts, greedy_logprobs,
                                                           strict=True)):
        gap = top_lp - lp
        if gap > 1e-6:
            if rest.startswith(top_text, at):
                # the greedy text in other tokens: the tokens from here were generated otherwise
                return tuple(out), i
            out.append((i, round(gap, 4)))
        at += len(text)
    return tuple(out), None


@dataclass(frozen=True)
class Divergence:
    """Where two outputs of the same prompt part: the first differing token `position`, and the
    baseline model's log-prob gap there between the two tokens (|log p(a) − log p(b)|, both after
    the same prefix); near_tie when the gap is within τ. When one output is a prefix of the other,
    only the longer side's token is scored (the other ended: an end-of-sequence token or its
    length), so the gap is bounded below by log p − log(1 − p) of that token: near_tie unless
    even that bound exceeds τ.

    `read_back`: at that position, or before it, one side's text is read back in other tokens
    than it was generated in (Scored.read_back_at: a token whose text begins with the model's top
    token's, " C" + "I" read back as " CI" beside the other side's " C" + "D"; "2" + "2" read as
    "22"). At that token both texts go on the way the model's top token does and part inside it;
    after it every token is read after other tokens than it was generated after, and the model's
    preference there is not the one it chose by. Either way these tokens cannot tell a near-tie
    from a confident choice: not confident (near_tie), as leaves_greedy stops reading there too (a
    departure the reading cannot see is not counted: the price of not calling noise a defect)."""

    position: int
    gap: float
    near_tie: bool
    read_back: bool = False


def divergence(a: Scored, b: Scored, tau: float = NEAR_TIE_NATS) -> Divergence | None:
    """None when the two outputs are the same tokens."""
    for i, (x, y) in enumerate(zip(a.ids, b.ids, strict=False)):
        if x != y:
            gap = abs(a.logprobs[i] - b.logprobs[i])
            if any(r is not None and r <= i for r in (a.read_back_at, b.read_back_at)):
                return Divergence(i, gap, True, read_back=True)
            return Divergence(i, gap, gap <= tau)
    if len(a.ids) == len(b.ids):
        return None
    i = min(len(a.ids), len(b.ids))
    longer = a if len(a.ids) > len(b.ids) else b
    p = math.exp(longer.logprobs[i])
    gap = longer.logprobs[i] - math.log(max(1.0 - p, 1e-12))  # at least this far above the ending's
    return Divergence(i, gap, gap <= tau)


def confident(pairs: Sequence[tuple[Scored, Scored]], tau: float = NEAR_TIE_NATS) -> list[bool]:
    """Per pair: whether its outputs part at a confident token (a divergence with gap > τ)."""
    out = []
    for a, b in pairs:
        d = divergence(a, b, tau)
        out.append(d is not None and not d.near_tie)
    return out
