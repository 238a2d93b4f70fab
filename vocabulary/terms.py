"""Domain terms: the tokens a team cares most about, scored apart from the rest of the document.

A loss concentrated on rare domain tokens ("IFRS 9.3.1.1" turning into "IFRS 9") barely moves a
whole document's perplexity: those tokens are a few percent of it. A suite lists its terms
(`perplexity.terms` in canary.yaml); the perplexity scorer then also sums the negative
log-likelihood of exactly the tokens that overlap a term, and `term_nll_ratio` compares those
sums between a candidate and its baseline (evals/compare.py).

An entry is a literal term, `re:<pattern>` for a regular expression, or `builtin:<name>` for a
shipped list (BUILTIN_TERMS). Torch-free: the config file validates entries with `compile_terms`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# Shipped term lists. python-identifiers fits the built-in pydoc corpus: dotted names such as
# os.path.join or json.dumps, and dunder names such as __init__.
BUILTIN_TERMS: dict[str, tuple[str, ...]] = {
    "python-identifiers": (
        r"re:\b[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+\b",
        r"re:\b__[A-Za-z0-9_]+__\b",
    ),
}


def _expand(entries: Sequence[str]) -> list[str]:
    out: list[str] = []
    for entry in entries:
        if entry.startswith("builtin:"):
            name = entry.removeprefix("builtin:")
            if name not in BUILTIN_TERMS:
                raise ValueError(f"'{entry}' is not a shipped term list; known: "
                                 f"{', '.join('builtin:' + k for k in BUILTIN_TERMS)}")
            out += BUILTIN_TERMS[name]
        else:
            out.append(entry)
    return out


def compile_terms(entries: Sequence[str]) -> re.Pattern[str] | None:
    """One pattern matching any listed term; None for an empty list. A literal matches as written
    (case-sensitive); a `re:` entry that does not compile is a ValueError naming it."""
    parts = []
    for entry in _expand(entries):
        if not entry.strip():
            raise ValueError("an empty term matches everywhere; remove it")
        if entry.startswith("re:"):
            pattern = entry.removeprefix("re:")
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise ValueError(f"'{entry}' is not a valid regular expression ({e})") from e
            if compiled.fullmatch(""):
                raise ValueError(f"'{entry}' matches the empty string, so it would mark nothing; make it match "
                                 f"at least one character")
            parts.append(f"(?:{pattern})")
        else:
            parts.append(re.escape(entry))
    return re.compile("|".join(parts)) if parts else None


def term_spans(text: str, pattern: re.Pattern[str]) -> list[tuple[int, int]]:
    """Character spans [start, end) of every term occurrence in `text`."""
    return [m.span() for m in pattern.finditer(text) if m.end() > m.start()]


def term_token_mask(char_spans: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """For each token's character span, whether it overlaps a term: a token that carries part of a
    term (" os" in "x = os.path.join") counts as the term's."""
    mask = []
    j = 0
    ordered = sorted(spans)
    for start, end in char_spans:
        while j < len(ordered) and ordered[j][1] <= start:  # terms wholly before this token
            j += 1
        k, hit = j, False
        while k < len(ordered) and ordered[k][0] < end:
            if ordered[k][1] > start and end > start:
                hit = True
                break
            k += 1
        mask.append(hit)
    return mask


def term_nll(text: str, logprobs: Sequence[float], char_spans: Sequence[tuple[int, int]],
             pattern: re.Pattern[str]) -> tuple[float, int] | None:
    """Σ −log p over the document's tokens that overlap a term, and how many there are; None when
    the engine gave no character span per token (the tokens cannot be placed in the text)."""
    if len(char_spans) != len(logprobs) or not char_spans:
        return None
    mask = term_token_mask(char_spans, term_spans(text, pattern))
    return -sum(lp for lp, hit in zip(logprobs, mask, strict=True) if hit), sum(mask)
