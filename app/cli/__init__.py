"""`canary` command line: demo, run, gate, serve, worker, engine-serve, the read commands (runs,
report, alerts, gates), tasks (labelled items) and the admin ones (keys, db, schema, alert-rules). One module per group
of commands; this one registers them all and is the entry point (`main`)."""


from __future__ import annotations

import sys

import typer
from rich.markup import escape

from app.cli import admin, gate, labelled, read, runs  # noqa: F401 - each registers its commands on `app`
from app.cli.base import _ago, app, console
from app.cli.output import _print_summary, layers_under_their_config, worst_comparison
from app.cli.runs import DEMO_CONFIG, RunWatch, run_exit_code

__all__ = ["DEMO_CONFIG", "RunWatch", "_ago", "_print_summary", "app", "layers_under_their_config", "main",
           "run_exit_code", "worst_comparison"]


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
    from vocabulary import plugins

    try:
        plugins.load(plugins.VOCABULARY)  # installed plugins' scorers and metric rows (vocabulary/plugins.py)
        app()
    except (NotFound, plugins.PluginError) as e:  # a name on the command line that is not there; a broken plugin
        console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except Exception as e:  # a bad setting or an unreachable service is one line; the rest re-raises
        msg = _settings_error(e) or _service_error(e)
        if msg is None:
            raise
        console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
        sys.exit(2)
