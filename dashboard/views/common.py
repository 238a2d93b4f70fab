from __future__ import annotations

VERDICT_COLORS = {"ok": "#c8e6c9", "warn": "#ffe0b2", "critical": "#ffcdd2", "inconclusive": "#eeeeee"}
VERDICT_ICON = {"ok": "🟢", "warn": "🟠", "critical": "🔴", "inconclusive": "⚪"}


def fmt(x, spec: str = ".4g") -> str:
    return "—" if x is None else format(x, spec)


def cell(comp: dict | None, spec: str = ".4g") -> str:
    """'1.057 🔴' — the estimate with its threshold state."""
    if not comp:
        return "—"
    return f"{fmt(comp.get('estimate'), spec)} {VERDICT_ICON.get(comp.get('verdict'), '')}".strip()


def style_verdicts(df, verdict_cols: dict[str, str]):
    """Colour each displayed column by the verdict in its hidden twin column."""
    def colour(row):
        return [f"background-color: {VERDICT_COLORS.get(row.get(verdict_cols.get(c)), '')}" if c in verdict_cols else "" for c in row.index]
    return df.style.apply(colour, axis=1).hide(list(set(verdict_cols.values())), axis="columns")
