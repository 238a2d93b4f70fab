"""`canary demo` and `canary run`: a run from a canary.yaml, executed and watched to its verdict."""


from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

if TYPE_CHECKING:
    from app.config_file import CanaryFile
    from app.models import ConfigRun, Run
    from app.schemas import RunOut
from app.cli.base import _ago, _log, app, console, fail
from app.cli.output import _json_out, _print_summary

DEMO_ITEMS = 80  # the demo's labelled items (`canary demo --items`)
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
         # layers: where each config's forward pass starts to drift from the baseline's (layer_drift)
         "scorers": ["perplexity", "generation", "faithfulness", "agreement", "layers", "labelled"],
         # task accuracy and flips: the next word of a held-out docstring against 3 others (vocabulary/labelled.py),
         # 80 items, so that no flip reads ok below task_flips' warn of 5 % (its Wilson high at 0 of 80: 4.6 %)
         "labelled": {"items": "builtin:pydoc-next-word", "max_items": DEMO_ITEMS},
         # dotted names and dunders: the term NLL ratio scores their tokens apart (term_nll_ratio)
         # the first 4 documents also one token per decode step through each lossy KV cache (decode_nll_ratio),
        # the first 8 with every next-token distribution against the baseline's (kld_mean)
        "perplexity": {"window": 256, "stride": 256, "terms": ["builtin:python-identifiers"], "decode_samples": 4,
                       "distribution_samples": 8},
         "generation": {"prompts": 16, "prompt_words": 24, "max_new_tokens": 32},
         # no judge endpoint in the demo: faithfulness runs the labelled offline approximation
         "faithfulness": {"method": "offline"}},
    ],
    # A strict team's perplexity budget (the seed defaults, 1.15 / 1.30, only catch broken
    # configs: a tiny model barely notices int4). Printed with the results.
    "thresholds": {"ppl_ratio": {"warn": 1.01, "critical": 1.03}},
}
# Generation as a server has it: the reference engine decodes DEMO_CONCURRENCY requests together
# (engine_options.concurrency), the baseline's paired pass beside each candidate too. A speculative
# config decodes one request at a time, so its prompts, and the baseline's beside them, go one by one.
DEMO_CONCURRENCY = 4
for _config in DEMO_CONFIG["configs"]:
    if "speculative" not in _config:
        _config["engine_options"] = {**_config.get("engine_options", {}), "concurrency": DEMO_CONCURRENCY}


# How long the demo's run may take with its top-ups (`canary demo --top-up-budget`): the demo's time
# goal (docs/benchmarks.md), so a top-up pass that would not fit it is refused and the verdict says so.
DEMO_TOP_UP_BUDGET_S = 120.0


def demo_top_up_budget(option: float | None, environ: Mapping[str, str]) -> str:
    """The demo's CANARY_TOP_UP_BUDGET_S: --top-up-budget, else the variable where it is set, else
    DEMO_TOP_UP_BUDGET_S (the deployment default, 30 minutes, would let a demo run on for minutes)."""
    if option is not None:
        return str(option)
    return environ.get("CANARY_TOP_UP_BUDGET_S") or str(DEMO_TOP_UP_BUDGET_S)


def _ensure_zoo() -> None:
    from engines.zoo import ARTIFACTS, BUILTIN_MODELS

    if all((ARTIFACTS / m / "model.safetensors").is_file() for m in BUILTIN_MODELS):
        return
    console.print("[yellow]tiny model zoo not found: building it (about 11 minutes on 2 cores)…[/]")
    subprocess.run([sys.executable, "-m", "engines.zoo.build", "--out", str(ARTIFACTS)], check=True)


class RunWatch:
    """How a waiting command shows a run moving. On a terminal: a bar per config with its ETA.
    Without one (CI logs, nohup, `make demo | tee`): one stderr line when the run starts, one per
    config as it finishes, and a heartbeat line whenever `heartbeat` seconds pass without one."""

    def __init__(self, run_id: int, heartbeat: float, bars: bool, clock: Callable[[], float] = time.monotonic):
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

    def __exit__(self, *exc: Any) -> None:  # forwarded to Progress.__exit__ as they came
        self.progress.__exit__(*exc)

    def say(self, line: str) -> None:
        self.last_line = self.clock()
        if not self.bars:
            _log(line)

    def update(self, run: Run) -> None:
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
            self.say(f"run {run.id}: undecided at {self.drawn} samples; topping up to {drawn}: "
                     f"{', '.join(again)} score the samples added")
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
                why = f": {cast(str, config_run.error).splitlines()[0][:200]}" if failed else ""  # failed: an error
                self.say(f"{name} {config_run.status} ({len(self.finished)}/{len(config_runs)} configs done, "
                         f"{_ago(elapsed)} elapsed){why}")
        if self.clock() - self.last_line >= self.heartbeat:
            self.say(self.heartbeat_line(config_runs, elapsed))

    def heartbeat_line(self, config_runs: list[ConfigRun], elapsed: float) -> str:
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


@dataclass(frozen=True)
class Started:
    """A run `canary run` or `canary demo` started: its summary once it ended (None when not waited
    for) and the seconds it waited."""

    run_id: int
    summary: RunOut | None = None
    wall_seconds: float | None = None


def _run_and_wait(canary_file: CanaryFile, suite: str | None, configs: list[str] | None, samples: int | None,
                  as_json: bool, wait: bool, timeout: float = 3600, heartbeat: float = 30,
                  processes: int = 1) -> Started:
    from app import repo
    from app.db import session_scope
    from app.dispatch import Dispatcher, InlineDispatcher, LocalPoolDispatcher, get_dispatcher
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
    dispatcher: InlineDispatcher | LocalPoolDispatcher | Dispatcher = (
        (LocalPoolDispatcher(processes) if processes > 1 else InlineDispatcher(background=True)) if inline
        else get_dispatcher())
    started = time.perf_counter()
    run_id, _ = start_run(canary_file.project, canary_file.suite(suite).name, configs, dispatcher, samples=samples)
    if not wait:
        _warn_if_nothing_executes(run_id, inline)
        return Started(run_id)
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
    if isinstance(dispatcher, (InlineDispatcher, LocalPoolDispatcher)):  # inline: this machine runs the tasks
        dispatcher.drain(60)  # notifications the aggregation queued: let them go out before exiting
    return Started(run_id, summary, round(time.perf_counter() - started, 1))


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
    prompts: int | None = typer.Option(None, min=1, max=1000, help="generation prompts per config (default 16): "
                                                                   "the count the answers' comparisons are over"),
    items: int | None = typer.Option(None, min=1, max=20000, help=f"labelled items per config (default {DEMO_ITEMS}): "
                                                                  "the count task accuracy and flips are over"),
    database_url: str = typer.Option("sqlite:///canary-demo.db",
                                     help="where the demo writes (never CANARY_DATABASE_URL)"),
    wide: bool = typer.Option(False, "--wide", help="every column (TTFT, TBT, weights, acceptance, agreement)"),
    heartbeat: float = typer.Option(30, min=1, help="without a terminal: seconds between progress lines on stderr"),
    processes: int = typer.Option(min(2, os.cpu_count() or 1), min=1, max=64,
                                  help="config-runs at once, each in a process of its own with its share of the cores"),
    top_up_budget: float | None = typer.Option(None, min=0, help=(
        f"seconds the run may take with its top-ups (default: CANARY_TOP_UP_BUDGET_S if set, else "
        f"{DEMO_TOP_UP_BUDGET_S:.0f}): an undecided config is topped up only while another pass fits; 0: never. "
        "The verdict's decide line says how to settle what is left undecided")),
) -> None:
    """fp16 vs int8 vs int4 vs int2 … on the tiny Python-documentation model, on this machine. Exits 0
    whatever the verdict: some of its configs are broken on purpose."""
    # The demo never follows CANARY_DATABASE_URL: it must not write into a production database.
    os.environ["CANARY_DATABASE_URL"] = database_url
    os.environ["CANARY_EXECUTION"] = "inline"
    # the demo answers in minutes: a top-up pass runs only where it fits its budget (workers/top_up.py)
    os.environ["CANARY_TOP_UP_BUDGET_S"] = demo_top_up_budget(top_up_budget, os.environ)
    from app.config_file import parse_config
    from app.settings import get_settings

    get_settings.cache_clear()
    _ensure_zoo()
    _upgrade_db()
    suite = {**DEMO_CONFIG["suites"][0], "samples": samples}
    if prompts is not None:
        suite["generation"] = {**suite["generation"], "prompts": prompts}
    if items is not None:
        suite["labelled"] = {**suite["labelled"], "max_items": items}
    canary_file = parse_config({**DEMO_CONFIG, "suites": [suite]}, "demo config")
    try:
        done = _run_and_wait(canary_file, None, None, None, as_json, wait=True, heartbeat=heartbeat,
                             processes=processes)
    except ValueError as e:
        fail(str(e))
    assert done.summary is not None  # waited for
    if as_json:
        _json_out(done.summary, done.wall_seconds)
    else:
        _print_summary(done.summary, wide)
        for line in _open_it(database_url):
            console.print(line, highlight=False, soft_wrap=True)


def _open_it(database_url: str) -> list[str]:
    """How to look at the demo's run: one command that starts the API on its database and the
    dashboard on the API; absolute paths, so it works from any folder and without the virtual
    environment on the PATH."""
    import shlex

    url = database_url
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        url = "sqlite:///" + os.path.abspath(url.removeprefix("sqlite:///"))
    canary = os.path.join(os.path.dirname(sys.executable), "canary")
    return [f"open it: CANARY_DATABASE_URL={shlex.quote(url)} {shlex.quote(canary)} serve --dashboard",
            "   then: http://127.0.0.1:8501/?project=demo (the API: http://127.0.0.1:8000/docs)"]


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
    processes: int = typer.Option(1, min=1, max=64, help="on the embedded default (no broker): config-runs at once, "
                                                         "each in a process of its own with its share of the cores"),
) -> None:
    """Apply a config file and run a suite over its configs. Exit 0 on pass (and on warn or
    inconclusive unless --fail-on warn), 1 on fail or incomplete, 2 when it cannot run."""
    from app.config_file import ConfigFileError
    from app.config_yaml import load_config_file
    from app.corpus import CorpusError
    from app.repo import NotFound

    if fail_on not in FAIL_ON:
        fail(f"--fail-on must be one of {', '.join(FAIL_ON)}, not '{fail_on}'")
    try:
        canary_file = load_config_file(file)
        _upgrade_db()
        names = configs.split(",") if configs else None
        done = _run_and_wait(canary_file, suite, names, samples, as_json, wait, timeout, heartbeat, processes)
    except (ConfigFileError, CorpusError, NotFound, ValueError) as e:
        fail(str(e))
    if done.summary is None:  # --no-wait
        sys.stdout.write(json.dumps({"run_id": done.run_id, "status": "queued"}) + "\n")
        return
    if as_json:
        _json_out(done.summary, done.wall_seconds)
    else:
        _print_summary(done.summary, wide)
    raise typer.Exit(run_exit_code(done.summary.verdict, fail_on))
