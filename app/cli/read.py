"""Reading what is stored: runs (list, show, cancel), report, alerts and gates."""


from __future__ import annotations

import json
import pathlib
import sys
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    pass
from app.cli.base import AS_JSON, PROJECT, _table, _when, alerts_app, app, console, fail, gates_app, runs_app
from app.cli.gate import _gate_out
from app.cli.output import _print_summary


@runs_app.command("list")
def runs_list(project: str = PROJECT, limit: int = typer.Option(20, min=1, max=500), as_json: bool = AS_JSON) -> None:
    """The project's newest runs: id, suite, trigger, status, verdict, samples, times."""
    from app import repo
    from app.db import session_scope
    from app.models import Suite

    with session_scope() as session:
        project_row = repo.get_project(session, project)
        items: list[dict[str, Any]] = [
            {"run_id": run.id, "suite": (session.get(Suite, run.suite_id) or Suite(name="?")).name,
             "trigger": run.trigger, "status": run.status, "verdict": run.verdict, "n_samples": run.n_samples,
             "samples_drawn": len(run.sample_keys),
             "created_at": run.created_at.isoformat() if run.created_at else None,
             "finished_at": run.finished_at.isoformat() if run.finished_at else None}
            for run in repo.list_runs(session, project_row, limit)]
    if as_json:
        sys.stdout.write(json.dumps(items) + "\n")
        return
    _table(f"runs of project '{project}' (newest first)",
           ["run", "suite", "trigger", "status", "verdict", "samples", "created", "finished"],
           [[item["run_id"], item["suite"], item["trigger"], item["status"], item["verdict"],
             item["n_samples"] if item["samples_drawn"] == item["n_samples"]
             else f"{item['samples_drawn']} (of {item['n_samples']}, topped up)",
             _when(item["created_at"]), _when(item["finished_at"])] for item in items])


@runs_app.command("show")
def runs_show(run_id: int = typer.Argument(..., help="the run's id (from `canary runs list`)"), project: str = PROJECT,
              wide: bool = typer.Option(False, "--wide", help="every column"), as_json: bool = AS_JSON) -> None:
    """One run: its table (as `canary run` prints it) and verdict, or every figure with --json."""
    from app import repo
    from app.db import session_scope
    from app.services import run_summary

    with session_scope() as session:
        summary = run_summary(session, repo.get_run(session, repo.get_project(session, project), run_id))
    if as_json:
        from app.schemas import jsonable

        sys.stdout.write(json.dumps(jsonable(summary)) + "\n")
    elif summary.status != "done":
        console.print(f"run {run_id} is {summary.status}: " + ", ".join(
            f"{config.config} {config.status} {config.progress.done}/{config.progress.total}"
            for config in summary.configs),
            highlight=False)
    else:
        _print_summary(summary, wide)


@app.command()
def report(run_id: int = typer.Argument(..., help="the run's id (from `canary runs list`)"), project: str = PROJECT,
           output: str | None = typer.Option(None, "--output", "-o",
                                             help="the file to write (default: canary-run-RUN.html or .md); - for "
                                                  "stdout"),
           form: str | None = typer.Option(None, "--format", help="html (one self-contained file) or md (Markdown "
                                                                  "for a pull request); default: from --output's "
                                                                  "suffix, else html"),
           ) -> None:
    """One run's report to share: a self-contained HTML file (the verdict summary, the thresholds,
    every comparison with its CI, quality vs speed, the worst documents per candidate, the field
    signals, the environment) that opens offline in any browser; or the same decision, thresholds,
    gated comparisons and environment as Markdown (--format md) for a pull request."""
    from app import repo
    from app import report as reports
    from app.db import session_scope

    form = form or ("md" if output and output.endswith(".md") else "html")
    if form not in ("html", "md"):
        fail(f"--format must be html or md, not '{form}'")
    target = output or f"canary-run-{run_id}.{form}"
    try:
        with session_scope() as session:
            proj = repo.get_project(session, project)
            text = reports.build(session, proj, repo.get_run(session, proj, run_id), form)
        if target == "-":
            sys.stdout.write(text)
            return
        pathlib.Path(target).write_text(text, encoding="utf-8")
    except repo.NotFound as e:
        fail(str(e))
    except OSError as e:
        fail(f"--output: cannot write {target}: {e.strerror or e}")
    console.print(f"report of run {run_id} written to {target} ({len(text.encode()) // 1024} KB)", highlight=False)


@runs_app.command("cancel")
def runs_cancel(run_id: int = typer.Argument(..., help="the run's id (from `canary runs list`)"),
                project: str = PROJECT) -> None:
    """Stop a queued or running run: its unfinished configs end cancelled, with nothing of theirs
    kept; a gate on it decides `error`. Exit 2 when it has already ended."""
    import getpass

    from app import repo
    from app.db import session_scope
    from app.services import cancel_run

    try:
        with session_scope() as session:
            run = cancel_run(session, repo.get_project(session, project), run_id, f"{getpass.getuser()} (CLI)")
            cancelled = [cr.config.name for cr in run.config_runs if cr.status == "cancelled"]
    except (repo.Conflict, repo.NotFound) as e:
        fail(str(e))
    console.print(f"run {run_id} cancelled" + (f": {', '.join(cancelled)} stopped" if cancelled else ""),
                  highlight=False)


@alerts_app.command("list")
def alerts_list(project: str = PROJECT, state: str | None = typer.Option(None, help="pending | firing | resolved"),
                limit: int = typer.Option(50, min=1, max=1000),
                inhibited: bool = typer.Option(False, "--inhibited",
                                               help="also list warn alerts a firing critical alert inhibits"),
                as_json: bool = AS_JSON) -> None:
    """The project's alerts, newest first, one per regression (as GET /api/v1/projects/{project}/alerts
    serves them with inhibited=false)."""
    from app import repo
    from app.db import session_scope
    from app.queries import alerts

    if state not in (None, "pending", "firing", "resolved", "inactive"):
        fail(f"--state must be pending, firing or resolved, not '{state}'")
    with session_scope() as session:
        items = alerts(session, repo.get_project(session, project), state=state, limit=limit, inhibited=inhibited)
    if as_json:
        sys.stdout.write(json.dumps(items) + "\n")
        return
    _table(f"alerts of project '{project}' (newest first)",
           ["id", "state", "severity", "config", "metric", "value", "run", "fired", "resolved", "escalation"],
           [[alert["id"],
             alert["state"] + (f" (inhibited by {alert['inhibited_by']})" if alert["inhibited_by"] else ""),
             alert["severity"], alert["labels"].get("config"), alert["labels"].get("metric"),
             f"{alert['value']:.4g}" if alert["value"] is not None else None, alert["run_id"], _when(alert["fired_at"]),
             _when(alert["resolved_at"]), alert["escalation_run_id"]] for alert in items])


@gates_app.command("list")
def gates_list(project: str = PROJECT, limit: int = typer.Option(20, min=1, max=500), as_json: bool = AS_JSON) -> None:
    """The project's newest CI gates: candidate, baseline, verdict, run."""
    from app import repo
    from app.db import session_scope
    from app.queries import gates

    with session_scope() as session:
        items = gates(session, repo.get_project(session, project), limit=limit)
    if as_json:
        sys.stdout.write(json.dumps(items) + "\n")
        return
    _table(f"gates of project '{project}' (newest first)",
           ["gate", "candidate", "baseline", "verdict", "run", "created", "decided"],
           [[gate["gate_id"], gate["candidate"], gate["baseline"], gate["verdict"] or "pending", gate["run_id"],
             _when(gate["created_at"]), _when(gate["decided_at"])] for gate in items])


@gates_app.command("show")
def gates_show(gate_id: int = typer.Argument(..., help="the gate's id (from `canary gates list`)"),
               project: str = PROJECT, as_json: bool = AS_JSON) -> None:
    """One gate: its verdict line and its markdown summary, or the whole gate with --json."""
    from app import repo
    from app.db import session_scope
    from app.queries import gate as read_gate

    with session_scope() as session:
        gate = read_gate(session, repo.get_project(session, project), gate_id)
    if as_json:
        from app.schemas import jsonable

        sys.stdout.write(json.dumps(jsonable(gate)) + "\n")
        return
    _gate_out(gate, None, False)
    sys.stdout.write(gate["summary_markdown"] + "\n")
