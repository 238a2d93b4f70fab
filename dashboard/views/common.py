from __future__ import annotations

# colour carries the threshold state (no emoji: a headless browser's fonts may lack them)
VERDICT_COLORS = {"ok": "#c8e6c9", "warn": "#ffe0b2", "critical": "#ffcdd2", "inconclusive": "#eeeeee",
                  "measurement_error": "#e1bee7"}  # purple: the figure cannot be right (a broken measurement)


def catalogue(api) -> list[dict]:
    """The metric catalogue (GET /metrics: evals/metrics.py's table), in display order."""
    return api.get("/metrics")["metrics"]


def fmt(x, spec: str = ".4g") -> str:
    return "—" if x is None else format(x, spec)


def style_verdicts(df, verdict_cols: dict[str, str]):
    """Colour each displayed column by the verdict in its twin column; the twins are not shown."""
    shown = df.drop(columns=list(set(verdict_cols.values())))

    def colour(frame):
        css = frame.copy().astype(str)
        for c in frame.columns:
            css[c] = [f"background-color: {VERDICT_COLORS.get(v, '')}" if c in verdict_cols and VERDICT_COLORS.get(v) else ""
                      for v in (df[verdict_cols[c]] if c in verdict_cols else [""] * len(frame))]
        return css

    return shown.style.apply(colour, axis=None)


def style_verdict_column(df, column: str = "verdict"):
    return df.style.apply(lambda col: [f"background-color: {VERDICT_COLORS.get(v, '')}" for v in col], subset=[column])
