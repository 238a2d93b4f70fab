"""`canary` command line: demo, serve, worker, run, db, schema."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from app.ssrf import hide_url_logs

if TYPE_CHECKING:
    from app.config_file import CanaryFile

hide_url_logs()

# the terminal colour of a verdict (comparisons) or a run verdict / config-run status
VERDICT_COLORS = {"ok": "green", "pass": "green", "warn": "yellow", "critical": "red", "fail": "red", "failed": "red",
                  "inconclusive": "magenta", "measurement_error": "magenta", "incomplete": "magenta", "error": "red"}

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="inference-canary: quality canary for optimized LLM inference.")
db_app = typer.Typer(no_args_is_help=True, help="Database migrations.")
keys_app = typer.Typer(no_args_is_help=True, help="API keys (scoped to a project; only a hash is stored).")
runs_app = typer.Typer(no_args_is_help=True, help="Read runs: list, show.")
alerts_app = typer.Typer(no_args_is_help=True, help="Read alerts: list.")
gates_app = typer.Typer(no_args_is_help=True, help="Read CI gates: list, show.")
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(runs_app, name="runs")
app.add_typer(alerts_app, name="alerts")
app.add_typer(gates_app, name="gates")
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


def fail(msg: str, code: int = 2) -> NoReturn:
    console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _ensure_zoo() -> None:
    from engines.zoo import ARTIFACTS, BUILTIN_MODELS

    if all((ARTIFACTS / m / "model.safetensors").is_file() for m in BUILTIN_MODELS):
        return
    console.print("[yellow]tiny model zoo not found: building it (about 11 minutes on 2 cores)…[/]")
    subprocess.run([sys.executable, "-m", "engines.zoo.build", "--out", str(ARTIFACTS)], check=True)


def _ago(seconds: float) -> str:
    """A duration as a person reads it in a log: 42s, 3m05s, 1h02m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _log(line: str) -> None:
    sys.stderr.write(f"canary: {line}\n")
    sys.stderr.flush()


class RunWatch:
    """How a waiting command shows a run moving. On a terminal: a bar per config with its ETA.
    Without one (CI logs, nohup, `make demo | tee`): one stderr line when the run starts, one per
    config as it finishes, and a heartbeat line whenever `heartbeat` seconds pass without one."""

    def __init__(self, run_id: int, heartbeat: float, bars: bool, clock=time.monotonic):
        self.run_id, self.heartbeat, self.bars, self.clock = run_id, heartbeat, bars, clock
        self.progress = Progress(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=not bars,
                                 transient=False)
        self.tasks: dict[str, Any] = {}
        self.finished: set[str] = set()
        self.started = self.last_line = clock()
        self.announced = False
        self.drawn = 0  # the run's samples when last seen: more after a top-up (workers/top_up.py)
        self.passes: dict[str, int] = {}  # each config-run's attempt_base: a top-up's rerun moves it

    def __enter__(self) -> RunWatch:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def say(self, line: str) -> None:
        self.last_line = self.clock()
        if not self.bars:
            _log(line)

    def update(self, run) -> None:
        config_runs = list(run.config_runs)
        elapsed = self.clock() - self.started
        if not self.announced:
            self.announced = True
            self.say(f"run {run.id} started: {len(config_runs)} configs, {run.n_samples} samples each; "
                     f"a line per finished config, a heartbeat every {self.heartbeat:.0f}s")
        drawn = len(run.sample_keys)
        if self.drawn and drawn > self.drawn:  # undecided: the baseline and the undecided configs run again
            again = [cr.config.name for cr in config_runs
                     if self.passes.get(cr.config.name, cr.attempt_base) != cr.attempt_base]
            self.finished -= set(again)
            self.say(f"run {run.id}: undecided at {self.drawn} samples; topping up to {drawn} and rerunning "
                     f"{', '.join(again)}")
        self.drawn, self.passes = drawn, {cr.config.name: cr.attempt_base for cr in config_runs}
        for config_run in config_runs:
            name = config_run.config.name
            if self.bars:
                if name not in self.tasks:
                    self.tasks[name] = self.progress.add_task(name, total=None)
                self.progress.update(self.tasks[name], completed=config_run.progress_done,
                                     total=config_run.progress_total or None)
            if config_run.status in ("succeeded", "failed") and name not in self.finished:
                self.finished.add(name)
                failed = config_run.status == "failed" and config_run.error
                why = f": {config_run.error.splitlines()[0][:200]}" if failed else ""
                self.say(f"{name} {config_run.status} ({len(self.finished)}/{len(config_runs)} configs done, "
                         f"{_ago(elapsed)} elapsed){why}")
        if self.clock() - self.last_line >= self.heartbeat:
            self.say(self.heartbeat_line(config_runs, elapsed))

    def heartbeat_line(self, config_runs, elapsed: float) -> str:
        """`run 7 running: 1/3 configs done; int8 40/100; 1m30s elapsed, about 2m15s left`. The
        estimate counts a config's progress as the fraction of its items done."""
        done = sum(1.0 if config_run.status in ("succeeded", "failed") else
                   (config_run.progress_done / config_run.progress_total if config_run.progress_total else 0.0)
                   for config_run in config_runs)
        moving = [f"{config_run.config.name} {config_run.progress_done}/{config_run.progress_total}"
                  for config_run in config_runs if config_run.status == "running" and config_run.progress_total]
        left = f", about {_ago(elapsed * (len(config_runs) - done) / done)} left" if done > 0 else ""
        return (f"run {self.run_id} running: {len(self.finished)}/{len(config_runs)} configs done"
                f"{'; ' + ', '.join(moving) if moving else ''}; {_ago(elapsed)} elapsed{left}")


def _warn_if_nothing_executes(run_id: int, inline: bool) -> None:
    """--no-wait queues a run and exits: say so when nothing will execute it."""
    if inline:
        _log(f"warning: run {run_id} is queued, but on the embedded default (no CANARY_BROKER_URL) tasks run "
             f"inside the command that queued them, and this one exits now; `canary serve` on the same database "
             f"picks queued runs up (its reconciler, within a few minutes), or drop --no-wait")
        return
    from app.dispatch import CeleryDispatcher
    from app.settings import get_settings

    try:
        answered = CeleryDispatcher(get_settings()).client.control.ping(timeout=2.0)
    except Exception as e:  # noqa: BLE001 - a failed ping is a warning, not an error: the run is queued
        answered, why = [], f" ({type(e).__name__})"
    else:
        why = ""
    if not answered:
        _log(f"warning: run {run_id} is queued, but no Celery worker answered a ping on the broker{why}; "
             f"it waits until `canary worker` runs")


def _upgrade_db() -> None:
    from app.db import upgrade

    upgrade()


def _run_and_wait(canary_file: CanaryFile, suite: str | None, configs: list[str] | None, samples: int | None,
                  as_json: bool, wait: bool, timeout: float = 3600, heartbeat: float = 30) -> dict:
    from app import repo
    from app.db import session_scope
    from app.dispatch import InlineDispatcher, get_dispatcher
    from app.services import apply_config_file, run_summary, start_run
    from app.settings import get_settings

    inline = get_settings().execution_mode == "inline"
    if not inline:  # a broker that cannot be reached is an error now, not a run that waits forever
        from kombu import Connection

        with Connection(get_settings().broker_url, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1, timeout=3)
    with session_scope() as session:
        apply_config_file(session, canary_file)
    if inline:
        # a one-shot CLI run ends with its run: escalation runs belong to a running service
        # (canary serve, or workers), so this process does not start them
        os.environ["CANARY_ESCALATION"] = "false"
        get_settings.cache_clear()
    dispatcher = InlineDispatcher(background=True) if inline else get_dispatcher()
    started = time.perf_counter()
    run_id, _ = start_run(canary_file.project, canary_file.suite(suite).name, configs, dispatcher, samples=samples)
    if not wait:
        _warn_if_nothing_executes(run_id, inline)
        return {"run_id": run_id, "status": "queued"}
    watch = RunWatch(run_id, heartbeat, bars=console.is_terminal and not as_json)
    with watch:
        while True:
            with session_scope() as session:
                run = repo.get_run(session, repo.get_project(session, canary_file.project), run_id)
                watch.update(run)
                if run.status in ("done", "failed"):
                    summary = run_summary(session, run)
                    break
                if time.perf_counter() - started > timeout:
                    fail(f"run {run_id} is still {run.status} after {timeout:.0f}s; is a worker consuming the gpu "
                         f"queue? (`canary worker`); the run goes on and "
                         f"GET /api/v1/projects/{canary_file.project}/runs/{run_id} shows it")
            time.sleep(0.5)
    if isinstance(dispatcher, InlineDispatcher):  # inline: this process runs the tasks
        dispatcher.drain(60)  # notifications the aggregation queued: let them go out before exiting
    summary["wall_seconds"] = round(time.perf_counter() - started, 1)
    return summary


def metric_cell(comp: dict | None) -> str:
    if comp is None or comp["estimate"] is None:
        return "—" if comp is None else f"[magenta]{comp['verdict']}[/]"
    color = VERDICT_COLORS.get(comp["verdict"], "white")
    return f"[{color}]{comp['estimate']:.2f}[/]"


def worst_comparison(comparisons: list[dict]) -> dict | None:
    """The config's comparison that decides its standing: the worst verdict among its gated
    metrics (informational ones never decide), ppl_ratio first among equals."""
    from evals.metrics import METRICS, VERDICT_ORDER

    gated = [comparison for comparison in comparisons if comparison["metric"] in METRICS
             and METRICS[comparison["metric"]].gated and comparison["verdict"] in VERDICT_ORDER]
    return max(gated, key=lambda comparison: (VERDICT_ORDER[comparison["verdict"]],
                                              comparison["metric"] == "ppl_ratio"), default=None)


def layers_under_their_config(configs: list[dict]) -> list[dict]:
    """The run's configs in order, each stacked config's ablations (step back) right under it."""
    layers: dict[str, list[dict]] = {}
    for config in configs:
        if config.get("ablation_of"):
            layers.setdefault(config["ablation_of"], []).append(config)
    ordered = []
    for config in configs:
        if not config.get("ablation_of"):
            ordered += [config, *layers.pop(config["config"], [])]
    return ordered + [config for rest in layers.values() for config in rest]  # a layer whose config is not listed


def _print_summary(summary: dict, wide: bool = False) -> None:
    """The run's table on stdout. By default five columns that fit an 80-column terminal: config,
    perplexity ratio with its CI, the config's worst verdict (naming the metric when it is not
    the ratio), tok/s and KV bytes per token; --wide adds weights, KV cache, speculative settings,
    TTFT/TBT, weight MB, acceptance, faithfulness, exact match and top-1 agreement."""
    from app.services import samples_label

    out = Console(width=None if Console().is_terminal else (250 if wide else 120))
    comparisons = {(comparison["config"], comparison["metric"]): comparison for comparison in summary["comparisons"]}
    table = Table(title=f"run {summary['run_id']} — baseline {summary['baseline']}, {samples_label(summary)}")
    cols = ["config", "ppl ratio [95% CI]", "verdict", "tok/s", "KV B/token"]
    if wide:
        cols[1:2] = ["weights", "kv cache", "speculative", "token ppl", "ppl ratio", "95% CI"]
        cols += ["TTFT p50 ms", "TBT p50 ms", "weights MB", "accept", "faithful", "exact match", "top-1"]
    for col in cols:
        left = col in ("config", "weights", "kv cache", "speculative", "verdict")
        table.add_column(col, justify="left" if left else "right")
    failures = []
    for config in layers_under_their_config(summary["configs"]):
        figures = summary["figures"].get(config["config"]) or {}
        ppl = comparisons.get((config["config"], "ppl_ratio"))
        is_base = config["config"] == summary["baseline"]
        ratio = f"{ppl['estimate']:.4f}" if ppl and ppl["estimate"] is not None else ("baseline" if is_base else "—")
        ci = f"[{ppl['ci_low']:.4f}, {ppl['ci_high']:.4f}]" if ppl and ppl["ci_low"] is not None else ""
        worst = worst_comparison([comparison for comparison in summary["comparisons"]
                                  if comparison["config"] == config["config"]])
        quiet = is_base or config["status"] == "succeeded"  # no comparison: a baseline, or nothing to judge
        verdict = worst["verdict"] if worst else ("" if quiet else config["status"])
        color = VERDICT_COLORS.get(verdict, "white")
        because = f" ({worst['metric']})" if worst and worst["metric"] != "ppl_ratio" and verdict != "ok" else ""

        def fmt(key: str, fmt_spec: str, figures: dict = figures) -> str:
            return format(figures[key], fmt_spec) if figures.get(key) is not None else "—"

        # a stacked config's single-optimization ablation (step back): a diagnosis under its config
        row = [f"  └ {config['ablation_axis']} alone" if config.get("ablation_of") else config["config"]]
        if wide:
            speculative = config["spec"].get("speculative", {})
            spec_label = ("off" if speculative.get("method", "off") == "off"
                          else f"{speculative['method']} k={speculative.get('k')}")
            row += [config["spec"]["weights"], figures.get("kv_cache") or config["spec"].get("kv_cache", ""),
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
                    *(metric_cell(comparisons.get((config["config"], metric)))
                      for metric in ("faithfulness", "exact_match", "top1_agreement"))]
        table.add_row(*row)
        if config["error"]:
            failures.append(f"{config['config']}: {config['error']}")
    out.print(table)
    for line in failures:
        out.print(f"[red]failed[/] {escape(line)}", highlight=False)
    methods = {comparison.get("details", {}).get("method")
               for comparison in summary["comparisons"] if comparison["metric"] == "faithfulness"} - {None}
    for method in methods:
        out.print(f"faithfulness: {method}", highlight=False)
    if not wide:
        out.print("more columns (TTFT, TBT, weights, acceptance, faithfulness, exact match): --wide; "
                  "every figure: --json",
                  highlight=False, style="dim")
    _print_verdict(out, summary, wide)


def _print_verdict(out: Console, summary: dict, wide: bool) -> None:
    """The verdict for people (app/summary.py): a line per breaching config, grouped, worst first;
    the stored reason (every finding with its rule) with --wide, or when there is no line to show."""
    lines = (summary.get("summary") or {}).get("lines") or []
    reason = escape(summary["verdict_reason"] or "")
    if not lines:
        out.print(f"verdict: [bold]{summary['verdict']}[/] — {reason}", highlight=False)
        return
    out.print(f"verdict: [bold]{summary['verdict']}[/]", highlight=False)
    for line in lines:
        out.print(escape(line), highlight=False, soft_wrap=True)
    if wide:
        out.print(f"every finding: {reason}", highlight=False)


def _json_out(summary: dict) -> None:
    keep = {"run_id", "status", "verdict", "verdict_reason", "baseline", "comparisons", "figures", "wall_seconds",
            "configs", "summary"}
    out = {k: v for k, v in summary.items() if k in keep}
    fields = ("config", "metric", "estimate", "ci_low", "ci_high", "n", "verdict", "rule", "details")
    out["comparisons"] = [{k: comparison[k] for k in fields}
                          for comparison in summary["comparisons"]]
    sys.stdout.write(json.dumps(out) + "\n")


FAIL_ON = ("fail", "warn", "never")


def run_exit_code(verdict: str | None, fail_on: str = "fail") -> int:
    """`canary run`'s exit status for a run verdict: 1 for fail, incomplete and error (the run
    cannot vouch for the configs); warn and inconclusive exit 1 only with --fail-on warn;
    --fail-on never always exits 0. Exit 2 is kept for a command that could not run."""
    if fail_on == "never" or verdict == "pass":
        return 0
    if verdict in ("warn", "inconclusive"):
        return 1 if fail_on == "warn" else 0
    return 1


@app.command()
def demo(
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
    samples: int = typer.Option(100, min=1, help="held-out documents scored per config"),
    database_url: str = typer.Option("sqlite:///canary-demo.db",
                                     help="where the demo writes (never CANARY_DATABASE_URL)"),
    wide: bool = typer.Option(False, "--wide", help="every column (TTFT, TBT, weights, acceptance, agreement)"),
    heartbeat: float = typer.Option(30, min=1, help="without a terminal: seconds between progress lines on stderr"),
) -> None:
    """fp16 vs int8 vs int4 vs int2 … on the tiny Python-documentation model, in-process. Exits 0
    whatever the verdict: some of its configs are broken on purpose."""
    # The demo never follows CANARY_DATABASE_URL: it must not write into a production database.
    os.environ["CANARY_DATABASE_URL"] = database_url
    os.environ["CANARY_EXECUTION"] = "inline"
    from app.config_file import parse_config
    from app.settings import get_settings

    get_settings.cache_clear()
    _ensure_zoo()
    _upgrade_db()
    canary_file = parse_config({**DEMO_CONFIG, "suites": [{**DEMO_CONFIG["suites"][0], "samples": samples}]},
                               "demo config")
    try:
        summary = _run_and_wait(canary_file, None, None, None, as_json, wait=True, heartbeat=heartbeat)
    except ValueError as e:
        fail(str(e))
    if as_json:
        _json_out(summary)
    else:
        _print_summary(summary, wide)
        console.print(f"browse it: CANARY_DATABASE_URL={database_url} canary serve  →  http://127.0.0.1:8000/docs",
                      highlight=False, soft_wrap=True)


@app.command()
def run(
    file: str = typer.Option("canary.yaml", "-f", "--file", help="config file"),
    suite: str | None = typer.Option(None, help="suite name (default: the file's first suite)"),
    configs: str | None = typer.Option(None, help="comma-separated config names (default: all; the baseline is "
                                                  "always included)"),
    samples: int | None = typer.Option(None, min=1, help="override the suite's sample count"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    wait: bool = typer.Option(True, help="wait for the verdict"),
    timeout: float = typer.Option(3600, help="seconds to wait for the verdict"),
    fail_on: str = typer.Option("fail", help="the lowest run verdict that exits 1: fail, warn (also inconclusive) "
                                             "or never"),
    wide: bool = typer.Option(False, "--wide", help="every column (TTFT, TBT, weights, acceptance, agreement)"),
    heartbeat: float = typer.Option(30, min=1, help="without a terminal: seconds between progress lines on stderr"),
) -> None:
    """Apply a config file and run a suite over its configs. Exit 0 on pass (and on warn or
    inconclusive unless --fail-on warn), 1 on fail or incomplete, 2 when it cannot run."""
    from app.config_file import ConfigFileError, load_config_file
    from app.corpus import CorpusError
    from app.repo import NotFound

    if fail_on not in FAIL_ON:
        fail(f"--fail-on must be one of {', '.join(FAIL_ON)}, not '{fail_on}'")
    try:
        canary_file = load_config_file(file)
        _upgrade_db()
        names = configs.split(",") if configs else None
        summary = _run_and_wait(canary_file, suite, names, samples, as_json, wait, timeout, heartbeat)
    except (ConfigFileError, CorpusError, NotFound, ValueError) as e:
        fail(str(e))
    if not wait:
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    if as_json:
        _json_out(summary)
    else:
        _print_summary(summary, wide)
    raise typer.Exit(run_exit_code(summary["verdict"], fail_on))


@app.command()
def serve(host: str = "127.0.0.1", port: int = 8000,
          upgrade_db: bool = typer.Option(True, help="run migrations first"),
          workers: int = typer.Option(1, min=1, max=64, help="API processes (with Celery only: the embedded "
                                                             "default runs its tasks in the one process)")) -> None:
    """Run the API server (OpenAPI docs at /docs)."""
    import uvicorn

    from app.settings import get_settings

    if workers > 1 and get_settings().execution_mode != "celery":
        fail("--workers: more than one API process needs Celery (set CANARY_BROKER_URL); the embedded default "
             "runs tasks inside the one API process")
    if upgrade_db:
        _upgrade_db()
    # X-Forwarded-For is taken only from the proxies named (uvicorn would trust loopback by
    # default, so any local client could pick its own address); FORWARDED_ALLOW_IPS, uvicorn's own
    # variable, is still read when the setting is empty
    proxies = get_settings().forwarded_allow_ips.strip() or os.environ.get("FORWARDED_ALLOW_IPS", "").strip()
    uvicorn.run("app.api.main:app", host=host, port=port, log_level="info", workers=workers,
                proxy_headers=bool(proxies), forwarded_allow_ips=proxies or None)


@app.command()
def worker(
    queues: str = typer.Option("gpu,cpu,default,notify",
                               help="queues to consume: a GPU node takes gpu, CPU nodes cpu,default, the "
                                    "notifier (with the beat) default,notify"),
    concurrency: int = typer.Option(1, help="processes; one per GPU on GPU nodes"),
    beat: bool = typer.Option(False, help="also run the (single) beat scheduler in this worker"),
    beat_schedule: str | None = typer.Option(None, help="with --beat: the file where beat keeps its last run times "
                                             "(default: celerybeat-schedule in the working directory)"),
    name: str | None = typer.Option(None, help="node name, e.g. gpu0@%h (default: celery's)"),
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
        if beat_schedule:
            cmd += ["-s", beat_schedule]
    os.execvp(cmd[0], cmd)


@app.command()
def gate(
    candidate: str = typer.Option(..., help="the config to deploy"),
    suite: str = typer.Option(..., help="the suite to run it on"),
    project: str = typer.Option("default", help="project name"),
    baseline: str | None = typer.Option(None, help="the model's baseline config (checked; default: the model's)"),
    samples: int | None = typer.Option(None, help="samples (default: the suite's)"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="wait for the durable verdict"),
    timeout: float = typer.Option(3600, help="seconds to wait for a verdict before exiting with --error-exit-code"),
    warn_exit_code: int = typer.Option(0, help="exit code for a warn verdict (0 lets the deploy go on, 1 blocks it)"),
    error_exit_code: int = typer.Option(2, help="exit code when the gate cannot decide: an error verdict, a 5xx, "
                                        "or --timeout (0 lets the deploy go on)"),
    unreachable_exit_code: int = typer.Option(3, help="exit code when the canary API cannot be reached at all (the "
                                              "canary itself is down, past --retry-for): apart from an error verdict, "
                                              "so CI can tell a broken canary from a broken config"),
    inconclusive: str = typer.Option("warn", help="gate verdict when the data cannot decide: pass, warn or fail"),
    summary_md: pathlib.Path | None = typer.Option(None, help="write a markdown summary (for a PR comment) here; "
                                                      "with $GITHUB_STEP_SUMMARY set it is also appended there"),
    report_html: pathlib.Path | None = typer.Option(None, help="once decided, write the run's report here: one "
                                                       "self-contained HTML file (`canary report`), a CI artifact"),
    idempotency_key: str | None = typer.Option(None, envvar="CANARY_GATE_KEY",
                                                  help="a retried CI step with the same key gets the same gate "
                                                       "(e.g. the commit SHA)"),
    heartbeat: float = typer.Option(30, min=1, help="seconds between 'still waiting' lines on stderr"),
    retry_for: float = typer.Option(600, min=0, help="seconds a poll keeps retrying (with backoff) through connection "
                                    "errors and 5xx answers, e.g. while the API restarts"),
    api: str = typer.Option("http://127.0.0.1:8000", envvar="CANARY_API_URL", help="the canary API"),
    api_key: str | None = typer.Option(None, envvar="CANARY_API_KEY", help="a read-write API key"),
    as_json: bool = typer.Option(False, "--json", help="print the gate as JSON"),
) -> None:
    """Pre-deploy gate: exit 0 pass, 1 fail, 2 bad request; warn exits with --warn-exit-code, an
    undecidable gate (error verdict, 5xx, timeout) with --error-exit-code, an API that cannot be
    reached with --unreachable-exit-code (3)."""
    import uuid

    import httpx

    # the key makes the POST safe to retry: without one, a retried POST would start a second gate
    headers = {"Idempotency-Key": idempotency_key or f"cli-{uuid.uuid4()}"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    body = {"candidate": candidate, "suite": suite, "baseline": baseline, "samples": samples,
            "inconclusive": inconclusive}
    base = f"{api.rstrip('/')}/api/v1/projects/{project}/gates"
    started = last_line = time.monotonic()
    with httpx.Client(timeout=30, headers=headers) as http:
        for _ in range(3):
            try:
                response = _call(http, "POST", base, min(retry_for, 15),
                                 json={name: value for name, value in body.items() if value is not None})
            except httpx.TransportError as e:
                fail(f"the canary API at {api} is unreachable ({type(e).__name__}); set --api or CANARY_API_URL",
                     unreachable_exit_code)
            # an API from before concurrent retries were answered with the first gate says 409 "written
            # concurrently" to the losers of the race: the key makes asking again safe
            if response.status_code != 409 or "written concurrently" not in _detail(response):
                break
            time.sleep(0.5)
        if response.status_code >= 500:
            fail(f"the canary API failed to start the gate (HTTP {response.status_code}): {_detail(response)}",
                 error_exit_code)
        if response.status_code >= 400:
            fail(f"gate refused (HTTP {response.status_code}): {_detail(response)}")
        gate = response.json()
        _log(f"gate {gate['gate_id']}: {candidate} vs {gate['baseline']} on suite {suite}, run {gate['run_id']}"
             + ("; waiting for the verdict" if wait and gate["verdict"] is None else ""))
        while wait and gate["verdict"] is None:
            now = time.monotonic()
            if now - started > timeout:
                _gate_out(gate, summary_md, as_json, step_summary=True)
                fail(f"gate {gate['gate_id']} has no verdict after {timeout:.0f}s (run {gate['run_id']} is "
                     f"{gate['run_status']}); it goes on, and the same --idempotency-key picks it up again",
                     error_exit_code)
            if now - last_line >= heartbeat:
                last_line = now
                _log(f"gate {gate['gate_id']} still waiting: run {gate['run_id']} is {gate['run_status']}, "
                     f"{_ago(now - started)} elapsed")
            time.sleep(min(_poll_interval(now - started), heartbeat))
            try:
                response = _call(http, "GET", f"{base}/{gate['gate_id']}", retry_for)
            except httpx.TransportError as e:
                fail(f"the canary API at {api} stayed unreachable for {retry_for:.0f}s ({type(e).__name__}); gate "
                     f"{gate['gate_id']} goes on, and the same --idempotency-key picks it up again",
                     unreachable_exit_code)
            if response.status_code >= 400:
                fail(f"reading gate {gate['gate_id']} failed (HTTP {response.status_code}): {_detail(response)}",
                     error_exit_code if response.status_code >= 500 else 2)
            gate = response.json()
        if report_html and gate["verdict"] is not None:  # the run's report, a CI artifact beside the summary
            response = _call(http, "GET", f"{api.rstrip('/')}/api/v1/projects/{project}/runs/{gate['run_id']}/report",
                             min(retry_for, 60))
            if response.status_code == 200:
                report_html.write_text(response.text, encoding="utf-8")
            else:
                _log(f"the run's report could not be read (HTTP {response.status_code}): {_detail(response)}")
    _gate_out(gate, summary_md, as_json, step_summary=True)
    raise typer.Exit({"pass": 0, "fail": 1, "warn": warn_exit_code, "error": error_exit_code, None: 0}[gate["verdict"]])


def _poll_interval(elapsed: float) -> float:
    """Seconds between a waiting gate's polls: 0.25 s for its first 10 s (a smoke gate's verdict
    comes within seconds), 1 s up to a minute, then 2 s."""
    return 0.25 if elapsed < 10 else 1.0 if elapsed < 60 else 2.0


def _call(http, method: str, url: str, retry_for: float, **kw):
    """One API request, retried with exponential backoff (1, 2, 4 … 30 s) through connection
    errors and 5xx answers for up to retry_for seconds; the last answer (or error) is the result."""
    import httpx

    deadline, delay = time.monotonic() + retry_for, 1.0
    while True:
        try:
            response = http.request(method, url, **kw)
            if response.status_code < 500:
                return response
            why = f"HTTP {response.status_code}"
        except httpx.TransportError as e:
            if time.monotonic() + delay > deadline:
                raise
            why = type(e).__name__
        else:
            if time.monotonic() + delay > deadline:
                return response
        _log(f"{method} {url} failed ({why}); retrying in {delay:.0f}s")
        time.sleep(delay)
        delay = min(delay * 2, 30.0)


def _detail(response) -> str:
    try:
        detail = response.json().get("detail")
        return detail if isinstance(detail, str) else json.dumps(detail)
    except ValueError:
        return response.text[:300]


def _gate_out(g: dict, summary_md, as_json: bool, step_summary: bool = False) -> None:
    if summary_md:
        summary_md.write_text(g["summary_markdown"], encoding="utf-8")
    if step_summary and os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as f:  # GitHub Actions' job summary
            f.write(g["summary_markdown"].rstrip("\n") + "\n\n")
    if as_json:
        sys.stdout.write(json.dumps(g) + "\n")
    else:
        console.print(f"gate {g['gate_id']}: [bold]{g['verdict'] or 'pending'}[/] — candidate {g['candidate']} vs "
                      f"{g['baseline']}, run {g['run_id']} ({g['run_status']}); {escape(g['reason'] or '')}",
                      highlight=False, soft_wrap=True)


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
                read_only: bool = typer.Option(False, "--read-only",
                                               help="GET only (dashboards); the same as --scope read"),
                scope: str | None = typer.Option(None, help="read | write (default) | metrics (GET /metrics, this "
                                                 "project's figures) | metrics-all (GET /metrics, every project's: "
                                                 "an operator's Prometheus)")) -> None:
    """Create a key and print it once (it cannot be shown again)."""
    from app.auth import SCOPES, create_key
    from app.db import session_scope

    if read_only and scope not in (None, "read"):
        fail(f"--read-only and --scope {scope} contradict each other")
    scope = scope or ("read" if read_only else "write")
    if scope not in SCOPES:
        fail(f"--scope must be one of {', '.join(SCOPES)}")
    from app.config_file import name_problem

    if problem := name_problem(project):
        fail(f"--project {problem}")
    _upgrade_db()
    with session_scope() as session:
        row, key = create_key(session, project, name, scope)
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
        with session_scope() as session:
            revoke_key(session, key_id)
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

    with session_scope() as session:
        project_row = repo.get_project(session, project)
        keys = session.scalars(select(ApiKey).where(ApiKey.project_id == project_row.id).order_by(ApiKey.id))
        for api_key in keys:
            state = "revoked " + api_key.revoked_at.isoformat() if api_key.revoked_at else "active"
            sys.stdout.write(f"{api_key.id}\t{api_key.name}\t{api_key.scope}\t{state}\n")


PROJECT = typer.Option("default", "--project", "-p", envvar="CANARY_PROJECT", help="project name")
AS_JSON = typer.Option(False, "--json", help="print JSON on stdout instead of a table")


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(escape(str(cell)) if cell is not None else "—" for cell in row))
    Console(width=None if Console().is_terminal else 160).print(table)


def _when(iso: str | None) -> str:
    return iso[:19].replace("T", " ") if iso else "—"


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
        sys.stdout.write(json.dumps(summary) + "\n")
    elif summary["status"] != "done":
        console.print(f"run {run_id} is {summary['status']}: " + ", ".join(
            f"{config['config']} {config['status']} {config['progress']['done']}/{config['progress']['total']}"
            for config in summary["configs"]),
            highlight=False)
    else:
        _print_summary(summary, wide)


@app.command()
def report(run_id: int = typer.Argument(..., help="the run's id (from `canary runs list`)"), project: str = PROJECT,
           output: pathlib.Path | None = typer.Option(None, "--output", "-o",
                                                      help="the HTML file to write (default: canary-run-RUN.html)")
           ) -> None:
    """One run's report to share: a self-contained HTML file (the verdict summary, every comparison
    with its CI, quality vs speed, the worst documents per candidate, the field signals) that opens
    offline in any browser."""
    from app import repo
    from app import report as reports
    from app.db import session_scope

    path = output or pathlib.Path(f"canary-run-{run_id}.html")
    try:
        with session_scope() as session:
            proj = repo.get_project(session, project)
            html = reports.build(session, proj, repo.get_run(session, proj, run_id))
        path.write_text(html, encoding="utf-8")
    except repo.NotFound as e:
        fail(str(e))
    except OSError as e:
        fail(f"--output: cannot write {path}: {e.strerror or e}")
    console.print(f"report of run {run_id} written to {path} ({len(html.encode()) // 1024} KB)", highlight=False)


@runs_app.command("cancel")
def runs_cancel(run_id: int = typer.Argument(..., help="the run's id (from `canary runs list`)"),
                project: str = PROJECT) -> None:
    """Stop a queued or running run: its unfinished configs end cancelled, with nothing of theirs
    kept; a gate on it decides `error`. Exit 2 when it has already ended."""
    import getpass

    from app import repo
    from app.db import session_scope

    try:
        with session_scope() as session:
            run = repo.cancel_run(session, repo.get_project(session, project), run_id, f"{getpass.getuser()} (CLI)")
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
    from app.api.routes.alerting import list_alerts
    from app.db import session_scope

    if state not in (None, "pending", "firing", "resolved", "inactive"):
        fail(f"--state must be pending, firing or resolved, not '{state}'")
    with session_scope() as session:
        items = list_alerts(repo.get_project(session, project), session, state=state, limit=limit,
                            inhibited=inhibited)
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
    from app.api.routes.gates import list_gates
    from app.db import session_scope

    with session_scope() as session:
        items = list_gates(repo.get_project(session, project), session, limit=limit)
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
    from app.api.routes.gates import get_gate
    from app.db import session_scope

    with session_scope() as session:
        gate = get_gate(gate_id, repo.get_project(session, project), session)
    if as_json:
        sys.stdout.write(json.dumps(gate) + "\n")
        return
    _gate_out(gate, None, False)
    sys.stdout.write(gate["summary_markdown"] + "\n")


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


@app.callback(invoke_without_command=True)
def _root(version: bool = typer.Option(False, "--version", is_eager=True, help="print the version and exit")) -> None:
    if version:
        from app import __version__

        sys.stdout.write(f"inference-canary {__version__}\n")
        raise typer.Exit(0)


def _service_error(e: BaseException) -> str | None:
    """A one-line message for a database or broker that cannot be reached, else None."""
    from sqlalchemy.exc import InterfaceError, OperationalError

    from app.settings import get_settings

    first = (str(getattr(e, "orig", None) or e).strip().splitlines() or [""])[0][:200]
    if isinstance(e, (OperationalError, InterfaceError)):
        from app.ssrf import mask_userinfo

        where = mask_userinfo(get_settings().database_url)
        return f"the database at {where} is unreachable ({first}); start it, or set CANARY_DATABASE_URL"
    try:
        from kombu.exceptions import OperationalError as BrokerError
    except ImportError:  # kombu comes with celery
        return None
    if isinstance(e, BrokerError):
        from app.ssrf import mask_userinfo

        return (f"the broker at {mask_userinfo(get_settings().broker_url or '')} is unreachable ({first}); "
                f"start Redis, or set CANARY_BROKER_URL (unset: the embedded default runs tasks in-process)")
    return None


def _settings_error(e: Exception) -> str | None:
    """A CANARY_* environment variable that app.settings refuses, named with the fix; else None."""
    from pydantic import ValidationError

    if not isinstance(e, ValidationError) or e.title != "Settings":
        return None
    return "; ".join(f"CANARY_{'_'.join(str(x) for x in err['loc']).upper()}={err.get('input')!r}: {err['msg']} "
                     "(fix the environment variable or unset it for the default)" for err in e.errors())


def main() -> None:
    from app.repo import NotFound

    try:
        app()
    except NotFound as e:  # a project, run, gate or config named on the command line that is not there
        console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except Exception as e:  # a bad setting or an unreachable service is one line; the rest re-raises
        msg = _settings_error(e) or _service_error(e)
        if msg is None:
            raise
        console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
