"""The pre-deploy gate: a run of one candidate config against its model's baseline, started by
CI, whose verdict is durable in Postgres (a retried CI step with the same Idempotency-Key gets
the same gate, and a restarted worker finishes the same run).

Gate verdict from the run's verdict: pass → pass; warn → warn; fail → fail; inconclusive →
the policy's `inconclusive` (default warn: the data could not vouch for the candidate);
incomplete or error → error (the gate could not decide).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app import repo
from app.models import Gate, Project, Run, utcnow
from app.schemas import ComparisonOut, RunOut
from app.summary import decision_line
from vocabulary.metrics import METRICS, VERDICT_ORDER, format_estimate

GATE_VERDICTS = ("pass", "warn", "fail", "error")


def gate_verdict(run_verdict: str | None, policy: dict | None) -> str | None:
    if run_verdict is None:
        return None
    if run_verdict == "inconclusive":
        return (policy or {}).get("inconclusive", "warn")
    return {"pass": "pass", "warn": "warn", "fail": "fail"}.get(run_verdict, "error")


def check_request(session: Session, project: Project, candidate: str, baseline: str | None, suite: str) -> str:
    """Validate names before anything is written; returns the baseline's name."""
    cand = repo.get_config(session, project, candidate)  # NotFound → 404 naming the config
    repo.get_suite(session, project, suite)
    base = next((c for c in repo.list_configs(session, project) if c.model_id == cand.model_id and c.is_baseline), None)
    if base is None:
        raise ValueError(f"candidate: model of '{candidate}' has no baseline config; mark one config as baseline")
    if baseline is not None and baseline != base.name:
        raise ValueError(f"baseline: '{baseline}' is not the baseline of model '{cand.model.name}' (its baseline is "
                         f"'{base.name}'); omit --baseline or name '{base.name}'")
    if cand.id == base.id:
        raise ValueError(f"candidate: '{candidate}' is the baseline itself; name the config you want to deploy")
    return base.name


def record_gate(session: Session, project: Project, run_id: int, candidate: str, baseline: str, policy: dict | None,
                idempotency_key: str | None) -> Gate:
    return repo.record_gate(session, project.id, run_id, candidate, baseline, policy, idempotency_key)


def find_gate(session: Session, project: Project, idempotency_key: str | None) -> Gate | None:
    if not idempotency_key:
        return None
    return session.scalar(select(Gate).where(Gate.project_id == project.id, Gate.idempotency_key == idempotency_key))


def decide(session: Session, run_id: int) -> None:
    """Called when a run finishes: its gate (if any) takes its durable verdict."""
    run = session.get(Run, run_id)
    if run is None or run.verdict is None:
        return  # still running: no verdict, no decided_at
    for gate in session.scalars(select(Gate).where(Gate.run_id == run_id, Gate.verdict.is_(None))):
        gate.verdict = gate_verdict(run.verdict, gate.policy)
        gate.decided_at = utcnow()


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def gains(figures: dict[str, Any], candidate: str, baseline: str) -> list[str]:
    """What the candidate buys, from the run's figures of both configs: throughput and memory as
    "×" of the baseline's, each with both values. Empty when neither side measured it."""
    cand, base = figures.get(candidate) or {}, figures.get(baseline) or {}
    out = []
    tps_c, tps_b = cand.get("tokens_per_second"), base.get("tokens_per_second")
    if tps_c and tps_b:
        # a reused baseline was timed in another run, under that run's load: said, not hidden
        when = f", the baseline's timed in run {base['reused_from_run']}" if base.get("reused_from_run") else ""
        out.append(f"throughput {tps_c / tps_b:.2f}× the baseline's ({tps_c:.0f} vs {tps_b:.0f} tokens/s{when})")
    for key, what in (("weight_bytes", "weights"), ("kv_bytes_per_token", "KV cache per token"),
                      ("peak_device_bytes", "peak memory")):
        c, b = cand.get(key), base.get(key)
        if not c or not b:
            continue
        size = _mb if key != "kv_bytes_per_token" else (lambda n: f"{n:,.0f} B")
        if c < b:
            out.append(f"{what} {b / c:.2f}× smaller ({size(c)} vs {size(b)})")
        else:
            out.append(f"{what} {c / b:.2f}× the baseline's ({size(c)} vs {size(b)})")
    return out


def step_back_lines(summary: RunOut, candidate: str) -> list[str]:
    """For a stacked candidate that breaches, each layer's share of the loss on its worst quality
    ratio (workers/step_back.py; the layer to disable is in the verdict's lines); nothing when its
    ablations did not run."""
    found = [s for s in summary.step_back if s.config == candidate]
    if not found:
        return []
    worst = found[0] if len(found) == 1 else max(
        found, key=lambda s: (max(VERDICT_ORDER.get(c.verdict, 0) for c in summary.comparisons
                                  if c.config == candidate and c.metric == s.metric), s.stacked_ratio))
    # the advice itself is in the verdict's lines above (app/summary.py): here, each layer's share
    lines = ["", f"**Step back one layer** (each layer's share of the loss on {worst.metric}):", "",
             f"| layer | {worst.metric} alone | share of the loss | run alone as |", "|---|---|---|---|"]
    for layer in worst.layers:
        share = "—" if layer.share is None else f"{layer.share * 100:.1f} %"  # the advice rounds; the table not
        lossless = " (lossless)" if layer.lossless else ""
        lines.append(f"| {layer.axis} {layer.value}{lossless} | {layer.ratio:.4g} | {share} | `{layer.config}` |")
    return lines


def sticky_marker(candidate: str, suite: str) -> str:
    """The summary's first line, hidden when rendered: a CI step finds the pull request's comment
    that starts with it and edits that one instead of adding another (deploy/ci)."""
    return f"<!-- inference-canary gate: candidate={candidate} suite={suite} -->"


def summary_markdown(gate: Gate, summary: RunOut, dashboard_url: str, suite: str) -> str:
    """A PR-comment / job-summary (its first line the sticky-comment marker): the verdict, what was
    compared (suite, documents, run), then the candidate's comparisons worst first as % change
    [95% CI] with n, then the speed and memory it gains. Informational comparisons come after the
    gated ones."""
    from app.services import samples_label

    icon = {"pass": "✅", "warn": "⚠️", "fail": "❌", "error": "🛑"}.get(gate.verdict or "", "⏳")
    link = f"{dashboard_url.rstrip('/')}/?page=Run+detail&run_id={summary.run_id}"
    lines = [sticky_marker(gate.candidate, suite), f"## {icon} inference-canary gate: **{gate.verdict or 'pending'}**",
             "",
             f"`{gate.candidate}` vs baseline `{gate.baseline}` on suite `{suite}` "
             f"({samples_label(summary)}), run {summary.run_id}. [Open the run]({link})", ""]
    rows: list[ComparisonOut] = [c for c in summary.comparisons if c.config == gate.candidate]
    # the decision, then the verdict for people as every surface prints it (app/summary.py)
    lines += [decision_line(gate.verdict), ""]
    if summary.summary.lines:
        lines += ["```text", *summary.summary.lines, "```", ""]
    rows.sort(key=lambda c: (not c.gated, -VERDICT_ORDER.get(c.verdict, 0)))
    if rows:
        lines += ["| metric | change vs baseline [95% CI] | n | verdict | rule |", "|---|---|---|---|---|"]
        for c in rows:
            metric = METRICS.get(c.metric)
            change = (format_estimate(metric, c.estimate, c.ci_low, c.ci_high) if metric
                      else "—" if c.estimate is None else f"{c.estimate:.4g}")
            said = " (informational)" if not c.gated else ""
            lines.append(f"| {c.metric} | {change} | {c.n} | {c.verdict}{said} | {c.rule or ''} |")
    lines += step_back_lines(summary, gate.candidate)
    gained = gains({name: summary.figures_of(name) for name in summary.figures}, gate.candidate, gate.baseline)
    if gained:
        lines += ["", "**Speed and memory:** " + "; ".join(gained) + "."]
    reason = summary.verdict_reason or ""
    for step_back in summary.step_back:  # said above, in its own lines: not twice
        reason = reason.replace(f"; step back {step_back.config}: {step_back.advice}", "")
    if reason:
        lines += ["", f"Reason: {reason}"]
    reused = summary.figures_of(gate.baseline).get("reused_from_run")
    if reused:
        lines += ["", f"Baseline `{gate.baseline}`: the results of run {reused}, reused (the same model files, "
                      "config, suite, samples, code and libraries); `CANARY_GATE_REUSE_BASELINE=false` recomputes it."]
    return "\n".join(lines) + "\n"
