"""How a run's summary prints: one row per config with its worst finding per metric, the verdict
summary, and --json."""


from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from app.cli.base import VERDICT_COLORS

if TYPE_CHECKING:
    from app.schemas import ComparisonOut, RunConfigOut, RunOut


def metric_cell(comp: ComparisonOut | None) -> str:
    if comp is None or comp.estimate is None:
        return "—" if comp is None else f"[magenta]{comp.verdict}[/]"
    color = VERDICT_COLORS.get(comp.verdict, "white")
    return f"[{color}]{comp.estimate:.2f}[/]"


def worst_comparison(comparisons: list[ComparisonOut]) -> ComparisonOut | None:
    """The config's comparison that decides its standing: the worst verdict among its gated
    comparisons (informational ones never decide), ppl_ratio first among equals."""
    from vocabulary.metrics import METRICS, VERDICT_ORDER, informational

    gated = [c for c in comparisons if c.metric in METRICS and not informational(c) and c.verdict in VERDICT_ORDER]
    return max(gated, key=lambda c: (VERDICT_ORDER[c.verdict], c.metric == "ppl_ratio"), default=None)


def layers_under_their_config(configs: list[RunConfigOut]) -> list[RunConfigOut]:
    """The run's configs in order, each stacked config's ablations (step back) right under it."""
    layers: dict[str, list[RunConfigOut]] = {}
    for config in configs:
        if config.ablation_of:
            layers.setdefault(config.ablation_of, []).append(config)
    ordered = []
    for config in configs:
        if not config.ablation_of:
            ordered += [config, *layers.pop(config.config, [])]
    return ordered + [config for rest in layers.values() for config in rest]  # a layer whose config is not listed


def _print_summary(summary: RunOut, wide: bool = False) -> None:
    """The run's table on stdout. By default five columns that fit an 80-column terminal: config,
    perplexity ratio with its CI, the config's worst verdict (naming the metric when it is not
    the ratio), tok/s and KV bytes per token; --wide adds weights, KV cache, speculative settings,
    TTFT/TBT, weight MB, acceptance, faithfulness, exact match and top-1 agreement."""
    from app.services import samples_label

    out = Console(width=None if Console().is_terminal else (250 if wide else 120))
    comparisons = {(c.config, c.metric): c for c in summary.comparisons}
    table = Table(title=f"run {summary.run_id} — baseline {summary.baseline}, {samples_label(summary)}")
    cols = ["config", "ppl ratio [95% CI]", "verdict", "tok/s", "KV B/token"]
    if wide:
        cols[1:2] = ["weights", "kv cache", "speculative", "token ppl", "ppl ratio", "95% CI"]
        cols += ["TTFT p50 ms", "TBT p50 ms", "weights MB", "accept", "faithful", "exact match", "top-1"]
    for col in cols:
        left = col in ("config", "weights", "kv cache", "speculative", "verdict")
        table.add_column(col, justify="left" if left else "right")
    failures = []
    for config in layers_under_their_config(summary.configs):
        figures = summary.figures_of(config.config)
        ppl = comparisons.get((config.config, "ppl_ratio"))
        is_base = config.config == summary.baseline
        ratio = f"{ppl.estimate:.4f}" if ppl and ppl.estimate is not None else ("baseline" if is_base else "—")
        has_ci = ppl is not None and ppl.ci_low is not None and ppl.ci_high is not None
        ci = f"[{ppl.ci_low:.4f}, {ppl.ci_high:.4f}]" if ppl and has_ci else ""
        worst = worst_comparison([c for c in summary.comparisons if c.config == config.config])
        quiet = is_base or config.status == "succeeded"  # no comparison: a baseline, or nothing to judge
        verdict = worst.verdict if worst else ("" if quiet else config.status)
        color = VERDICT_COLORS.get(verdict, "white")
        because = f" ({worst.metric})" if worst and worst.metric != "ppl_ratio" and verdict != "ok" else ""

        def fmt(key: str, fmt_spec: str, figures: dict = figures) -> str:
            return format(figures[key], fmt_spec) if figures.get(key) is not None else "—"

        # a stacked config's single-optimization ablation (step back): a diagnosis under its config
        row = [f"  └ {config.ablation_axis} alone" if config.ablation_of else config.config]
        if wide:
            speculative = config.spec.get("speculative", {})
            spec_label = ("off" if speculative.get("method", "off") == "off"
                          else f"{speculative['method']} k={speculative.get('k')}")
            row += [config.spec["weights"], figures.get("kv_cache") or config.spec.get("kv_cache", ""),
                    spec_label,
                    fmt("token_ppl", ".3f"), ratio, ci]
        else:
            row.append(f"{ratio} {ci}".strip())
        row += [f"[{color}]{verdict}[/]{escape(because)}", fmt("tokens_per_second", ".0f"),
                fmt("kv_bytes_per_token", "d")]
        if wide:
            acceptance = (figures.get("spec") or {}).get("acceptance_rate")
            row += [fmt("ttft_ms_p50", ".1f"), fmt("tbt_ms_p50", ".2f"),
                    f"{figures['weight_bytes'] / 1e6:.2f}" if figures.get("weight_bytes") else "—",
                    f"{acceptance:.2f}" if acceptance is not None else "",
                    *(metric_cell(comparisons.get((config.config, metric)))
                      for metric in ("faithfulness", "exact_match", "top1_agreement"))]
        table.add_row(*row)
        if config.error:
            failures.append(f"{config.config}: {config.error}")
    out.print(table)
    for line in failures:
        out.print(f"[red]failed[/] {escape(line)}", highlight=False)
    methods = {c.details.get("method") for c in summary.comparisons if c.metric == "faithfulness"} - {None}
    for method in methods:
        out.print(f"faithfulness: {method}", highlight=False)
    klds = [c for c in summary.comparisons if c.metric == "kld_mean" and c.estimate is not None]
    if klds:  # llama-perplexity --kl-divergence's headline figures (evals/distribution.py)
        out.print(f"next-token distributions against the baseline ({max(c.n for c in klds)} documents; mean KLD, "
                  "same top p; ≥ where a server gave only its top-20): "
                  + ", ".join(f"{c.config} {'≥' if c.details.get('kld_bound') == 'lower' else ''}{c.estimate:.2g} "
                              f"{c.details['same_top'] * 100:.1f}%" for c in klds), highlight=False, soft_wrap=True)
    decoded = [c for c in summary.comparisons if c.metric == "decode_nll_ratio" and c.estimate is not None]
    if decoded:  # the KV configs' prefill-vs-decode gap (evals/compare_targets.decode_nll_ratio)
        out.print(f"decode ÷ prefill ppl ratio ({max(c.n for c in decoded)} documents also scored a token per decode "
                  "step through the KV cache): " + ", ".join(f"{c.config} {c.details['prefill_decode_gap']:.4f}"
                                                              for c in decoded), highlight=False, soft_wrap=True)
    if not wide:
        out.print("more columns (TTFT, TBT, weights, acceptance, faithfulness, exact match): --wide; "
                  "every figure: --json",
                  highlight=False, style="dim")
    _print_verdict(out, summary, wide)


def _print_verdict(out: Console, summary: RunOut, wide: bool) -> None:
    """The verdict for people (app/summary.py): a line per breaching config, grouped, worst first;
    the stored reason (every finding with its rule) with --wide, or when there is no line to show."""
    lines = summary.summary.lines
    reason = escape(summary.verdict_reason or "")
    # how many samples decided it, when the run topped itself up (workers/top_up.py)
    drawn = (f" on {summary.samples_drawn} samples (topped up from {summary.n_samples})"
             if summary.samples_drawn > summary.n_samples else "")
    if not lines:
        out.print(f"verdict: [bold]{summary.verdict}[/]{drawn} — {reason}", highlight=False)
        return
    out.print(f"verdict: [bold]{summary.verdict}[/]{drawn}", highlight=False)
    for line in lines:
        out.print(escape(line), highlight=False, soft_wrap=True)
    if wide:
        out.print(f"every finding: {reason}", highlight=False)


def _json_out(summary: RunOut, wall_seconds: float | None = None) -> None:
    """The run as one JSON object: the API's RunOut fields a CI step reads, and the wall time
    `canary run` waited when it did."""
    keep = {"run_id", "status", "verdict", "verdict_reason", "baseline", "comparisons", "figures", "configs",
            "summary", "n_samples", "samples_drawn"}
    out = summary.model_dump(mode="json", include=keep)
    if wall_seconds is not None:
        out["wall_seconds"] = wall_seconds
    sys.stdout.write(json.dumps(out) + "\n")
