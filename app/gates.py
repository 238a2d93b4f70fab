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
    gate = Gate(project_id=project.id, run_id=run_id, idempotency_key=idempotency_key, candidate=candidate,
                baseline=baseline, policy=policy or None)
    session.add(gate)
    session.flush()
    return gate


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


def summary_markdown(gate: Gate, summary: dict[str, Any], dashboard_url: str) -> str:
    """A PR-comment summary: verdict, then each of the candidate's comparisons with its CI."""
    icon = {"pass": "✅", "warn": "⚠️", "fail": "❌", "error": "🛑"}.get(gate.verdict or "", "⏳")
    lines = [f"## {icon} inference-canary gate: **{gate.verdict or 'pending'}**", "",
             f"Candidate `{gate.candidate}` vs baseline `{gate.baseline}` — run {summary['run_id']} "
             f"({summary['n_samples']} samples). [Open the run]({dashboard_url.rstrip('/')}/?page=run&run_id={summary['run_id']})", ""]
    rows = [c for c in summary["comparisons"] if c["config"] == gate.candidate]
    if rows:
        lines += ["| metric | estimate | 95% CI | n | verdict | rule |", "|---|---|---|---|---|---|"]
        for c in rows:
            est = "—" if c["estimate"] is None else f"{c['estimate']:.4g}"
            ci = "" if c["ci_low"] is None else f"[{c['ci_low']:.4g}, {c['ci_high']:.4g}]"
            lines.append(f"| {c['metric']} | {est} | {ci} | {c['n']} | {c['verdict']} | {c['rule']} |")
    if summary.get("verdict_reason"):
        lines += ["", f"Reason: {summary['verdict_reason']}"]
    return "\n".join(lines) + "\n"
