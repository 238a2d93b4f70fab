"""Where a regression starts: how far a candidate's forward pass has drifted from the baseline's,
layer by layer, on the same document (the `layers` scorer; workers/producers/layer_drift.py).

At each layer four sites, in the order the pass reaches them: the keys and the values as the KV
cache holds them for the next token, the attention output, and the residual stream after the
layer (before the final norm). Each is compared with the baseline's as a relative error,
‖candidate − baseline‖ / ‖baseline‖ over the window's tokens after the start token (Frobenius
norms; the start token's activations are often far larger than the rest and would hide them),
and the hidden state also as the mean cosine over those tokens.

The first divergent site is the first, in that order, whose relative error (mean over documents)
exceeds DIVERGES. A KV-cache format's starts at layer 0's keys or values (the same weights and
inputs give the same keys; the cache alone changes what is read back); a weight format's at
layer 0's keys or attention. The growth per layer is the geometric mean of the hidden state's
relative error's ratio, layer over layer, from the first divergent layer on (×1.1: the relative
error is 10 % larger after each layer than before it). It mixes what a layer passes on with what
it adds of its own (a KV format adds error at every layer), and each error is relative to a
residual stream that itself grows with depth, so it is not how much one layer amplifies an error
it is given. Reported, not gated: it says where to look, not whether to ship.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from engines.protocol import LayerStates
from evals.stats import bootstrap_counts

if TYPE_CHECKING:
    from vocabulary.comparison import Comparison

SITES = ("keys", "values", "attention", "hidden")  # in the order a layer's pass reaches them
# a site diverges past this relative error: far above float32 round-off between two runs of the same
# weights (≈1e-7), below what any lossy format or weight quantization puts on layer 0 (≥ 3e-3 measured)
DIVERGES = 1e-3


def relative_error(base: np.ndarray, cand: np.ndarray) -> float:
    """‖cand − base‖ / ‖base‖ (Frobenius); where the baseline's is all zeros, 0 if the candidate's
    is too, else 1 (a whole departure: a stored figure is always finite)."""
    b, c = base.astype(np.float64), cand.astype(np.float64)
    norm = float(np.linalg.norm(b))
    diff = float(np.linalg.norm(c - b))
    return diff / norm if norm > 0 else (0.0 if diff == 0 else 1.0)


def mean_cosine(base: np.ndarray, cand: np.ndarray) -> float:
    """The mean over tokens (rows of [T, dim]) of cos(base_t, cand_t); a zero row counts as 1 when both are."""
    b, c = base.astype(np.float64), cand.astype(np.float64)
    nb, nc = np.linalg.norm(b, axis=-1), np.linalg.norm(c, axis=-1)
    dot = (b * c).sum(-1)
    cos = np.where((nb > 0) & (nc > 0), dot / np.maximum(nb * nc, 1e-300), np.where((nb == 0) & (nc == 0), 1.0, 0.0))
    return float(cos.mean())


@dataclass(frozen=True)
class LayerDriftRecord:
    """One document's drift, per layer (index = layer): each site's relative error against the
    baseline's, the hidden state's mean cosine, and how many tokens the window held."""

    KIND: ClassVar[str] = "layer_drift"
    sample_key: str
    keys: tuple[float, ...]
    values: tuple[float, ...]
    attention: tuple[float, ...]
    hidden: tuple[float, ...]  # after the layer
    hidden_cos: tuple[float, ...]
    tokens: int

    @classmethod
    def measure(cls, sample_key: str, base: LayerStates, cand: LayerStates) -> LayerDriftRecord | None:
        """None where the two read different tokens (different tokenizers) or models of another depth."""
        if base.token_ids != cand.token_ids or base.hidden.shape != cand.hidden.shape:
            return None
        layers, t = range(base.attention.shape[0]), slice(1 if len(base.token_ids) > 1 else 0, None)
        return cls(sample_key,
                   tuple(relative_error(base.keys[i][t], cand.keys[i][t]) for i in layers),
                   tuple(relative_error(base.values[i][t], cand.values[i][t]) for i in layers),
                   tuple(relative_error(base.attention[i][t], cand.attention[i][t]) for i in layers),
                   tuple(relative_error(base.hidden[i + 1][t], cand.hidden[i + 1][t]) for i in layers),
                   tuple(mean_cosine(base.hidden[i + 1][t], cand.hidden[i + 1][t]) for i in layers),
                   len(base.token_ids))

    def to_row(self) -> dict[str, Any]:
        short = lambda xs: [float(f"{x:.6g}") for x in xs]  # noqa: E731
        return {"sample_key": self.sample_key, "metric": self.KIND, "value": self.hidden[-1] if self.hidden else None,
                "extra": {"keys": short(self.keys), "values": short(self.values), "attention": short(self.attention),
                          "hidden": short(self.hidden), "hidden_cos": short(self.hidden_cos), "tokens": self.tokens}}

    @classmethod
    def from_row(cls, sample_key: str, value: float | None, extra: Mapping[str, Any] | None) -> LayerDriftRecord:
        e = extra or {}
        floats = lambda key: tuple(float(x) for x in e.get(key) or ())  # noqa: E731
        return cls(sample_key, floats("keys"), floats("values"), floats("attention"), floats("hidden"),
                   floats("hidden_cos"), int(e.get("tokens") or 0))


@dataclass(frozen=True)
class DriftSummary:
    """A config's drift over its documents: each site's mean relative error per layer, where it
    starts and how it grows."""

    per_layer: dict[str, tuple[float, ...]]  # site → mean over documents, per layer
    first: tuple[int, str] | None  # (layer, site) of the first divergent site; None: none past DIVERGES
    growth: float | None  # the hidden state's error ratio per layer from the first divergent layer on

    def where(self) -> str:
        """'layer 0 keys', or 'no layer past 0.001'."""
        if self.first is None:
            return f"no layer past {DIVERGES:g}"
        return f"layer {self.first[0]} {self.first[1]}"


def summarize(records: Sequence[LayerDriftRecord], eps: float = DIVERGES) -> DriftSummary:
    depth = min(len(r.hidden) for r in records)
    per_layer = {site: tuple(float(np.mean([getattr(r, site)[i] for r in records])) for i in range(depth))
                 for site in (*SITES, "hidden_cos")}
    first = next(((i, site) for i in range(depth) for site in SITES if per_layer[site][i] > eps), None)
    growth = None
    if first is not None:
        hidden = per_layer["hidden"][first[0]:]
        ratios = [b / a for a, b in itertools.pairwise(hidden) if a > 0 and b > 0]
        growth = float(np.exp(np.mean(np.log(ratios)))) if ratios else None
    return DriftSummary(per_layer, first, growth)


def layer_drift_comparison(ctx: Any) -> Comparison | None:
    """The compare target of `layer_drift` (vocabulary/metrics.py): the hidden state's relative error
    after the last layer, mean over documents with a bootstrap CI, and in its details where the
    drift starts and how it grows. None for the baseline, or where nothing was measured."""
    from evals.compare import reported

    records = list(ctx.mine.kinds.get(LayerDriftRecord.KIND, {}).values())
    records = [r for r in records if r.hidden]
    if ctx.is_base or not records:
        return None
    summary = summarize(records)
    last = np.array([r.hidden[-1] for r in records])
    means = bootstrap_counts(len(last), 2000, ctx.seed) @ last / len(last)
    lo, hi = (float(x) for x in np.percentile(means, [2.5, 97.5]))
    details = {"first_divergent": summary.where(), "growth_per_layer": summary.growth,
               "per_layer": {site: [float(f"{x:.4g}") for x in xs] for site, xs in summary.per_layer.items()},
               "diverges_past": DIVERGES}
    return reported(LayerDriftRecord.KIND, float(last.mean()), lo, hi, len(records), min_n=2, details=details)
