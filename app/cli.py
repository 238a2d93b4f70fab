"""`canary` command line: demo, serve, worker, run, db, schema."""

from __future__ import annotations

import json
import pathlib
import os
import subprocess
import sys
import time
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from app.ssrf import hide_url_logs

hide_url_logs()

# the terminal colour of a verdict (comparisons) or a run verdict / config-run status
VERDICT_COLORS = {"ok": "green", "pass": "green", "warn": "yellow", "critical": "red", "fail": "red", "failed": "red",
                  "inconclusive": "magenta", "measurement_error": "magenta", "incomplete": "magenta", "error": "red"}

app = typer.Typer(add_completion=False, no_args_is_help=True, help="inference-canary: quality canary for optimized LLM inference.")
db_app = typer.Typer(no_args_is_help=True, help="Database migrations.")
keys_app = typer.Typer(no_args_is_help=True, help="API keys (scoped to a project; only a hash is stored).")
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
console = Console(stderr=True)  # progress and tables on stderr; --json output alone on stdout

DEMO_CONFIG: dict[str, Any] = {
    "project": "demo",
    # the tiny target with the activation and key outlier channels real LLMs have, at the same
    # function (engines/zoo/outliers.py): what AWQ, KIVI and TurboQuant are for shows on it
    "model": {"name": "pydoc-outlier", "path": "builtin:pydoc-outlier"},
    "configs": [
        {"name": "fp16", "baseline": True, "engine": "reference", "weights": "fp16"},
        {"name": "int8", "engine": "reference", "weights": "int8"},
        {"name": "int4", "engine": "reference", "weights": "rtn-int4"},
        {"name": "awq-int4", "engine": "reference", "weights": "awq-int4",
         "engine_options": {"calibration_samples": 16, "calibration_tokens": 256}},
        {"name": "int2", "engine": "reference", "weights": "rtn-int2"},  # deliberately aggressive
        {"name": "kv-fp8", "engine": "reference", "kv_cache": "fp8"},
        {"name": "kv-int8", "engine": "reference", "kv_cache": "int8"},
        {"name": "kv-int2", "engine": "reference", "kv_cache": "int2"},  # naive uniform int2, no window
        {"name": "kivi-4", "engine": "reference", "kv_cache": "kivi-4"},
        {"name": "kivi-2", "engine": "reference", "kv_cache": "kivi-2"},
        {"name": "turbo-3.5", "engine": "reference", "kv_cache": "turbo-3.5"},
        {"name": "turbo-2.5", "engine": "reference", "kv_cache": "turbo-2.5"},
        {"name": "turbo-ip-3", "engine": "reference", "kv_cache": "turbo-ip-3"},
        {"name": "spec-draft-4", "engine": "reference",
         "speculative": {"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 4}},
        {"name": "spec-ngram-4", "engine": "reference", "speculative": {"method": "ngram", "k": 4}},
    ],
    "suites": [
        {"name": "pydoc-daily", "corpus": "builtin:pydoc-heldout", "samples": 100, "seed": 0,
         "scorers": ["perplexity", "generation", "faithfulness", "agreement"],
         # dotted names and dunders: the term NLL ratio scores their tokens apart (term_nll_ratio)
         "perplexity": {"window": 256, "stride": 256, "terms": ["builtin:python-identifiers"]},
         "generation": {"prompts": 16, "prompt_words": 24, "max_new_tokens": 32},
         # no judge endpoint in the demo: faithfulness runs the labelled offline approximation
         "faithfulness": {"method": "offline"}},
    ],
    # A strict team's perplexity budget (the seed defaults, 1.15 / 1.30, only catch broken
    # configs: a tiny model barely notices int4). Printed with the results.
    "thresholds": {"ppl_ratio": {"warn": 1.01, "critical": 1.03}},
}


def fail(msg: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _ensure_zoo() -> None:
    from engines.zoo import ARTIFACTS, BUILTIN_MODELS

    if all((ARTIFACTS / m / "model.safetensors").is_file() for m in BUILTIN_MODELS):
        return
    console.print("[yellow]tiny model zoo not found: building it (about 11 minutes on 2 cores)…[/]")
    subprocess.run([sys.executable, "-m", "engines.zoo.build", "--out", str(ARTIFACTS)], check=True)


def _upgrade_db() -> None:
    from app.db import upgrade

    upgrade()


def _run_and_wait(cfg, suite: str | None, configs: list[str] | None, samples: int | None, as_json: bool, wait: bool,
                  timeout: float = 3600) -> dict | None:
    from app import repo
    from app.db import session_scope
    from app.dispatch import InlineDispatcher, get_dispatcher
    from app.services import apply_config_file, run_summary, start_run
    from app.settings import get_settings

    with session_scope() as s:
        apply_config_file(s, cfg)
    inline = get_settings().execution_mode == "inline"
    if inline:
        # a one-shot CLI run ends with its run: escalation runs belong to a running service
        # (canary serve, or workers), so this process does not start them
        os.environ["CANARY_ESCALATION"] = "false"
        get_settings.cache_clear()
    dispatcher = InlineDispatcher(background=True) if inline else get_dispatcher()
    started = time.perf_counter()
    run_id, _ = start_run(cfg.project, cfg.suite(suite).name, configs, dispatcher, samples=samples)
    if not wait:
        return {"run_id": run_id, "status": "queued"}
    with Progress(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=as_json or not console.is_terminal, transient=False) as progress:
        bars: dict[str, Any] = {}
        while True:
            with session_scope() as s:
                run = repo.get_run(s, repo.get_project(s, cfg.project), run_id)
                for cr in run.config_runs:
                    name = cr.config.name
                    if name not in bars:
                        bars[name] = progress.add_task(name, total=None)
                    progress.update(bars[name], completed=cr.progress_done, total=cr.progress_total or None)
                if run.status in ("done", "failed"):
                    summary = run_summary(s, run)
                    break
                if time.perf_counter() - started > timeout:
                    fail(f"run {run_id} is still {run.status} after {timeout:.0f}s; is a worker consuming the gpu queue? "
                         f"(`canary worker`); the run goes on and GET /api/v1/projects/{cfg.project}/runs/{run_id} shows it")
            time.sleep(0.5)
    if inline:
        dispatcher.drain(60)  # notifications the aggregation queued: let them go out before exiting
    summary["wall_seconds"] = round(time.perf_counter() - started, 1)
    return summary


def metric_cell(comp: dict | None) -> str:
    if comp is None or comp["estimate"] is None:
        return "—" if comp is None else f"[magenta]{comp['verdict']}[/]"
    color = VERDICT_COLORS.get(comp["verdict"], "white")
    return f"[{color}]{comp['estimate']:.2f}[/]"


def _print_summary(summary: dict) -> None:
    out = Console(width=None if Console().is_terminal else 200)
    comps = {(c["config"], c["metric"]): c for c in summary["comparisons"]}
    t = Table(title=f"run {summary['run_id']} — baseline {summary['baseline']}, {summary['n_samples']} documents")
    cols = ("config", "weights", "kv cache", "speculative", "token ppl", "ppl ratio", "95% CI", "verdict",
            "TTFT p50 ms", "TBT p50 ms", "tok/s", "weights MB", "KV B/token", "accept", "faithful", "exact match", "top-1")
    for col in cols:
        t.add_column(col, justify="left" if col in ("config", "weights", "kv cache", "speculative", "verdict") else "right")
    failures = []
    for c in summary["configs"]:
        f = summary["figures"].get(c["config"]) or {}
        r = comps.get((c["config"], "ppl_ratio"))
        is_base = c["config"] == summary["baseline"]
        ratio = f"{r['estimate']:.4f}" if r and r["estimate"] is not None else ("baseline" if is_base else "—")
        ci = f"[{r['ci_low']:.4f}, {r['ci_high']:.4f}]" if r and r["ci_low"] is not None else ""
        verdict = r["verdict"] if r else ("" if is_base else c["status"])
        color = VERDICT_COLORS.get(verdict, "white")
        sp = c["spec"].get("speculative", {})
        spec_label = "off" if sp.get("method", "off") == "off" else f"{sp['method']} k={sp.get('k')}"
        acc = (f.get("spec") or {}).get("acceptance_rate")

        def fmt(key: str, fmt_spec: str) -> str:
            return format(f[key], fmt_spec) if f.get(key) is not None else "—"

        t.add_row(c["config"], c["spec"]["weights"], f.get("kv_cache") or c["spec"].get("kv_cache", ""), spec_label,
                  fmt("token_ppl", ".3f"), ratio, ci, f"[{color}]{verdict}[/]",
                  fmt("ttft_ms_p50", ".1f"), fmt("tbt_ms_p50", ".2f"), fmt("tokens_per_second", ".0f"),
                  f"{f['weight_bytes'] / 1e6:.2f}" if f.get("weight_bytes") else "—",
                  fmt("kv_bytes_per_token", "d"), f"{acc:.2f}" if acc is not None else "",
                  *(metric_cell(comps.get((c["config"], m))) for m in ("faithfulness", "exact_match", "top1_agreement")))
        if c["error"]:
            failures.append(f"{c['config']}: {c['error']}")
    out.print(t)
    for line in failures:
        out.print(f"[red]failed[/] {line}", highlight=False)
    methods = {c.get("details", {}).get("method") for c in summary["comparisons"] if c["metric"] == "faithfulness"} - {None}
    for m in methods:
        out.print(f"faithfulness: {m}", highlight=False)
    out.print(f"verdict: [bold]{summary['verdict']}[/] — {summary['verdict_reason']}", highlight=False)


def _json_out(summary: dict) -> None:
    keep = {"run_id", "status", "verdict", "verdict_reason", "baseline", "comparisons", "figures", "wall_seconds", "configs"}
    out = {k: v for k, v in summary.items() if k in keep}
    out["comparisons"] = [{k: c[k] for k in ("config", "metric", "estimate", "ci_low", "ci_high", "n", "verdict", "rule", "details")}
                          for c in summary["comparisons"]]
    sys.stdout.write(json.dumps(out) + "\n")


@app.command()
def demo(
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
    samples: int = typer.Option(100, min=1, help="held-out documents scored per config"),
    database_url: str = typer.Option("sqlite:///canary-demo.db", help="where the demo writes (never CANARY_DATABASE_URL)"),
) -> None:
    """fp16 vs int8 vs int4 vs int2 on the tiny Python-documentation model, in-process."""
    # The demo never follows CANARY_DATABASE_URL: it must not write into a production database.
    os.environ["CANARY_DATABASE_URL"] = database_url
    os.environ["CANARY_EXECUTION"] = "inline"
    from app.config_file import parse_config
    from app.settings import get_settings

    get_settings.cache_clear()
    _ensure_zoo()
    _upgrade_db()
    cfg = parse_config({**DEMO_CONFIG, "suites": [{**DEMO_CONFIG["suites"][0], "samples": samples}]}, "demo config")
    try:
        summary = _run_and_wait(cfg, None, None, None, as_json, wait=True)
    except ValueError as e:
        fail(str(e))
    if as_json:
        _json_out(summary)
    else:
        _print_summary(summary)
        console.print(f"browse it: CANARY_DATABASE_URL={database_url} canary serve  →  http://127.0.0.1:8000/docs",
                      highlight=False, soft_wrap=True)


@app.command()
def run(
    file: str = typer.Option("canary.yaml", "-f", "--file", help="config file"),
    suite: Optional[str] = typer.Option(None, help="suite name (default: the file's first suite)"),
    configs: Optional[str] = typer.Option(None, help="comma-separated config names (default: all; the baseline is always included)"),
    samples: Optional[int] = typer.Option(None, min=1, help="override the suite's sample count"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    wait: bool = typer.Option(True, help="wait for the verdict"),
    timeout: float = typer.Option(3600, help="seconds to wait for the verdict"),
) -> None:
    """Apply a config file and run a suite over its configs."""
    from app.config_file import ConfigFileError, load_config_file
    from app.corpus import CorpusError
    from app.repo import NotFound

    try:
        cfg = load_config_file(file)
        _upgrade_db()
        summary = _run_and_wait(cfg, suite, configs.split(",") if configs else None, samples, as_json, wait, timeout)
    except (ConfigFileError, CorpusError, NotFound, ValueError) as e:
        fail(str(e))
    if not wait:
        sys.stdout.write(json.dumps(summary) + "\n")
    elif as_json:
        _json_out(summary)
    else:
        _print_summary(summary)


@app.command()
def serve(host: str = "127.0.0.1", port: int = 8000, upgrade_db: bool = typer.Option(True, help="run migrations first")) -> None:
    """Run the API server (OpenAPI docs at /docs)."""
    import uvicorn

    if upgrade_db:
        _upgrade_db()
    uvicorn.run("app.api.main:app", host=host, port=port, log_level="info")


@app.command()
def worker(
    queues: str = typer.Option("gpu,cpu,default", help="queues to consume: a GPU node takes gpu, CPU nodes cpu,default"),
    concurrency: int = typer.Option(1, help="processes; one per GPU on GPU nodes"),
    beat: bool = typer.Option(False, help="also run the (single) beat scheduler in this worker"),
    name: Optional[str] = typer.Option(None, help="node name, e.g. gpu0@%h (default: celery's)"),
) -> None:
    """Run a Celery worker (needs CANARY_BROKER_URL)."""
    if not os.environ.get("CANARY_BROKER_URL"):
        fail("CANARY_BROKER_URL is not set; a worker needs the Redis broker, e.g. redis://127.0.0.1:6379/0")
    cmd = [sys.executable, "-m", "celery", "-A", "workers.celery_app:celery_app", "worker", "-Q", queues,
           "-c", str(concurrency), "--prefetch-multiplier", "1", "-l", "INFO"]
    if name:
        cmd += ["-n", name]
    if beat:
        cmd.append("-B")
    os.execvp(cmd[0], cmd)


@app.command()
def gate(
    candidate: str = typer.Option(..., help="the config to deploy"),
    suite: str = typer.Option(..., help="the suite to run it on"),
    project: str = typer.Option("default", help="project name"),
    baseline: Optional[str] = typer.Option(None, help="the model's baseline config (checked; default: the model's)"),
    samples: Optional[int] = typer.Option(None, help="samples (default: the suite's)"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="wait for the durable verdict"),
    timeout: float = typer.Option(3600, help="seconds to wait before exiting 2"),
    warn_exit_code: int = typer.Option(0, help="exit code for a warn verdict (0 lets the deploy go on, 1 blocks it)"),
    inconclusive: str = typer.Option("warn", help="gate verdict when the data cannot decide: pass, warn or fail"),
    summary_md: Optional[pathlib.Path] = typer.Option(None, help="write a markdown summary (for a PR comment) here"),
    idempotency_key: Optional[str] = typer.Option(None, envvar="CANARY_GATE_KEY",
                                                  help="a retried CI step with the same key gets the same gate (e.g. the commit SHA)"),
    api: str = typer.Option("http://127.0.0.1:8000", envvar="CANARY_API_URL", help="the canary API"),
    api_key: Optional[str] = typer.Option(None, envvar="CANARY_API_KEY", help="a read-write API key"),
    as_json: bool = typer.Option(False, "--json", help="print the gate as JSON"),
) -> None:
    """Pre-deploy gate: exit 0 pass, 1 fail, 2 error; warn exits with --warn-exit-code."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if idempotency_key:
        headers["Idempotency-Key"] = idempotency_key
    body = {"candidate": candidate, "suite": suite, "baseline": baseline, "samples": samples, "inconclusive": inconclusive}
    base = f"{api.rstrip('/')}/api/v1/projects/{project}/gates"
    try:
        with httpx.Client(timeout=30, headers=headers) as http:
            r = http.post(base, json={k: v for k, v in body.items() if v is not None})
            if r.status_code >= 400:
                fail(f"gate refused (HTTP {r.status_code}): {_detail(r)}")
            g = r.json()
            started = time.monotonic()
            while wait and g["verdict"] is None:
                if time.monotonic() - started > timeout:
                    _gate_out(g, summary_md, as_json)
                    fail(f"gate {g['gate_id']} has no verdict after {timeout:.0f}s (run {g['run_id']} is {g['run_status']}); "
                         f"it goes on, and the same --idempotency-key picks it up again")
                time.sleep(2)
                r = http.get(f"{base}/{g['gate_id']}")
                if r.status_code >= 400:
                    fail(f"reading gate {g['gate_id']} failed (HTTP {r.status_code}): {_detail(r)}")
                g = r.json()
    except httpx.HTTPError as e:
        fail(f"the canary API at {api} is unreachable ({type(e).__name__}); set --api or CANARY_API_URL")
    _gate_out(g, summary_md, as_json)
    code = {"pass": 0, "fail": 1, "warn": warn_exit_code, "error": 2, None: 0}[g["verdict"]]
    raise typer.Exit(code)


def _detail(r) -> str:
    try:
        d = r.json().get("detail")
        return d if isinstance(d, str) else json.dumps(d)
    except ValueError:
        return r.text[:300]


def _gate_out(g: dict, summary_md, as_json: bool) -> None:
    if summary_md:
        summary_md.write_text(g["summary_markdown"], encoding="utf-8")
    if as_json:
        sys.stdout.write(json.dumps(g) + "\n")
    else:
        console.print(f"gate {g['gate_id']}: [bold]{g['verdict'] or 'pending'}[/] — candidate {g['candidate']} vs "
                      f"{g['baseline']}, run {g['run_id']} ({g['run_status']}); {g['reason'] or ''}", highlight=False)


@app.command("engine-serve", add_help_option=False,  # --help reaches the server's own parser, which lists its options
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def engine_serve(ctx: typer.Context) -> None:
    """Serve the reference engine behind an OpenAI-compatible API with vLLM metric names
    (options: --model, --served-model-name, --weights, --kv-cache, --speculative, --port; see --help)."""
    cmd = [sys.executable, "-m", "workers.engine_server", *ctx.args]
    os.execvp(cmd[0], cmd)


@keys_app.command("create")
def keys_create(project: str = typer.Option(..., help="the project the key opens (created if missing)"),
                name: str = typer.Option("default", help="a label for the key"),
                read_only: bool = typer.Option(False, "--read-only", help="GET only (dashboards); the same as --scope read"),
                scope: Optional[str] = typer.Option(None, help="read | write (default) | metrics (GET /metrics, this project's "
                                                    "figures) | metrics-all (GET /metrics, every project's: an operator's Prometheus)")) -> None:
    """Create a key and print it once (it cannot be shown again)."""
    from app.auth import SCOPES, create_key
    from app.db import session_scope

    if read_only and scope not in (None, "read"):
        fail(f"--read-only and --scope {scope} contradict each other")
    scope = scope or ("read" if read_only else "write")
    if scope not in SCOPES:
        fail(f"--scope must be one of {', '.join(SCOPES)}")
    _upgrade_db()
    with session_scope() as s:
        row, key = create_key(s, project, name, scope)
        key_id, scope = row.id, row.scope
    what = {"read": "read-only", "write": "read-write", "metrics": "/metrics of this project only",
            "metrics-all": "/metrics of every project"}[scope]
    console.print(f"key {key_id} for project '{project}' ({what}); store it now:", highlight=False)
    sys.stdout.write(key + "\n")


@keys_app.command("revoke")
def keys_revoke(key_id: int = typer.Argument(..., help="the key's id (from `canary keys list`)")) -> None:
    """Revoke a key: it stops working at once."""
    from app.auth import revoke_key
    from app.db import session_scope
    from app.repo import NotFound

    try:
        with session_scope() as s:
            revoke_key(s, key_id)
    except NotFound as e:
        fail(str(e))
    console.print(f"key {key_id} revoked")


@keys_app.command("list")
def keys_list(project: str = typer.Option(..., help="project name")) -> None:
    """List a project's keys (id, name, scope, revoked) — never the keys themselves."""
    from sqlalchemy import select

    from app import repo
    from app.db import session_scope
    from app.models import ApiKey

    with session_scope() as s:
        p = repo.get_project(s, project)
        for k in s.scalars(select(ApiKey).where(ApiKey.project_id == p.id).order_by(ApiKey.id)):
            sys.stdout.write(f"{k.id}\t{k.name}\t{k.scope}\t{'revoked ' + k.revoked_at.isoformat() if k.revoked_at else 'active'}\n")


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations up to REVISION."""
    from app.db import upgrade

    upgrade(revision=revision)
    console.print(f"database at revision {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Argument(..., help="target revision, e.g. base")) -> None:
    from app.db import downgrade

    downgrade(revision=revision)


@app.command()
def schema() -> None:
    """Print the JSON Schema of canary.yaml."""
    from app.config_file import json_schema

    sys.stdout.write(json.dumps(json_schema(), indent=2) + "\n")


@app.command("alert-rules")
def alert_rules() -> None:
    """Print the Prometheus alerting rules written from the metric table (deploy/prometheus/canary-rules.yml)."""
    from app.prometheus_rules import render

    sys.stdout.write(render())


def main() -> None:
    app()


if __name__ == "__main__":
    main()
