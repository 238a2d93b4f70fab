"""The Overview's per-model card (docs/service.md, the model card): one tile per headline figure —
domain perplexity, judge score, faithfulness, spec-decode acceptance, TTFT p50/p99, throughput,
KV-cache usage, lossless outputs against the noise floor, generation health — each with its
value, the config it comes from and its threshold state as a colour and a word, plus the model's
last and next check in human time.

A tile's state is the verdict the API computed for the catalogue metric behind it (GET /metrics;
vocabulary/metrics.py is the metric's one home): the dashboard never judges a figure itself. A tile
whose metrics are not in the catalogue is left out; the figures with no comparison on the suite
are named in one small "no data" tile, with no figure."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from datetime import datetime

from dashboard.views.common import (
    VERDICT_COLORS,
    VERDICT_MARKS,
    human_time,
    judged_verdict,
    metric_cell,
    verdict_rank,
)

# (title, the catalogue metrics whose verdicts give the tile its state, first = the headline figure)
TILES = (
    ("domain PPL", ("ppl_ratio",)),
    ("judge score", ("judge_score_delta", "judge_win_rate")),
    ("faithfulness", ("faithfulness",)),
    ("spec-decode acceptance", ("spec_acceptance_rate",)),
    ("TTFT p50 / p99", ("ttft_ms",)),
    ("throughput", ("tpot_ratio",)),
    ("KV-cache usage", ("kv_cache_usage",)),
    # the field signals (docs/scorers.md, "Servers in the field"): a lossless config's departures beyond the
    # baseline's own noise floor, and answers that broke while prompt log-probs stayed exact
    ("lossless outputs", ("confident_divergence", "lossless_exact_match", "batch_divergence")),
    ("generation health", ("empty_answers", "degenerate_answers", "max_tokens_hits", "early_stops",
                           "output_length_ratio")),
    # labelled items (the labelled scorer): accuracy recovered, and answers flipped either way at any accuracy
    ("task accuracy", ("task_recovery", "task_flips")),
    # the distribution signals (docs/concepts.md), reported without thresholds: the next-token distributions against the
    # baseline's (llama-perplexity --kl-divergence), and a lossy KV cache read one token per decode step
    ("next-token KLD", ("kld_mean",)),
    ("KV cache by decode", ("decode_nll_ratio",)),
)
NO_DATA = "no data"
NOT_JUDGED = "not judged"  # reported without a threshold (faithfulness by the offline approximation)
STATE_WORDS = {"measurement_error": "measurement error"}


@dataclass
class Tile:
    title: str
    state: str  # a verdict, or "no data"
    value: str = ""  # the headline figure ("" with no data)
    ci: str = ""  # its 95% CI, in the same unit
    source: str = ""  # the config it comes from: "int2, worst of 3 on ppl ratio"
    lines: list[str] = field(default_factory=list)  # smaller figures under it
    why: str = ""  # a hover text: the rule behind the state or why there is no data


def _badness(metric: dict, estimate: float | None) -> float:
    """Larger is worse, in the metric's direction; no estimate ranks last."""
    if estimate is None:
        return float("-inf")
    return estimate if metric["direction"] == "above" else -estimate


def worst_cell(configs: list[dict], metric: dict) -> tuple[dict, dict, int] | None:
    """(config, its comparison, how many configs have one) for the config doing worst on `metric`:
    the worst verdict, then the estimate furthest on the metric's bad side."""
    have = [(c, c["comparisons"][metric["name"]]) for c in configs if metric["name"] in c["comparisons"]]
    if not have:
        return None
    config, cell = min(have, key=lambda cc: (verdict_rank(judged_verdict(cc[1])), -_badness(metric, cc[1]["estimate"])))
    return config, cell, len(have)


def _split(metric: dict, cell: dict) -> tuple[str, str]:
    """A comparison as (estimate, "[CI]") in its reader's unit (metric_cell's text, cut in two); a
    peak is one reading, with no CI."""
    ci = (cell.get("ci_low"), cell.get("ci_high")) if metric["comparison"] != "peak" else ()
    text = metric_cell(metric["unit"], metric["fmt"], cell["estimate"], *ci)
    value, _, bracketed = text.partition(" [")
    return value, f"[{bracketed}" if bracketed else ""


def _source(config: dict, count: int, metric: dict) -> str:
    """Where a per-model figure comes from: "int2, worst of 3 on ppl ratio" (by the metric that
    gives the tile its state, which for throughput is the paired TPOT ratio, not tokens/s)."""
    name = config["config"] + (" (baseline)" if config["baseline"] else "")
    return name if count == 1 else f"{name}, worst of {count} on {metric['label']}"


def model_tiles(configs: list[dict], metrics: list[dict]) -> list[Tile]:
    """The card's tiles for one model: its configs as the overview view gives them, the catalogue's
    metrics. Each tile shows its first metric's worst config (or a later metric's, when that one's
    verdict is worse) and names it."""
    by_name = {m["name"]: m for m in metrics}
    baseline = next((c for c in configs if c["baseline"]), None)
    tiles = []
    for title, names in TILES:
        known = [by_name[n] for n in names if n in by_name]
        if not known:
            continue  # not in the catalogue: no tile
        found = [(m, w) for m in known if (w := worst_cell(configs, m))]
        if not found:
            tiles.append(Tile(title, NO_DATA, why=f"no {' or '.join(m['label'] for m in known)} comparison on this "
                                                   "suite's latest runs"))
            continue
        metric, (config, cell, count) = min(found, key=lambda mw: verdict_rank(judged_verdict(mw[1][1])))
        value, ci = _split(metric, cell)
        tile = Tile(title, judged_verdict(cell) or NOT_JUDGED, value, ci, _source(config, count, metric),
                    why=cell.get("rule") or "")
        if tile.state == NOT_JUDGED:
            tile.lines.append(cell.get("rule") or "reported, not judged against a threshold")
        figures = config.get("figures") or {}
        if metric["name"] == "ppl_ratio" and cell.get("baseline_value") is not None:
            tile.lines.append(f"baseline{' ' + baseline['config'] if baseline else ''} PPL "
                              f"{cell['baseline_value']:.2f}")
        elif metric["name"] == "ttft_ms":
            tile.value = f"p50 {value}"
            if figures.get("ttft_ms_p99") is not None:
                tile.lines.append(f"p99 {figures['ttft_ms_p99']:.0f} ms (no threshold of its own)")
        elif metric["name"] == "tpot_ratio" and figures.get("tokens_per_second") is not None:
            # throughput: the tokens/s of the config whose decoding slowed most; its state is the TPOT ratio's
            tile.value, tile.ci = f"{figures['tokens_per_second']:.0f} tok/s", ""
            # the baseline in the same run: each config's evidence may come from a run of its own
            base_tps = (config.get("baseline_figures") or {}).get("tokens_per_second")
            if base_tps is not None and not config["baseline"]:
                tile.lines.append(f"baseline {base_tps:.0f} tok/s (same run)")
            tile.lines.append(f"{metric['label']} {value} {ci}".strip())
        recovery = (config.get("comparisons") or {}).get("task_recovery") if title == "task accuracy" else None
        if recovery and recovery.get("baseline_value") is not None and recovery.get("candidate_value") is not None:
            # the headline config's accuracies, whichever of its two metrics heads the tile
            tile.lines.append(f"accuracy {recovery['baseline_value']:.0%} → {recovery['candidate_value']:.0%} "
                              f"({config['config']})")
        for other, (o_config, o_cell, _) in found:
            if other is not metric:
                o_value, o_ci = _split(other, o_cell)
                o_state = judged_verdict(o_cell) or NOT_JUDGED
                tile.lines.append(" ".join(x for x in (other["label"], o_value, o_ci) if x)
                                  + f" ({o_config['config']}, {STATE_WORDS.get(o_state, o_state)})")
        tiles.append(tile)
    return tiles


def check_times(configs: list[dict], next_check_at: str | None, now: datetime | None = None) -> tuple[str, str]:
    """The model's last check (its configs' latest finished run) and the suite's next scheduled
    check, in human time."""
    checked = [c["checked_at"] for c in configs if c.get("checked_at")]
    return (human_time(max(checked) if checked else None, now, never="never"),
            human_time(next_check_at, now, never="not scheduled"))


CSS = """<style>
.canary-card{display:grid;grid-template-columns:repeat(auto-fill,minmax(185px,1fr));gap:8px;margin:4px 0 10px}
.canary-tile{border-radius:6px;padding:8px 10px;border-left:6px solid #9e9e9e;background:#fafafa;line-height:1.3}
.canary-tile .t{font-size:0.8rem;color:#444;font-weight:600}
.canary-tile .v{font-size:1.35rem;font-weight:600;color:#111;white-space:nowrap}
.canary-tile .ci{font-size:0.8rem;color:#333;font-weight:400}
.canary-tile .s{font-size:0.75rem;color:#333}
.canary-tile .w{font-size:0.75rem;font-weight:700;text-transform:uppercase;letter-spacing:.04em}
.canary-tile.nodata{background:#fff;border:1px dashed #bdbdbd;border-left:6px solid #e0e0e0}
.canary-tile.nodata .t,.canary-tile.nodata .s{color:#9e9e9e}
.canary-tile.neutral{background:#fff;border:1px solid #e0e0e0;border-left:6px solid #e0e0e0}
</style>"""


def tile_html(tile: Tile) -> str:
    e = html.escape
    word = STATE_WORDS.get(tile.state, tile.state)
    lines = "".join(f'<div class="s">{e(x)}</div>' for x in tile.lines)
    if tile.state in VERDICT_COLORS:
        mark = VERDICT_MARKS[tile.state]
        look = f'class="canary-tile" style="background:{VERDICT_COLORS[tile.state]};border-left-color:{mark}"'
    else:  # not judged: no verdict colour at all
        mark, look = "#757575", 'class="canary-tile neutral"'
    return (f'<div {look} data-state="{e(tile.state)}" title="{e(tile.why)}">'
            f'<div class="t">{e(tile.title)}</div>'
            f'<div class="v">{e(tile.value)} <span class="ci">{e(tile.ci)}</span></div>'
            f'<div class="s">{e(tile.source)}</div>{lines}'
            f'<div class="w" style="color:{mark}">{e(word)}</div></div>')


def card_html(tiles: list[Tile], last: str, nxt: str) -> str:
    """The measured tiles, then one small tile naming the figures with no data (six dashed empty
    tiles on a perplexity-only suite hide the one that matters), then the checks."""
    e = html.escape
    measured = "".join(tile_html(t) for t in tiles if t.state != NO_DATA)
    missing = [t for t in tiles if t.state == NO_DATA]
    empty = (f'<div class="canary-tile nodata" data-state="no data" title="{e("; ".join(t.why for t in missing))}">'
             f'<div class="t">no data</div><div class="s">{e(", ".join(t.title for t in missing))}</div></div>'
             if missing else "")
    checks = (f'<div class="canary-tile neutral" data-state="checks"><div class="t">checks</div>'
              f'<div class="s">last <b>{e(last)}</b></div><div class="s">next <b>{e(nxt)}</b></div></div>')
    return CSS + '<div class="canary-card">' + measured + empty + checks + "</div>"
