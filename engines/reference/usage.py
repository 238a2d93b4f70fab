"""What the reference engine's KV caches held, and how its speculative verify pass ran: state the
engine owns and hands to the loops and scorers that make caches (scoring.py, speculative_verify.py,
batching.py), so that none of them reaches into the engine's own members."""

from __future__ import annotations

from dataclasses import dataclass

from engines.reference.cache import KVCache


@dataclass
class KVUsage:
    """Peaks over a measurement window (reset by the engine's reset_peaks):

    - peak_bytes: KV bytes held together at one moment (a cache when it is made and again after
      use; every row of a continuous batch's caches at once);
    - peak_usage (kv_cache_usage): the peak, over every cache that served requests, of the token
      positions it held (rows × positions written: prompt + generated; padding holds no request's
      token) over what a server would reserve for those rows: each row's full context, as vLLM
      sizes a sequence's blocks up to max_model_len. The engine allocates just the width a batch
      needs, so held over allocated would read ~1.0 for every batch and say nothing. Speculative
      decoding: the target cache's high-water mark (drafts written for verification count,
      rejected or not); the draft model's own cache counts as one more cache. Requests only: a
      perplexity window is the canary's own scoring, not a request a server holds."""

    max_seq_len: int
    peak_bytes: int = 0
    peak_usage: float | None = None  # None until a cache has held a request's token

    def cache(self, cache: KVCache) -> KVCache:
        """Count a cache's bytes toward peak_bytes → the cache."""
        self.bytes(cache.nbytes())
        return cache

    def bytes(self, nbytes: int) -> None:
        """KV bytes held together at one moment, toward peak_bytes."""
        self.peak_bytes = max(self.peak_bytes, nbytes)

    def tokens(self, held: int, cache: KVCache, context: int | None = None) -> None:
        """`held` request tokens in `cache`, each row reserved `context` positions (default: the model's)."""
        rows = cache.k.shape[1]  # k: [L, B, H_kv, S, D]
        usage = held / (rows * (context or self.max_seq_len))
        self.peak_usage = usage if self.peak_usage is None else max(self.peak_usage, usage)

    def reset(self) -> None:
        self.peak_bytes, self.peak_usage = 0, None


@dataclass
class VerifyGraphs:
    """Speculative decoding's verify pass: how the last request's ran (`reason`: "captured", or
    why not, for describe()'s notes), and why its capture failed once it has (then it is not
    retried for later requests)."""

    reason: str = "not run yet"
    capture_failed: str | None = None
