"""A run's report to share: one self-contained HTML file (no script, no stylesheet or font from
elsewhere, no request when opened) for a reviewer outside the dashboard. `canary report RUN`
writes it, GET /api/v1/projects/{project}/runs/{run_id}/report serves it, and `canary gate
--report-html` saves it beside the gate's markdown summary as a CI artifact.

It holds: the verdict for people (app/summary.py), the thresholds that judged the run, every
comparison with its 95% CI, the quality lost against the speed gained as an inline SVG, each
candidate's worst documents, the field signals where the run measured them (the baseline's noise
floor, generation health), and the environment (model, seed, samples, engines, devices, library
versions; app/report_context.py). `build(..., form="md")` gives it as Markdown for a pull request.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

from sqlalchemy.orm import Session

from app import repo
from app.models import Project, Run, Suite
from app.report_context import ReportContext, bound, gather, markdown, when
from app.schemas import ComparisonOut, RunOut
from vocabulary.comparison import bucket_interval
from vocabulary.metrics import METRICS, VERDICT_ORDER, format_estimate

COLOURS = {"ok": "#2e7d32", "inconclusive": "#757575", "warn": "#ef6c00", "critical": "#c62828",
           "measurement_error": "#6a1b9a", "baseline": "#000000"}
WORST_SAMPLES = 3  # documents per candidate
FIELD_SIGNALS = ("confident_divergence", "batch_divergence", "empty_answers", "degenerate_answers", "max_tokens_hits",
                 "early_stops", "output_length_ratio")
STYLE = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2rem auto;max-width:1100px;color:#212121}
h1{font-size:1.5rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85rem;width:100%}td,th{border-bottom:1px solid #eee;padding:.25rem .5rem;
text-align:left;vertical-align:top}th{background:#fafafa}.v{font-weight:600}.dim{color:#757575}
.ok{color:#2e7d32}.inconclusive{color:#757575}.warn{color:#ef6c00}.critical{color:#c62828}
.measurement_error{color:#6a1b9a}pre{white-space:pre-wrap;font-size:.85rem;background:#fafafa;padding:.75rem}
.banner{padding:.75rem 1rem;border-radius:4px;background:#f5f5f5}.banner.fail{background:#ffebee}
.banner.warn{background:#fff3e0}.banner.pass{background:#e8f5e9}
"""


def _cell(value: Any) -> str:
    return escape("—" if value is None else str(value))


def _change(c: ComparisonOut) -> str:
    metric = METRICS.get(c.metric)
    if metric is None:
        return _cell(c.estimate)
    return escape(format_estimate(metric, c.estimate, c.ci_low, c.ci_high))


def _comparisons(summary: RunOut) -> str:
    rows: list[ComparisonOut] = sorted(summary.comparisons, key=lambda c: (
        c.config == summary.baseline, not c.gated, -VERDICT_ORDER.get(c.verdict, 0), c.config, c.metric))
    out = ["<table><tr><th>config</th><th>metric</th><th>change vs baseline [95% CI]</th><th>n</th><th>verdict</th>"
           "<th>rule</th></tr>"]
    for c in rows:
        note = " <span class='dim'>(informational)</span>" if not c.gated else ""
        label = METRICS[c.metric].label if c.metric in METRICS else c.metric
        out.append(f"<tr><td>{escape(c.config)}</td><td>{escape(label)}</td><td>{_change(c)}</td>"
                   f"<td>{c.n}</td><td class='v {escape(c.verdict)}'>{escape(c.verdict)}{note}</td>"
                   f"<td class='dim'>{_cell(c.rule)}</td></tr>")
    return "".join(out) + "</table>"


def _symlog(v: float) -> float:
    return math.copysign(math.log1p(abs(v)), v)


def round_ticks(lo: float, hi: float, most: int = 6) -> list[float]:
    """Ticks at round values (1, 2, 2.5 or 5 × 10^k apart) from lo to hi, at most `most` of them."""
    if hi - lo < 1e-12:
        return [lo]
    raw = (hi - lo) / max(1, most - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9)
    return [round(k * step, 10) for k in range(first, math.floor(hi / step + 1e-9) + 1)]


def _symlog_ticks(lo: float, hi: float) -> list[float]:
    """Ticks of a symmetric log axis (in %): 0 and ±1, ±10, ±100 … that lie from lo to hi."""
    ticks = [0.0] if lo <= 0 <= hi else []
    for k in range(0, 7):
        ticks += [v for v in (10.0**k, -(10.0**k)) if lo <= v <= hi]
    return sorted(ticks)


def trade_off_svg(points: list[dict[str, Any]], width: int = 760, height: int = 380,
                  lines: list[tuple[str, float]] | None = None) -> str:
    """Quality lost (ppl ratio as % change, up is worse) against speed gained (× the baseline's), one
    point per config with its CIs, coloured by the perplexity verdict; a symmetric log y axis when
    one config's loss dwarfs the rest (as the dashboard's Compare plot). lines: (label, loss in %)
    drawn across the plot, dashed: the perplexity ratio's warn and critical thresholds; one beyond the
    points' axis is named at that edge (the axis stays the points'). Ticks sit at round values."""
    pts = [p for p in points if p.get("speed") is not None]
    if len(pts) < 2:
        return "<p class='dim'>No speed figures to plot against quality.</p>"
    lines = lines or []
    # the axis is the points' (a threshold far from them must not squash them): a threshold outside
    # it is named at the edge it lies beyond
    ys = [v for p in pts for v in (p["loss"], p["loss_low"], p["loss_high"]) if v is not None]
    mags = sorted(abs(v) for v in ys)
    symlog = mags[-1] >= 10 * max(mags[len(mags) // 2], 1.0)
    ty = _symlog if symlog else (lambda v: v)
    xs = [v for p in pts for v in (p["speed"], p["speed_low"], p["speed_high"]) if v is not None]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(map(ty, ys)), max(map(ty, ys))
    x0, x1 = (x0 - 0.05, x1 + 0.05) if x1 - x0 < 1e-9 else (x0 - (x1 - x0) * 0.08, x1 + (x1 - x0) * 0.08)
    y0, y1 = (y0 - 1, y1 + 1) if y1 - y0 < 1e-9 else (y0 - (y1 - y0) * 0.08, y1 + (y1 - y0) * 0.08)
    left, right, top, bottom = 70, 20, 20, 50

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def py(y: float) -> float:
        return top + (1 - (ty(y) - y0) / (y1 - y0)) * (height - top - bottom)

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img' "
           "aria-label='quality lost against speed gained' font-size='11' font-family='sans-serif'>",
           f"<rect x='{left}' y='{top}' width='{width - left - right}' height='{height - top - bottom}' "
           "fill='none' stroke='#bbb'/>"]
    def inverse(yv: float) -> float:  # the drawn axis back to % loss
        return math.copysign(math.expm1(abs(yv)), yv) if symlog else yv

    for value in (_symlog_ticks if symlog else round_ticks)(inverse(y0), inverse(y1)):
        out.append(f"<line x1='{left - 3}' x2='{left}' y1='{py(value):.1f}' y2='{py(value):.1f}' stroke='#888'/>")
        label = f"{value:+g}" if value else "0"
        out.append(f"<text x='{left - 6}' y='{py(value) + 4:.1f}' text-anchor='end'>{label}%</text>")
    for xv in round_ticks(x0, x1):
        out.append(f"<line x1='{px(xv):.1f}' x2='{px(xv):.1f}' y1='{height - bottom}' y2='{height - bottom + 3}' "
                   "stroke='#888'/>")
        out.append(f"<text x='{px(xv):.1f}' y='{height - bottom + 16}' text-anchor='middle'>{xv:g}×</text>")
    beyond = {"above": 0, "below": 0}
    for label, value in lines:
        colour = COLOURS.get(label.split()[0], "#888")
        if y0 <= ty(value) <= y1:
            out.append(f"<line x1='{left}' x2='{width - right}' y1='{py(value):.1f}' y2='{py(value):.1f}' "
                       f"stroke='{colour}' stroke-dasharray='6 4'/>")
            out.append(f"<text x='{width - right - 4}' y='{py(value) - 4:.1f}' text-anchor='end' fill='{colour}'>"
                       f"{escape(label)}</text>")
            continue
        side = "above" if ty(value) > y1 else "below"
        at = top + 12 + 13 * beyond[side] if side == "above" else height - bottom - 6 - 13 * beyond[side]
        beyond[side] += 1
        out.append(f"<text x='{width - right - 4}' y='{at:.1f}' text-anchor='end' fill='{colour}'>"
                   f"{escape(label)} {'↑' if side == 'above' else '↓'} (off the axis)</text>")
    scale = ", symmetric log scale" if symlog else ""
    out.append(f"<text x='{left + (width - left - right) / 2}' y='{height - 8}' text-anchor='middle'>"
               "speed gain × (1 / paired TPOT ratio; right is the win)</text>")
    out.append(f"<text transform='rotate(-90)' x='{-(top + (height - top - bottom) / 2)}' y='14' "
               f"text-anchor='middle'>quality loss: ppl ratio as % change{scale} (up is worse)</text>")
    placed: list[tuple[float, float, float, float]] = []
    for p in pts:
        colour = COLOURS.get(p["verdict"], "#1f77b4")
        x, y = px(p["speed"]), py(p["loss"])
        if p["loss_low"] is not None and p["loss_high"] is not None:
            out.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{py(p['loss_low']):.1f}' y2='{py(p['loss_high']):.1f}' "
                       f"stroke='{colour}' stroke-width='2'/>")
        if p["speed_low"] is not None and p["speed_high"] is not None:
            dash = "" if p["speed_sure"] else " stroke-dasharray='4 3'"
            out.append(f"<line x1='{px(p['speed_low']):.1f}' x2='{px(p['speed_high']):.1f}' y1='{y:.1f}' "
                       f"y2='{y:.1f}' stroke='{colour}' stroke-width='2'{dash}/>")
        out.append(f"<circle cx='{x:.1f}' cy='{y:.1f}' r='5' fill='{colour}'><title>{escape(p['config'])}: "
                   f"{p['loss']:+.2f}% at {p['speed']:.2f}×</title></circle>")
        dy = _label_dy(placed, x + 7, y, len(p["config"]))
        out.append(f"<text x='{x + 7:.1f}' y='{y + dy:.1f}'>{escape(p['config'])}</text>")
    return "".join(out) + "</svg>"


def threshold_lines(ctx: ReportContext | None) -> list[tuple[str, float]]:
    """The perplexity ratio's warn and critical thresholds as % loss lines ("warn 1.01"), each rule's
    when the candidates have more than one (its configs named)."""
    rules = [t for t in (ctx.thresholds if ctx else []) if t.metric == "ppl_ratio"]
    out = []
    for t in rules:
        whose = f" ({', '.join(t.configs)})" if len(rules) > 1 else ""
        out += [(f"{level} {limit:g}{whose}", (limit - 1) * 100) for level, limit in
                (("warn", t.warn), ("critical", t.critical)) if limit is not None]
    return out


def _label_dy(placed: list[tuple[float, float, float, float]], x: float, y: float, chars: int) -> float:
    """The first vertical offset of a point's label (above, below, further out) whose box clears the
    labels already placed; the box is kept in `placed`."""
    width, height = 6.5 * chars, 12.0
    for dy in (-6.0, 14.0, -20.0, 28.0, -34.0, 42.0):
        box = (x, y + dy - height, x + width, y + dy)
        if all(box[2] <= b[0] or b[2] <= box[0] or box[3] <= b[1] or b[3] <= box[1] for b in placed):
            break
    placed.append(box)
    return dy


def _worst(worst: dict[str, list[dict[str, Any]]]) -> str:
    if not any(worst.values()):
        return "<p class='dim'>No per-document results were kept for this run.</p>"
    out = ["<table><tr><th>config</th><th>document</th><th>NLL candidate − baseline (nats)</th>"
           "<th>its text (start)</th></tr>"]
    for config, items in worst.items():
        for item in items:
            text = item.get("text") or ""
            out.append(f"<tr><td>{escape(config)}</td><td>{escape(item['sample_key'])}</td>"
                       f"<td>{item['delta']:+.3f}</td><td>{escape(text[:160]) or '—'}</td></tr>")
    return "".join(out) + "</table>"


def _signals(summary: RunOut) -> str:
    """The field signals the run measured: the noise floor of lossless configs, and generation health
    (an example answer where a finding has one)."""
    rows: list[ComparisonOut] = [c for c in summary.comparisons if c.metric in FIELD_SIGNALS]
    if not rows:
        return "<p class='dim'>Not measured in this run (no generation scorer, or no lossless config).</p>"
    out = ["<table><tr><th>config</th><th>signal</th><th>change [95% CI]</th><th>verdict</th>"
           "<th>what it saw</th></tr>"]
    for c in rows:
        d = c.details
        seen = []
        if "baseline_self_agreement" in d and d["baseline_self_agreement"] is not None:
            seen.append(f"baseline self-agreement {d['baseline_self_agreement']:.2f} ({d.get('noise_floor', '')})")
        for key, what in (("confident", "confident departures"), ("near_tie", "near-tie departures")):
            if isinstance(d.get(key), dict):
                seen.append(f"{what}: " + ", ".join(f"{side.replace('_', ' ')} {n}" for side, n in d[key].items()))
        if "example" in d:
            seen.append(f"e.g. {d['example'].get('sample_key')}: {d['example'].get('text', '')[:80]!r}")
        out.append(f"<tr><td>{escape(c.config)}</td><td>{escape(METRICS[c.metric].label)}</td>"
                   f"<td>{_change(c)}</td><td class='v {escape(c.verdict)}'>{escape(c.verdict)}</td>"
                   f"<td>{escape('; '.join(seen)) or '—'}</td></tr>")
    return "".join(out) + "</table>"


# the ratios kept by position bucket, and how their tokens were scored: the documents by prefill or a token
# per decode step, the generated answers (buckets of token index in the answer)
SCORED_BY = {"ppl_ratio": "prefill", "decode_nll_ratio": "decode", "gen_nll_ratio": "answer"}


def _positions(summary: RunOut) -> str:
    """Each candidate's perplexity ratio per position bucket of its windows, by prefill and (for the
    documents a lossy-KV config also scored a token per decode step) by decode, then its generated
    answers' by token index in the answer, then each lossy-KV config's prefill-vs-decode gap."""
    rows, gaps = [], []
    configs = list(dict.fromkeys(c.config for c in summary.comparisons))
    passes = list(SCORED_BY)  # each config's prefill rows, then decode, then its answers
    for c in sorted(summary.comparisons, key=lambda c: (configs.index(c.config), passes.index(c.metric)
                                                        if c.metric in passes else len(passes))):
        scored = SCORED_BY.get(c.metric)
        if scored is None or c.config == summary.baseline:
            continue
        for b in c.details.get("by_position") or []:
            change = format_estimate(METRICS[c.metric], *bucket_interval(b))
            rows.append(f"<tr><td>{escape(c.config)}</td><td>{scored}</td><td>{escape(b['positions'])}</td>"
                        f"<td>{escape(change)}</td><td>{b['tokens']}</td>"
                        f"<td class='v {escape(b['verdict'])}'>{escape(b['verdict'])}</td></tr>")
        if c.metric == "decode_nll_ratio" and c.estimate is not None:
            gaps.append(f"{escape(c.config)} {c.details['prefill_decode_gap']:.4f}")
    if not rows and not gaps:
        return "<p class='dim'>No position buckets were kept for this run.</p>"
    out = ["<table><tr><th>config</th><th>scored by</th><th>positions</th><th>change [95% CI]</th><th>tokens</th>"
           "<th>verdict</th></tr>", *rows, "</table>"] if rows else []
    if gaps:
        out.append(f"<p>Decode ÷ prefill on the documents scored both ways: {', '.join(gaps)}.</p>")
    return "".join(out)


def _distributions(summary: RunOut) -> str:
    """Each candidate's next-token distributions against the baseline's, as llama-perplexity
    --kl-divergence prints them (kld_mean's details), where the suite measured them."""
    found = [c for c in summary.comparisons if c.metric == "kld_mean" and c.estimate is not None
             and "same_top" in c.details]
    if not found:
        return ("<p class='dim'>Not measured in this run (the suite's perplexity.distribution_samples is 0, "
                "or the baseline stored no next-token top-k: its config-run's notes say why).</p>")
    out = ["<table><tr><th>config</th><th>tokens</th><th>mean KLD [95% CI]</th><th>KLD p99</th><th>Δp RMS</th>"
           "<th>same top p [95% CI]</th><th>KLD by position</th><th>top-20 bounds (self-check)</th></tr>"]
    for c in found:
        d, bounds = c.details, c.details.get("topk_bounds") or {}
        low, high = d["same_top_ci"]
        at_least = "≥ " if d.get("kld_bound") == "lower" else ""  # a server's top-20 on both sides
        by_position = " · ".join(f"{b['positions']} {b['estimate']:.4g}" for b in d.get("by_position") or []) or "—"
        held = (f"{bounds['bracketed'] * 100:.0f}% bracketed, width {bounds['width_mean']:.3g}"
                if bounds and bounds.get("width_mean") is not None
                else "lower bound: both sides' top-20" if at_least else "—")
        out.append(f"<tr><td>{escape(c.config)}</td><td>{d['tokens']}</td>"
                   f"<td>{at_least}{c.estimate:.5f} [{c.ci_low:.5f}, {c.ci_high:.5f}]</td>"
                   f"<td>{d['kld_percentiles']['p99']:.4f}</td><td>{d['dp_rms'] * 100:.2f}%</td>"
                   f"<td>{d['same_top'] * 100:.1f}% [{low * 100:.1f}, {high * 100:.1f}]</td>"
                   f"<td>{escape(by_position)}</td><td>{held}</td></tr>")
    return "".join(out) + "</table>"


def _tasks(summary: RunOut) -> str:
    """Each candidate's accuracy on the suite's labelled items against the baseline's: recovery,
    the flips each way and McNemar's p (task_recovery's details), where the suite has items."""
    found = {c.config: c for c in summary.comparisons if c.metric == "task_recovery" and "items" in c.details}
    flips = {c.config: c for c in summary.comparisons if c.metric == "task_flips"}
    if not found:
        return "<p class='dim'>Not measured in this run (no labelled scorer in the suite).</p>"
    out = ["<table><tr><th>config</th><th>items</th><th>accuracy, baseline → candidate [95% CI]</th>"
           "<th>recovery [95% CI]</th><th>right→wrong</th><th>wrong→right</th><th>flips [95% CI]</th>"
           "<th>McNemar p</th></tr>"]
    for config, c in found.items():
        d, f = c.details, flips.get(config)
        low, high = d["candidate_ci"]
        recovery = "—" if c.estimate is None or c.ci_low is None or c.ci_high is None else \
            f"{c.estimate:.3f} [{c.ci_low:.3f}, {c.ci_high:.3f}]"
        flipped = "—" if f is None or f.estimate is None or f.ci_low is None or f.ci_high is None else \
            f"{f.estimate * 100:.1f}% [{f.ci_low * 100:.1f}, {f.ci_high * 100:.1f}] ({escape(f.verdict)})"
        out.append(f"<tr><td>{escape(config)}</td><td>{d['items']}</td>"
                   f"<td>{d['baseline_accuracy'] * 100:.1f}% → {d['candidate_accuracy'] * 100:.1f}% "
                   f"[{low * 100:.1f}, {high * 100:.1f}]</td>"
                   f"<td class='v {escape(c.verdict)}'>{recovery} ({escape(c.verdict)})</td>"
                   f"<td>{d['right_to_wrong']}</td><td>{d['wrong_to_right']}</td><td>{flipped}</td>"
                   f"<td>{d['mcnemar_p']:.3g}</td></tr>")
    return "".join(out) + "</table>"


def _thresholds(ctx: ReportContext) -> str:
    out = ["<table><tr><th>metric</th><th>breaches when</th><th>warn</th><th>critical</th><th>min n</th><th>from</th>"
           "<th>judged</th></tr>"]
    for t in ctx.thresholds:
        out.append(f"<tr><td>{escape(t.label)}</td><td>{escape(t.direction)}</td><td>{bound(t.warn)}</td>"
                   f"<td>{bound(t.critical)}</td><td>{t.min_n}</td><td>{escape(t.source)}</td>"
                   f"<td>{escape(', '.join(t.configs))}</td></tr>")
    return "".join(out) + "</table>"


def _environment(ctx: ReportContext) -> str:
    out = ["<table>", *(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in ctx.environment)]
    if ctx.versions:
        out.append("<tr><th>libraries</th><td>" + escape(", ".join(f"{k} {v}" for k, v in ctx.versions.items()))
                   + "</td></tr>")
    out.append("</table><table><tr><th>config</th><th>engine</th><th>device</th><th>dtype</th><th>weights</th>"
               "<th>KV cache</th><th>speculative</th></tr>")
    for c in ctx.configs:
        out.append("<tr>" + "".join(f"<td>{_cell(c[k])}</td>" for k in (
            "config", "engine", "device", "dtype", "weights", "kv cache", "speculative")) + "</tr>")
    return "".join(out) + "</table>"


def render(summary: RunOut, project: str, suite: str, worst: dict[str, list[dict[str, Any]]],
           ctx: ReportContext | None = None) -> str:
    """The report's HTML from a run summary (app/services.run_summary), each candidate's worst
    documents and the run's thresholds and environment (app/report_context.py)."""
    from app.services import samples_label

    verdict = summary.verdict or summary.status
    lines = summary.summary.lines or [summary.verdict_reason or "every comparison is ok"]
    return "".join([
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>inference-canary run {summary.run_id}: {escape(verdict)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>inference-canary · project {escape(project)} · run {summary.run_id}</h1>",
        f"<p>Suite <b>{escape(suite)}</b> ({escape(samples_label(summary))}), baseline "
        f"<b>{escape(summary.baseline or '—')}</b>, started {escape(when(summary.created_at))}, finished "
        f"{escape(when(summary.finished_at))}.</p>",
        f"<div class='banner {escape(verdict)}'><p class='v'>verdict: {escape(verdict)}</p>",
        f"<pre>{escape(chr(10).join(lines))}</pre></div>",
        "<h2>Quality lost against speed gained</h2>", trade_off_svg([p.model_dump() for p in summary.trade_off],
                                                                 lines=threshold_lines(ctx)),
        "<p class='dim'>Colour: the perplexity ratio's verdict. Vertical bars: its 95% CI; horizontal bars: the speed "
        "gain's, dashed where that comparison is inconclusive.</p>",
        *(["<h2>Thresholds (the rules as they stand now; each comparison's rule is in its row)</h2>",
           _thresholds(ctx)] if ctx else []),
        "<h2>Every comparison</h2>", _comparisons(summary),
        "<h2>Field signals</h2>", _signals(summary),
        "<h2>Quality by position in the context and in the answer</h2>", _positions(summary),
        "<h2>Next-token distributions against the baseline</h2>", _distributions(summary),
        "<h2>Task accuracy on labelled items</h2>", _tasks(summary),
        f"<h2>Worst documents per candidate (top {WORST_SAMPLES} by NLL)</h2>", _worst(worst),
        *(["<h2>Environment</h2>", _environment(ctx)] if ctx else []),
        f"<h2>The stored reason</h2><pre>{escape(summary.verdict_reason or '—')}</pre>",
        "</body></html>\n"])


def build(session: Session, project: Project, run: Run, form: str = "html") -> str:
    """The report of one run, read from the database: HTML, or Markdown (`form` "md") for a pull
    request (the decision, thresholds, gated comparisons and environment; no worst documents)."""
    from app.queries import worst_samples
    from app.services import run_summary

    summary = run_summary(session, run)
    ctx = gather(session, run, summary)
    suite = session.get(Suite, run.suite_id)
    suite_name = suite.name if suite is not None else str(run.suite_id)
    if form == "md":
        return markdown(summary, project.name, suite_name, ctx)
    candidates = [c.config for c in summary.configs if c.config != summary.baseline
                  and c.status == "succeeded" and not c.ablation_of]
    worst = {name: worst_samples(session, run, repo.get_config(session, project, name).id, "nll", WORST_SAMPLES)
             for name in candidates}
    keys = {item["sample_key"] for items in worst.values() for item in items}
    texts = {s.key: s.text for s in repo.suite_samples(session, run.suite_id, run.suite_version, keys)}
    for items in worst.values():
        for item in items:
            item["text"] = texts.get(item["sample_key"])
    return render(summary, project.name, suite_name, worst, ctx)
