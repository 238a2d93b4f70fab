"""The `canary` command line's shared parts: the Typer apps, the console (stderr: progress and
tables; --json output alone goes to stdout), errors as one line, and small formatters."""


from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from app.ssrf import hide_url_logs

if TYPE_CHECKING:
    pass

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


tasks_app = typer.Typer(no_args_is_help=True, help="Labelled items for the labelled scorer: import-lm-eval, builtin.")


app.add_typer(tasks_app, name="tasks")


console = Console(stderr=True)  # progress and tables on stderr; --json output alone on stdout


def fail(msg: str, code: int = 2) -> NoReturn:
    console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


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
