"""What every page shares: the verdict colours, the metric catalogue, and the pure helpers that
turn the API's figures into the text a page shows (each computed by hand in
tests/unit/test_dashboard_format.py)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd
    from pandas.io.formats.style import Styler

    from dashboard.client import Api

# colour carries the threshold state (no emoji: a headless browser's fonts may lack them)
VERDICT_COLORS = {"ok": "#c8e6c9", "warn": "#ffe0b2", "critical": "#ffcdd2", "inconclusive": "#eeeeee",
                  "measurement_error": "#e1bee7"}  # purple: the figure cannot be right (a broken measurement)
# the same states as marks on a chart (darker: a point or a line, not a cell background)
VERDICT_MARKS = {"ok": "#2e7d32", "warn": "#ef6c00", "critical": "#c62828", "inconclusive": "#9e9e9e",
                 "measurement_error": "#7b1fa2"}
# configs on a chart: blues, teals, browns and pinks — none of them reads as a verdict colour
CONFIG_COLORS = ["#1f77b4", "#17becf", "#8c564b", "#e377c2", "#393b79", "#637939", "#5254a3", "#843c39", "#3182bd",
                 "#bcbd22", "#7b4173", "#8c6d31", "#6b6ecf", "#9c9ede", "#31a354", "#756bb1", "#636363", "#e6550d",
                 "#969696", "#0f5257"]  # 20: a config each up to 20 (a palette repeats past that)
# worst first: a broken measurement ranks above warn (it may hide anything), inconclusive above ok
WORST_FIRST = ("critical", "measurement_error", "warn", "inconclusive", "ok")
BREACHING = ("warn", "critical")
SPARK = "▁▂▃▄▅▆▇█"


def catalogue(api: Api) -> list[dict]:
    """The metric catalogue (GET /metrics: vocabulary/metrics.py's table), in display order."""
    return api.get("/metrics")["metrics"]


def fmt(x: float | None, spec: str = ".4g") -> str:
    return "—" if x is None else format(x, spec)


def verdict_rank(verdict: str | None) -> int:
    """0 for critical … 4 for ok; no verdict (never measured, the baseline) ranks last."""
    return WORST_FIRST.index(verdict) if verdict in WORST_FIRST else len(WORST_FIRST)


def judged_verdict(cell: dict) -> str:
    """A comparison's verdict, or "" where it was reported but not judged against a threshold (the
    overview's `judged`, a run's comparison's `gated`: faithfulness by the offline approximation
    is "ok" whatever its figure, which no colour should suggest)."""
    unjudged = cell.get("judged") is False or cell.get("gated") is False
    return "" if unjudged else cell["verdict"]


def worst_verdict(verdicts: Iterable[str | None]) -> str | None:
    ranked = sorted((v for v in verdicts if v), key=verdict_rank)
    return ranked[0] if ranked else None


def worst_first(rows: list[dict]) -> list[dict]:
    """Rows with "verdict" (the row's worst) and "ppl_ratio" (an estimate or None), worst first:
    by verdict, then by the larger perplexity ratio; the baseline ("baseline": True) last."""
    return sorted(rows, key=lambda r: (bool(r.get("baseline")), verdict_rank(r.get("verdict")),
                                       -(r["ppl_ratio"] if r.get("ppl_ratio") is not None else -math.inf)))


def _signed(x: float, digits: int) -> str:
    s = f"{x:+.{digits}f}"
    return "+0" + s[2:] if s.startswith("-0") and float(s) == 0 else s  # no "-0.0"


def pct_change(estimate: float | None, low: float | None = None, high: float | None = None, digits: int = 1) -> str:
    """A ratio as its % change with the CI in the same unit: 1.045 [1.024, 1.066] → "+4.5% [+2.4, +6.6]"."""
    if estimate is None:
        return "—"
    text = f"{_signed((estimate - 1) * 100, digits)}%"
    if low is not None and high is not None:
        text += f" [{_signed((low - 1) * 100, digits)}, {_signed((high - 1) * 100, digits)}]"
    return text


def metric_cell(unit: str, spec: str, estimate: float | None, low: float | None = None,
                high: float | None = None) -> str:
    """One comparison as a cell: ratios as % change, fractions as %, milliseconds and points as
    themselves, each followed by its 95% CI in the same unit."""
    if estimate is None:
        return "—"
    if unit == "ratio":
        return pct_change(estimate, low, high)
    ci = low is not None and high is not None
    if unit == "fraction":
        if low is not None and high is not None:  # ci, spelled out so that the type checker narrows both
            return f"{estimate * 100:.0f}% [{low * 100:.0f}, {high * 100:.0f}]"
        return f"{estimate * 100:.0f}%"
    if unit == "ms":
        return f"{estimate:.0f} ms" + (f" [{low:.0f}, {high:.0f}]" if ci else "")
    return format(estimate, spec) + (f" [{format(low, spec)}, {format(high, spec)}]" if ci else "")


def keep_ci_whole(text: str) -> str:
    """A cell that wraps only between its estimate and its CI: "+5.8% [+4.4, +8.7]" → two lines at
    most in a narrow column, never "[+4.4," over "+8.7]" (no-break spaces inside the CI and units)."""
    return text.replace(", ", ",\u00a0").replace(" ms", "\u00a0ms")


COLOUR_KEY = ("Colour is the threshold state: green ok, orange warn, red critical, grey inconclusive (the CI "
              "straddles a threshold, or too few samples), purple measurement error (a figure that cannot be right); "
              "no colour: reported without a threshold (e.g. faithfulness by the offline approximation). Each figure "
              "is the estimate and its 95% CI.")


def drop_empty_columns(df: pd.DataFrame, empty: tuple[str | None, ...] = ("", "—", None)) -> pd.DataFrame:
    """A table without the columns that are empty in every row (an "escalation run" column of blanks
    tells a reader nothing)."""
    return df[[c for c in df.columns if not df[c].isin(empty).all()]] if len(df) else df


def parse_time(t: str | None) -> datetime | None:
    """The API's ISO times; a time without an offset is UTC (as stored)."""
    if not t:
        return None
    d = datetime.fromisoformat(t)
    return d if d.tzinfo else d.replace(tzinfo=timezone.utc)


def samples_label(run: dict, noun: str = "samples") -> str:
    """'12 samples', or '24 samples (topped up from 12)' for a run that drew more after an
    inconclusive pass (the API's n_samples and samples_drawn)."""
    asked = run["n_samples"]
    drawn = run.get("samples_drawn", asked)
    return f"{drawn} {noun}" + (f" (topped up from {asked})" if drawn != asked else "")


def human_time(t: str | None, now: datetime | None = None, never: str = "never") -> str:
    """'just now', '5 minutes ago', '2 hours ago', '3 days ago', 'in 4 hours' (whole units, rounded down)."""
    when = parse_time(t)
    if when is None:
        return never
    seconds = ((now or datetime.now(timezone.utc)) - when).total_seconds()
    past, s = seconds >= 0, abs(seconds)
    if s < 60:
        return "just now" if past else "in under a minute"
    for size, unit in ((86400, "day"), (3600, "hour"), (60, "minute")):
        if s >= size:
            n = int(s // size)
            text = f"{n} {unit}{'s' if n != 1 else ''}"
            return f"{text} ago" if past else f"in {text}"
    raise AssertionError("unreachable")


def clock_time(t: str | None) -> str:
    """A stored time as a reader's clock time, "25 Nov 06:37 UTC": for labels that must not change
    while the page is open (a selector's option that said "7 minutes ago" says "8 minutes ago" a
    minute later and no longer matches the option picked)."""
    when = parse_time(t)
    return "—" if when is None else f"{when.day} {when:%b %H:%M} UTC"


def sparkline(values: list[float | None]) -> str:
    """A text trend, oldest first: each value as one of ▁…█ between the series' min and max (a
    flat series is a flat middle line; a missing value is a gap)."""
    known = [v for v in values if v is not None]
    if not known:
        return ""
    low, high = min(known), max(known)
    if high - low < 1e-12:
        return "".join(SPARK[3] if v is not None else " " for v in values)
    steps = len(SPARK) - 1  # half a step rounds up
    return "".join(" " if v is None else SPARK[math.floor((v - low) / (high - low) * steps + 0.5)] for v in values)


def doc_ppl_ratio(candidate_nll: float | None, baseline_nll: float | None, tokens: int | None) -> float | None:
    """One document's perplexity ratio from the two NLL sums over its same tokens:
    exp((NLL_c − NLL_b) / tokens)."""
    if candidate_nll is None or baseline_nll is None or not tokens:
        return None
    return math.exp((candidate_nll - baseline_nll) / tokens)


def style_verdicts(df: pd.DataFrame, verdict_cols: dict[str, str]) -> Styler:
    """Colour each displayed column by the verdict in its twin column; the twins are not shown."""
    shown = df.drop(columns=list(set(verdict_cols.values())))

    def colour(frame: pd.DataFrame) -> pd.DataFrame:
        css = frame.copy().astype(str)
        for c in frame.columns:
            twins = df[verdict_cols[c]] if c in verdict_cols else [""] * len(frame)
            css[c] = [f"background-color: {VERDICT_COLORS[v]}" if v in VERDICT_COLORS else "" for v in twins]
        return css

    return shown.style.apply(colour, axis=None)


def style_verdict_column(df: pd.DataFrame, column: str = "verdict") -> Styler:
    return df.style.apply(lambda col: [f"background-color: {VERDICT_COLORS.get(v, '')}" for v in col], subset=[column])


def y_domain(values: Iterable[float | None], rel_pad: float = 0.1, min_span: float = 0.01) -> list[float]:
    """A chart's y range that shows every value with a margin; a single value (or a flat series)
    gets a span of ±min_span × |value| around it (at least min_span), not an axis of ".309"s."""
    known = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not known:
        return [0.0, 1.0]
    low, high = min(known), max(known)
    span = high - low
    if span < 1e-12:
        half = max(abs(low) * min_span, min_span)
        return [low - half, high + half]
    return [low - span * rel_pad, high + span * rel_pad]


def spans_decades(values: Iterable[float | None], factor: float = 3.0) -> bool:
    """Positive values whose largest is at least `factor` times the smallest: a linear axis would
    squash all but the largest onto one line (a collapsed config at 7× beside ratios near 1)."""
    known = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return bool(known) and min(known) > 0 and max(known) / min(known) >= factor


def log_domain(values: Iterable[float | None], pad: float = 1.15) -> list[float]:
    """A log axis' range around positive values: a factor `pad` beyond each end."""
    known = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)) and v > 0]
    return [min(known) / pad, max(known) * pad]


def label_offsets(xs: list[float], ys: list[float], labels: list[str], x_range: list[float] | None = None,
                  y_range: list[float] | None = None, width: float = 700, height: float = 380, char_px: float = 7,
                  line_px: float = 15) -> list[float]:
    """A vertical offset (px) per point label so that no two labels overlap: each label, top to
    bottom, takes the first of above / below / further above / further below that is clear of
    the labels already placed (boxes estimated from the text's length on axes of the given ranges,
    by default the points' own span, at the chart's size)."""
    def px(values: list[float], size: float, span: list[float] | None) -> list[float]:
        low, high = span or (min(values), max(values))
        return [size / 2 if high - low < 1e-12 else (v - low) / (high - low) * size for v in values]

    x_px, y_px = px(xs, width, x_range), px(ys, height, y_range)
    placed: list[tuple[float, float, float]] = []  # (centre x, centre y, half width), y grows downwards
    offsets = [0.0] * len(xs)
    for i in sorted(range(len(xs)), key=lambda k: -y_px[k]):
        half = len(labels[i]) * char_px / 2
        for dy in (-14, 16, -30, 32, -46, 48):
            cx, cy = x_px[i], height - y_px[i] + dy
            if all(abs(cx - px_) >= half + h or abs(cy - py_) >= line_px for px_, py_, h in placed):
                break
        placed.append((cx, cy, half))
        offsets[i] = dy
    return offsets
