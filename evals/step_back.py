"""Step back one layer (docs/scorers.md): how much of a stacked config's quality loss each of its
optimizations causes on its own, from the ratios of its single-optimization ablations (each the
baseline with one axis of the stacked config: engines.spec.single_axis_ablation), all measured on
the same samples against the same baseline.

For a ratio metric r (candidate ÷ baseline; 1 = no loss), losses add on the log scale, so

    share_i      = log r_i / Σ_j log r_j          (the layers' shares sum to 1)
    interaction  = log r_stacked − Σ_j log r_j     (0 when the layers' losses simply multiply)

e.g. ppl ratios weights 1.05, kv_cache 1.20, stacked 1.30: log 1.05 = 0.0488, log 1.20 = 0.1823,
Σ = 0.2311, shares 21.1 % and 78.9 %, interaction log 1.30 − 0.2311 = 0.0313 (×1.032).
When Σ_j log r_j ≤ 0 no layer loses anything alone: the loss is the interaction and no share
is given. The advice names the layer with the largest share: the one to disable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

# The quality metrics a stacked config steps back on: the log-ratio metrics of the metric table
# whose loss is the model's (speed ratios are what the optimizations buy, not a loss to apportion).
LOSS_METRICS = ("ppl_ratio", "gen_nll_ratio", "term_nll_ratio")


def layer_shares(stacked_ratio: float, layer_ratios: Mapping[str, float]) -> tuple[dict[str, float] | None, float]:
    """({layer: share of the loss} or None when the layers lose nothing alone, interaction on the
    log scale). Every ratio must be a positive number."""
    for name, ratio in {"stacked": stacked_ratio, **layer_ratios}.items():
        if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"ratio of {name}: {ratio!r} is not a positive number; a ratio of perplexities is > 0")
    logs = {name: math.log(ratio) for name, ratio in layer_ratios.items()}
    total = sum(logs.values())
    interaction = math.log(stacked_ratio) - total
    if total <= 0:
        return None, interaction
    return {name: value / total for name, value in logs.items()}, interaction


@dataclass(frozen=True)
class Layer:
    axis: str  # weights | kv_cache | speculative
    value: str  # the stacked config's value on that axis: awq-int4, turbo-2.5, draft-k4
    config: str  # the ablation's config name
    ratio: float  # the ablation's own ratio against the baseline
    verdict: str  # the ablation's own verdict on the metric
    lossless: bool  # the ablation keeps the baseline's weights and KV cache
    share: float | None  # of the stacked config's loss; None when no layer loses alone


@dataclass(frozen=True)
class StepBack:
    metric: str
    stacked_ratio: float
    layers: tuple[Layer, ...]  # largest share first
    interaction: float  # log r_stacked − Σ log r_layer

    @classmethod
    def from_ratios(cls, metric: str, stacked_ratio: float, layers: list[Layer]) -> StepBack:
        shares, interaction = layer_shares(stacked_ratio, {layer.axis: layer.ratio for layer in layers})
        placed = [Layer(**{**asdict(layer), "share": shares[layer.axis] if shares else None}) for layer in layers]
        placed.sort(key=lambda layer: -(layer.share if layer.share is not None else math.log(layer.ratio)))
        return cls(metric, stacked_ratio, tuple(placed), interaction)

    @property
    def disable(self) -> Layer | None:
        """The layer to disable: the largest share, when any layer loses alone."""
        return self.layers[0] if self.layers and self.layers[0].share is not None else None

    def advice(self) -> str:
        """One line for the verdict, the alert and the gate summary, e.g. "disable kv_cache int2: 81 %
        of the ppl_ratio loss (ppl_ratio 1.21 alone); weights int8 17 % (1.04 alone); speculative
        draft-k4 2 % (1.00 alone, lossless); interaction ×1.01"."""
        def alone(layer: Layer) -> str:
            return f"{layer.ratio:.4g} alone" + (", lossless" if layer.lossless else "")

        first = self.disable
        if first is None:
            parts = [f"{layer.axis} {layer.value} ({self.metric} {alone(layer)})" for layer in self.layers]
            return (f"no single layer loses {self.metric} on its own ({'; '.join(parts)}): the loss of "
                    f"{self.stacked_ratio:.3g} comes from their interaction; disabling any one layer may remove it")
        head = (f"disable {first.axis} {first.value}: {format_share(first.share)} of the {self.metric} loss "
                f"({self.metric} {alone(first)})")
        rest = [f"{layer.axis} {layer.value} {format_share(layer.share)} ({alone(layer)})" for layer in self.layers[1:]]
        return "; ".join([head, *rest, f"interaction ×{math.exp(self.interaction):.3g}"])

    def as_dict(self) -> dict:
        return {"metric": self.metric, "stacked_ratio": self.stacked_ratio, "interaction": self.interaction,
                "disable": self.disable.axis if self.disable else None, "advice": self.advice(),
                "layers": [asdict(layer) for layer in self.layers]}


def format_share(share: float | None) -> str:
    """A share in whole percent, or to a tenth where whole percent would round a small share to 0 %
    (or a large one to 100 %) that is not."""
    if share is None:
        return "—"
    pct = share * 100
    return f"{pct:.1f} %" if pct != round(pct) and (abs(pct) < 1 or abs(pct - 100) < 1) else f"{pct:.0f} %"
