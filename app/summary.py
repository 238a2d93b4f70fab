"""The verdict summary for people: which configs to drop, which to watch, which only cost speed,
one line each, worst first. The run's stored reason lists every breaching comparison with its rule
(`verdict_reason`, kept for --json, --wide and the run page); this is what a person reads first:
the CLI after its table, the dashboard's banners, the gate's pull-request comment.

Groups, in this order; every candidate is in exactly one:
    drop or fix                a quality metric is critical (or its figure cannot be right)
    watch                      a quality metric is warn
    slower than the baseline   only a speed metric (vocabulary/metrics.py `aspect`) breaches
    undecided                  nothing breaches, but a gated comparison is inconclusive
    ship                       every gated comparison is ok
A config's line names its worst quality finding and its worst speed finding (metric, change vs
the baseline with its 95% CI, verdict) and the step-back advice of a stacked config; an
undecided one says at how many samples it stands and how many would decide it. Within a group,
the config whose worst finding lies furthest past its threshold comes first (`severity`), then
the one with more critical findings. The breaching groups take at most `max_lines` lines (group
headings included), the last saying how many configs are left out; the undecided configs are
never cut, and are followed by the command that decides them (`decide_with`, the run's own
command with more samples); the ship group is one line naming every config in it.

A speed finding says which engine on which device it measured (`figures`): a TPOT ratio of the
reference engine on a CPU is not a forecast of vLLM on a GPU.

Every surface renders these lines as they are: the CLI, the dashboard's banners, the gate's
stdout and pull-request comment, the HTML report and the chat message of an alert
(tests/unit/test_decision_surfaces.py holds them to one text).

The run summary's comparisons (ComparisonOut) and step-back findings (StepBackOut) in, the
summary's models out (app/schemas.py: VerdictSummaryOut, TradeOffPointOut); no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from app.schemas import (
    ComparisonOut,
    RunConfigOut,
    StepBackOut,
    SummaryLineOut,
    TradeOffPointOut,
    VerdictSummaryOut,
)
from vocabulary.metrics import METRICS, VERDICT_ORDER, counted_by, format_estimate, informational, rule_samples
from vocabulary.suite import GenerationSettings, LabelledSettings

# `canary gate`'s exit codes by its defaults (--warn-exit-code 0, --error-exit-code 2): what the
# gate's pull-request comment says happens; the CLI says it again with its own flags
GATE_EXIT = {"pass": 0, "warn": 0, "fail": 1, "error": 2}
GROUPS = ("drop or fix", "watch", "slower than the baseline", "undecided", "ship")
BREACHING = GROUPS[:3]  # what the line cap applies to
MAX_LINES = 12


def deploy_decision(verdict: str | None, code: int | None = None) -> str:
    """What a gate's verdict does to the deploy: 'deploy blocked: fail (exit 1)'. `code`: the exit
    code the gate's caller chose for it (default GATE_EXIT's)."""
    if verdict is None:
        return "no verdict yet"
    code = GATE_EXIT.get(verdict, 2) if code is None else code
    return f"deploy {'allowed' if code == 0 else 'blocked'}: {verdict} (exit {code})"


def decision_line(verdict: str | None, code: int | None = None) -> str:
    """The gate comment's decision line (app/gates.py writes it with GATE_EXIT's codes; `canary
    gate` rewrites it with the codes it was called with)."""
    return f"**Decision:** {deploy_decision(verdict, code)}"


def judged(comparisons: Iterable[ComparisonOut]) -> list[ComparisonOut]:
    """The comparisons that have a say in a verdict: a metric of the table, a known verdict, not informational."""
    return [c for c in comparisons if c.metric in METRICS and c.verdict in VERDICT_ORDER and not informational(c)]


def _worst(rows: list[ComparisonOut]) -> ComparisonOut | None:
    """The row with the worst verdict; the metric table's order (the perplexity ratio first) among equals."""
    rank = {name: i for i, name in enumerate(METRICS)}  # read now: a metric registered later has its place too
    return min(rows, key=lambda c: (-VERDICT_ORDER[c.verdict], rank[c.metric]), default=None)


def finding(c: ComparisonOut) -> str:
    """One comparison as a person reads it: 'ppl ratio +5.90% [+4.50, +8.20] critical'."""
    metric = METRICS[c.metric]
    if c.estimate is None:
        return f"{metric.label} {c.verdict}"
    return f"{metric.label} {format_estimate(metric, c.estimate, c.ci_low, c.ci_high)} {c.verdict}"


def _rule_samples(c: ComparisonOut) -> int | None:
    """The samples an inconclusive comparison's rule says would decide it at its effect (evals/stats.decide)."""
    return rule_samples(c.rule)


# generation.prompts' bound, read from its field (vocabulary/suite.py GenerationSettings)
MAX_PROMPTS = next(m.le for m in GenerationSettings.model_fields["prompts"].metadata if getattr(m, "le", None))


def samples_to_decide(c: ComparisonOut) -> int | None:
    """About how many samples would decide an inconclusive comparison: its rule's figure, else the
    metric's min_n when it stands below it; None when neither says."""
    min_n = METRICS[c.metric].min_n
    return _rule_samples(c) or (min_n if c.n < min_n else None)


def _to_decide(c: ComparisonOut) -> str:
    """What would decide an inconclusive comparison, in words."""
    found, min_n = _rule_samples(c), METRICS[c.metric].min_n
    if found:
        return f" (about {found} samples would decide it)"
    return f" (below min_n {min_n})" if c.n < min_n else ""


def measured_on(figures: Mapping[str, Any] | None) -> str:
    """'reference engine on cpu' from a config's figures: what a speed finding describes. A served
    model's device is its server: named by host, never by a URL that could carry a credential."""
    if not figures or not figures.get("engine"):
        return ""
    device = str(figures.get("device") or "")
    if "://" in device:
        device = urlsplit(device).hostname or "a server"
    return f"{figures['engine']} engine on {device}" if device else f"{figures['engine']} engine"


def severity(c: ComparisonOut) -> float:
    """How far past its seed threshold (critical, else warn) a finding lies, in units of that
    threshold's own distance from no change: a ratio in logs (ppl 6.96 against critical 1.30 is
    log 6.96 / log 1.30 = 7.4; 1.074 is 0.27), a share or difference as itself over the threshold.
    Orders a group's lines; 0 where it cannot be said (no estimate, a measurement error)."""
    metric, est = METRICS[c.metric], c.estimate
    bound = metric.critical if metric.critical is not None else metric.warn
    if est is None or bound is None or not math.isfinite(est):
        return 0.0
    if metric.unit == "ratio":
        if est <= 0 or bound <= 0 or bound == 1:
            return 0.0
        return math.log(est) / math.log(bound)
    if metric.direction == "below":
        return (1 - est) / (1 - bound) if bound < 1 else 0.0
    return est / bound if bound else 0.0


# labelled.max_items' bound, read from its field (vocabulary/suite.py LabelledSettings)
MAX_ITEMS = next(m.le for m in LabelledSettings.model_fields["max_items"].metadata if getattr(m, "le", None))


def reach(setting: str | None, cap: int | None) -> int | None:
    """The most a suite setting's count can be raised to where the suite can give `cap` documents
    (None: no bound known): the documents themselves, the prompts (openings of the documents, at
    most MAX_PROMPTS), the labelled items (at most MAX_ITEMS: a task file may hold fewer), or a
    setting of its own (the decode or distribution documents: no bound here)."""
    if setting is None:
        return cap
    if setting == "generation.prompts":
        return MAX_PROMPTS if cap is None else min(cap, MAX_PROMPTS)
    if setting == "labelled.max_items":
        return MAX_ITEMS
    return None


UNITS = {None: "documents", "generation.prompts": "prompts", "labelled.max_items": "items"}
TIMING_RATIOS = ("ttft_ratio", "tpot_ratio")  # wall-clock ratios: a quieter host narrows their CI


def config_line(config: str, rows: list[ComparisonOut], advice: str | None = None,
                figures: Mapping[str, Any] | None = None, drawn: int | None = None,
                cap: int | None = None) -> SummaryLineOut | None:
    """The summary line of one candidate from its judged comparisons (the ship group's when every
    one is ok; None when it has none at all); `figures`, its own, name what a speed finding measured;
    `drawn`, the documents its run drew (a comparison over fewer of them, the documents with domain
    terms, needs proportionally more drawn to reach the n that decides it); `cap`, the most
    documents its suite can give: an undecided comparison that needs more (workers/top_up.py
    `reachable`, the same rule) is not sized for but named in `decide_beyond`."""
    if not rows:
        return None
    quality = [c for c in rows if METRICS[c.metric].aspect == "quality" and c.verdict != "ok"]
    speed = [c for c in rows if METRICS[c.metric].aspect == "speed" and c.verdict != "ok"]
    breach = ("warn", "critical", "measurement_error")
    q, s = _worst(quality), _worst(speed)
    if q is not None and q.verdict in ("critical", "measurement_error"):
        group = "drop or fix"
    elif q is not None and q.verdict == "warn":
        group = "watch"
    elif s is not None and s.verdict in breach:
        group = "slower than the baseline"
    elif q is not None or s is not None:
        group = "undecided"
    else:
        group = "ship"
    where = measured_on(figures)
    shown = [finding(x) + (f" ({where})" if x is s and where else "")
             + (f" at n={x.n}{_to_decide(x)}" if group == "undecided" else "")
             for x in (q, s) if x is not None and (x.verdict in breach or group == "undecided")]
    findings = "; ".join(shown)
    text = (f"{config}: {findings}" if findings else config) + (f" — step back: {advice}" if advice else "")
    counts = {v: sum(c.verdict == v for c in rows) for v in ("critical", "warn")}
    worst = q if group in ("drop or fix", "watch") else s if group == "slower than the baseline" else q or s
    decide: int | None = None
    settings: dict[str, int] = {}
    beyond: list[str] = []
    if group == "undecided":  # the most any of its inconclusive gated comparisons needs; twice its n when none says
        for x in rows:
            if x.verdict == "inconclusive" and x.gated:
                wanted = samples_to_decide(x) or 2 * x.n
                setting = counted_by(x.metric)
                if setting is None and drawn and 0 < x.n < drawn:  # n counts some of the documents: scale up
                    wanted = math.ceil(wanted * drawn / x.n)
                most = reach(setting, cap)
                if most is not None and wanted > most:
                    unit = UNITS.get(setting, setting or "documents")
                    quieter = "; a quieter host narrows a timing ratio" if x.metric in TIMING_RATIOS else ""
                    label = METRICS[x.metric].label
                    beyond.append(f"{label} needs about {wanted} {unit} (at most {most} here{quieter})")
                elif setting is None:
                    decide = max(decide or 0, wanted)
                else:
                    settings[setting] = max(settings.get(setting, 0), wanted)
        if decide is None and not settings and not beyond:  # no comparison says: twice its n, where the suite has them
            wanted = 2 * max(x.n for x in rows)
            if cap is not None and wanted > cap:
                beyond.append(f"about {wanted} documents (at most {cap} here)")
            else:
                decide = wanted
    return SummaryLineOut(config=config, group=group, text=text, findings=findings, decide_samples=decide,
                          decide_settings=settings, decide_beyond=beyond,
                          severity=severity(worst) if worst is not None else 0.0,
                          critical=counts["critical"], warn=counts["warn"], quality=q, speed=s, advice=advice)


class Advice(NamedTuple):
    """A stacked config's step-back advice where the whole finding (StepBackOut) is not at hand."""

    config: str
    advice: str | None


def verdict_summary(comparisons: Iterable[ComparisonOut], step_back: Iterable[StepBackOut | Advice] = (),
                    baseline: str | None = None, ablations: Iterable[str] = (),
                    max_lines: int = MAX_LINES, figures: Mapping[str, Mapping[str, Any]] | None = None,
                    decide_with: str | None = None, decide_cap: int | None = None,
                    drawn: int | None = None, decide_settings_with: Mapping[str, str] | None = None,
                    edited: Mapping[str, int] | None = None) -> VerdictSummaryOut:
    """The lines by group, the text as printed (at most max_lines), how many configs it leaves
    out, and the configs per group. The baseline and a stacked config's single-layer ablations (a
    diagnosis, not a deploy) get no line of their own. `figures`: each config's (engine, device);
    `decide_with`: the command that decides the undecided configs, with `{configs}` and `{samples}`
    to fill in (app/services.decide_command); `decide_settings_with`: the options of that command
    that raise a suite setting, by setting (the demo's `--prompts {n}`), added to it where a
    config needs that setting raised (a setting with none is named in words: it lives in the
    team's canary.yaml); `decide_cap`: the most samples the suite can give (its documents, the
    per-run limit): a comparison needing more is named apart, not sized for; `drawn`: the samples
    the run holds already (a command never asks for fewer);
    `edited`: the configs edited in place since the run that measured them (config → that run):
    undecided whatever that run said, since it said it of an earlier definition, and decided by
    measuring them again on as many documents."""
    skip = {baseline, *ablations}
    by_config: dict[str, list[ComparisonOut]] = {}
    for c in judged(comparisons):
        if c.config not in skip:
            by_config.setdefault(c.config, []).append(c)
    advice: dict[str, str] = {}
    for s in step_back:  # the first (the worst ratio's) advice of each stacked config
        if s.advice:
            advice.setdefault(s.config, s.advice)
    figures = figures or {}
    lines = [line for config, rows in by_config.items()
             if (line := config_line(config, rows, advice.get(config), figures.get(config), drawn, decide_cap))]
    edits = edited or {}
    for i, line in enumerate(lines):
        if line.config in edits:
            then = "; ".join(finding(x) for x in (line.quality, line.speed) if x is not None) or "ok"
            lines[i] = line.model_copy(update={
                "group": "undecided", "findings": f"edited since run {edits[line.config]} measured it (then: {then})",
                "text": f"{line.config}: edited since run {edits[line.config]} measured it (then: {then})",
                "decide_samples": max(c.n for c in by_config[line.config]), "decide_settings": {},
                "decide_beyond": []})
    lines.sort(key=lambda line: (GROUPS.index(line.group), -line.severity, -line.critical, -line.warn, line.config))
    groups = {g: [line for line in lines if line.group == g] for g in GROUPS}
    groups = {g: rows for g, rows in groups.items() if rows}
    breaching = {g: rows for g, rows in groups.items() if g in BREACHING}
    text = _render(breaching, sum(len(rows) for rows in breaching.values()), max_lines)
    shown = sum(line.startswith("  ") for line in text)
    more = sum(len(rows) for rows in breaching.values()) - shown
    if more:
        plural = "s" if more != 1 else ""
        text.append(f"… and {more} more config{plural} (every finding: --wide, --json or the run page)")
    if "undecided" in groups:  # never cut: each says what would decide it
        undecided = groups["undecided"]
        text += _render({"undecided": undecided}, len(undecided), len(undecided) + 1)
        if decide_with:
            text += decide_lines(undecided, decide_with, decide_settings_with or {}, decide_cap, drawn, edits)
    if "ship" in groups:
        text.append(f"ship ({len(groups['ship'])}): {', '.join(line.config for line in groups['ship'])}")
    return VerdictSummaryOut(groups=groups, lines=text, more=more,
                             counts={g: len(rows) for g, rows in groups.items()})


def decide_lines(undecided: list[SummaryLineOut], command: str, options: Mapping[str, str], cap: int | None,
                 drawn: int | None, rerun: Iterable[str] = ()) -> list[str]:
    """What decides the undecided configs: one command (`command`, with `{configs}` and `{samples}`)
    asking for the most documents any of them needs and, through its `options` (by suite setting,
    `{n}` to fill in), the most of each setting; a setting the command has no option for, in words;
    and the comparisons no run on this suite could decide (more than `cap` documents, or more of a
    setting than it takes), by name. A command asks for at least as many documents as the run drew
    (the prompts are openings of the documents drawn, and fewer would measure less), and for more
    only where a config needs more, a setting is raised or a config is to be measured again as it
    now is (`rerun`: edited since its run)."""
    out: list[str] = []
    settings: dict[str, int] = {}
    for line in undecided:
        for setting, wanted in line.decide_settings.items():
            settings[setting] = max(settings.get(setting, 0), wanted)
    raised = {setting: wanted for setting, wanted in settings.items() if setting in options}
    again = set(rerun)
    samples = max((line.decide_samples or 0 for line in undecided), default=0)
    if cap is not None:
        samples = min(samples, cap)
    more = drawn is None or samples > drawn
    samples = max(samples, drawn or 0)
    asked = [line.config for line in undecided if line.decide_samples or set(line.decide_settings) & set(raised)]
    if asked and samples > 0 and (more or raised or again & set(asked)):
        flags = "".join(" " + options[setting].format(n=min(wanted, samples) if setting == "generation.prompts"
                                                      else wanted) for setting, wanted in sorted(raised.items()))
        out.append("  decide: " + command.format(configs=",".join(asked), samples=samples) + flags)
    unraised = {setting: wanted for setting, wanted in settings.items() if setting not in raised}
    if unraised:  # more documents asked would not add these: the suite's own counts would
        asks = ", ".join(f"{setting} about {wanted}" for setting, wanted in sorted(unraised.items()))
        whose = [line.config for line in undecided if set(line.decide_settings) & set(unraised)]
        out.append(f"  decide: raise the suite's {asks} ({', '.join(whose)}: more documents alone would not)")
    beyond = [f"{line.config}'s {need}" for line in undecided for need in line.decide_beyond]
    if beyond:
        out.append(f"  decide: not on this suite (a larger corpus or task would): {', '.join(beyond)}")
    return out


def _render(groups: Mapping[str, list[SummaryLineOut]], total: int, max_lines: int) -> list[str]:
    """Each group's heading and its lines, in order, stopping where the next line (with its heading,
    and a last line for the configs left out) would pass max_lines."""
    text: list[str] = []
    shown = 0
    for group, rows in groups.items():
        for i, line in enumerate(rows):
            left_after = total - shown - 1
            if len(text) + 1 + (i == 0) + (left_after > 0) > max_lines:
                return text
            if i == 0:
                text.append(f"{group} ({len(rows)}):")
            text.append(f"  {line.text}")
            shown += 1
    return text


def trade_off_points(configs: Iterable[RunConfigOut], comparisons: Iterable[ComparisonOut],
                     figures: Mapping[str, Mapping[str, Any]], baseline: str | None) -> list[TradeOffPointOut]:
    """Per candidate with a perplexity ratio: quality loss % with its CI; speed gain × as the
    inverse of the paired TPOT ratio with its CI (tokens/s ratio, no CI, when not measured);
    memory saved % for a 512-token context. The baseline is the origin (0 %, 1×, 0 %). The
    dashboard's Compare plot and `canary report` draw them (the run API's `trade_off`).
    `figures`: each config's figures as a mapping (RunOut.figures_of)."""
    comparisons = list(comparisons)
    bf = figures.get(baseline or "") or {}

    def memory(f: Mapping[str, Any]) -> float:
        return (f.get("weight_bytes") or 0) + 512 * (f.get("kv_bytes_per_token") or 0)

    out = [TradeOffPointOut(config=f"{baseline} (baseline)", loss=0.0, loss_low=0.0, loss_high=0.0, speed=1.0,
                            speed_low=1.0, speed_high=1.0, memory=0.0, verdict="baseline", speed_sure=True)]
    for c in configs:
        name = c.config
        comps: dict[str, ComparisonOut] = {x.metric: x for x in comparisons if x.config == name}
        ppl, tpot, f = comps.get("ppl_ratio"), comps.get("tpot_ratio"), figures.get(name) or {}
        if name == baseline or not ppl or ppl.estimate is None:
            continue
        speed: float | None
        low: float | None
        high: float | None
        if tpot and tpot.estimate:
            speed = 1 / tpot.estimate
            low, high = speed, speed
            if tpot.ci_low and tpot.ci_high:
                low, high = 1 / tpot.ci_high, 1 / tpot.ci_low
            sure = tpot.verdict != "inconclusive"
        elif bf.get("tokens_per_second") and f.get("tokens_per_second"):
            speed = low = high = f["tokens_per_second"] / bf["tokens_per_second"]
            sure = False  # one reading each, no CI
        else:
            speed = low = high = None
            sure = False
        out.append(TradeOffPointOut(
            config=name, loss=(ppl.estimate - 1) * 100,
            loss_low=(ppl.ci_low - 1) * 100 if ppl.ci_low is not None else None,
            loss_high=(ppl.ci_high - 1) * 100 if ppl.ci_high is not None else None,
            speed=speed, speed_low=low, speed_high=high, speed_sure=sure,
            memory=100 * (1 - memory(f) / max(1, memory(bf))), verdict=ppl.verdict))
    return out
