"""What a release review needs beside a run's comparisons (app/report.py): the thresholds that judged
it, the environment that measured it, and the report as Markdown for a pull request.

- **Thresholds:** per gated metric of the run, the warn and critical bounds, the direction, min_n,
  which rule sets them (the metric table's seed, or a rule of the project, the model or one config,
  app/repo `most_specific_rule`) and the candidates it applies to: the rules as they stand when the
  report is made. Each comparison's own row keeps the rule that judged it, in words.
- **Environment:** the model (name, path, and the digest of the weights each config loaded), the
  suite and its version, the seed, the samples asked and drawn, when it ran (UTC), the canary's
  version, and per config the engine, device, compute dtype and the libraries it ran on
  (`versions` in its figures). What differs between configs is said per config; what they
  share, once.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.orm import Session

from app import repo
from app.models import Model, Run, Suite
from app.schemas import RunOut
from app.ssrf import mask_url
from vocabulary.metrics import METRICS, VERDICT_ORDER, format_estimate


@dataclass(frozen=True)
class Threshold:
    metric: str
    label: str
    direction: str  # above | below: which side breaches
    warn: float | None
    critical: float | None
    min_n: int
    source: str  # "seed" | "project rule" | "model rule" | "config rule"
    configs: tuple[str, ...]  # the candidates it judged


@dataclass(frozen=True)
class ReportContext:
    thresholds: list[Threshold]
    environment: list[tuple[str, str]]  # (what, value) of the run and what every config shares
    configs: list[dict[str, Any]]  # per config: name, engine, device, dtype, weights, kv cache, speculative
    versions: dict[str, str] = field(default_factory=dict)  # the libraries every config ran on


def when(iso: str | None) -> str:
    """'2026-11-29 06:10 UTC' from a stored time ('—' for none; one without a zone is UTC, as the
    service writes it)."""
    if not iso:
        return "—"
    at = datetime.fromisoformat(iso)
    return (at.astimezone(timezone.utc) if at.tzinfo else at).strftime("%Y-%m-%d %H:%M UTC")


def gather(session: Session, run: Run, summary: RunOut) -> ReportContext:
    """The thresholds and environment of a run, read from the database."""
    rules = repo.alert_rules(session, run.project_id, run.model_id)
    ids = {cr.config.name: cr.config_id for cr in run.config_runs}
    judged: dict[tuple[str, str, float | None, float | None, int, str], list[str]] = {}
    for c in summary.comparisons:
        metric = METRICS.get(c.metric)
        if metric is None or not c.gated or c.config == summary.baseline or c.config not in ids:
            continue
        rule = repo.most_specific_rule(rules, c.metric, ids[c.config])
        key: tuple[str, str, float | None, float | None, int, str]
        if rule is None:
            key = (c.metric, metric.direction, metric.warn, metric.critical, metric.min_n, "seed")
        else:
            source = "config rule" if rule.config_id else "model rule" if rule.model_id else "project rule"
            key = (c.metric, rule.direction, rule.warn, rule.critical, rule.min_n, source)
        judged.setdefault(key, []).append(c.config)
    order = {name: i for i, name in enumerate(METRICS)}
    every = {c.config for c in summary.comparisons if c.config != summary.baseline}
    thresholds = [Threshold(metric, METRICS[metric].label, direction, warn, critical, min_n, source,
                            ("every candidate",) if set(configs) == every and len(every) > 1
                            else tuple(sorted(set(configs))))
                  for (metric, direction, warn, critical, min_n, source), configs in judged.items()
                  if warn is not None or critical is not None]  # no threshold: reported, judged by none
    thresholds.sort(key=lambda t: (order[t.metric], t.source != "seed", t.configs))
    model = session.get(Model, run.model_id)
    suite = session.get(Suite, run.suite_id)
    figures = {name: summary.figures_of(name) for name in summary.figures}
    configs = [{"config": name, "engine": f.get("engine"), "device": _public(f.get("device")),
                "dtype": f.get("compute_dtype"), "weights": f.get("weights"), "kv cache": f.get("kv_cache"),
                "speculative": f.get("speculative"), "versions": f.get("versions") or {}}
               for name, f in figures.items()]
    shared = _shared([f.get("versions") or {} for f in figures.values()])
    try:
        canary = importlib.metadata.version("inference-canary")
    except importlib.metadata.PackageNotFoundError:
        canary = "unknown (not installed)"
    drawn = len(run.sample_keys or [])
    environment = [
        ("model", f"{model.name} ({_public(model.path)})" if model else str(run.model_id)),
        ("model digest", _digests({name: f.get("model_digest") for name, f in figures.items()})),
        ("suite", f"{suite.name}, version {run.suite_version}" if suite else str(run.suite_id)),
        ("samples", f"{drawn} drawn" + (f" ({run.n_samples} asked, topped up)" if drawn != run.n_samples else "")),
        ("seed", str(run.seed)),
        ("trigger", run.trigger),
        ("started", when(summary.created_at)), ("finished", when(summary.finished_at)),
        ("inference-canary", canary),
    ]
    return ReportContext(thresholds, environment, configs, shared)


def _digests(by_config: dict[str, str | None]) -> str:
    """The sha256 of the weights each config loaded (weight files and config.json), cut to 16 hex
    digits: once when every config loaded the same, else per digest with its configs (a config's own
    checkpoint); a served model's cannot be read."""
    groups: dict[str | None, list[str]] = {}
    for name, digest in by_config.items():
        groups.setdefault(digest, []).append(name)

    def text(digest: str | None) -> str:
        return f"sha256 {digest[:16]}…" if digest else "not stored (a served model, or a run stored before it was)"
    if len(groups) == 1:
        return text(next(iter(groups)))
    return "; ".join(f"{', '.join(names)}: {text(digest)}" for digest, names in groups.items())


def _public(text: Any) -> Any:
    """A served model's URL (its device, a model's path) as scheme and host only: the report is
    shared, and a URL may carry a credential (app/ssrf.mask_url)."""
    return mask_url(text) if isinstance(text, str) and "://" in text else text


def _shared(versions: list[dict[str, str]]) -> dict[str, str]:
    """The library versions every config reports alike."""
    if not versions:
        return {}
    first = versions[0]
    return {k: v for k, v in sorted(first.items()) if all(other.get(k) == v for other in versions[1:])}


def _md(value: Any) -> str:
    """A table cell: '—' for none, a '|' escaped."""
    return "—" if value is None else str(value).replace("|", "\\|")


def bound(value: float | None) -> str:
    """A threshold as its metric's unit is read: a ratio as itself ('1.05'), '—' for none."""
    return "—" if value is None else f"{value:g}"


def markdown(summary: RunOut, project: str, suite: str, ctx: ReportContext) -> str:
    """The report for a pull request or a release ticket: the decision, the thresholds, every gated
    comparison of the candidates, the environment; GitHub-flavoured Markdown, no HTML."""
    verdict = summary.verdict or summary.status
    lines = [f"# inference-canary · project `{project}` · run {summary.run_id}: **{verdict}**", "",
             f"Suite `{suite}`, baseline `{summary.baseline or '—'}`, started {when(summary.created_at)}, "
             f"finished {when(summary.finished_at)}.", "", "## Decision", "", "```text",
             *(summary.summary.lines or [summary.verdict_reason or "every comparison is ok"]), "```", "",
             "## Thresholds (the rules as they stand now)", "",
             "| metric | breaches when | warn | critical | min n | from | judged |",
             "|---|---|---|---|---|---|---|"]
    for t in ctx.thresholds:
        lines.append(f"| {t.label} | {t.direction} | {bound(t.warn)} | {bound(t.critical)} | {t.min_n} | {t.source} "
                     f"| {_md(', '.join(t.configs))} |")
    lines += ["", "## Gated comparisons", "", "| config | metric | change vs baseline [95% CI] | n | verdict |",
              "|---|---|---|---|---|"]
    rows = sorted((c for c in summary.comparisons if c.gated and c.config != summary.baseline and c.metric in METRICS),
                  key=lambda c: (-VERDICT_ORDER.get(c.verdict, 0), c.config, c.metric))
    for c in rows:
        metric = METRICS[c.metric]
        lines.append(f"| {_md(c.config)} | {metric.label} | {format_estimate(metric, c.estimate, c.ci_low, c.ci_high)} "
                     f"| {c.n} | {c.verdict} |")
    lines += ["", "## Environment", "", "| | |", "|---|---|", *(f"| {k} | {_md(v)} |" for k, v in ctx.environment)]
    if ctx.versions:
        lines.append("| libraries | " + ", ".join(f"{k} {v}" for k, v in ctx.versions.items()) + " |")
    lines += ["", "| config | engine | device | dtype | weights | KV cache | speculative |",
              "|---|---|---|---|---|---|---|"]
    for cfg in ctx.configs:
        lines.append("| " + " | ".join(_md(cfg[k]) for k in (
            "config", "engine", "device", "dtype", "weights", "kv cache", "speculative")) + " |")
    return "\n".join(lines) + "\n"
