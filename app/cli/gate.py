"""`canary gate`: the pre-deploy gate a CI job calls over the API, polling to a durable verdict."""


from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from app.cli.base import _ago, _log, app, console, fail
from app.summary import decision_line, deploy_decision

if TYPE_CHECKING:
    import httpx


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
    started = time.monotonic()
    with httpx.Client(timeout=30, headers=headers) as http:
        gate = _start(http, base, {name: value for name, value in body.items() if value is not None}, api, retry_for,
                      error_exit_code, unreachable_exit_code)
        _log(f"gate {gate['gate_id']}: {candidate} vs {gate['baseline']} on suite {suite}, run {gate['run_id']}"
             + ("; waiting for the verdict" if wait and gate["verdict"] is None else ""))
        if wait:
            gate = _wait(http, f"{base}/{gate['gate_id']}", gate, started, api, timeout, heartbeat, retry_for,
                         summary_md, as_json, error_exit_code, unreachable_exit_code)
        if report_html and gate["verdict"] is not None:  # the run's report, a CI artifact beside the summary
            response = _call(http, "GET", f"{api.rstrip('/')}/api/v1/projects/{project}/runs/{gate['run_id']}/report",
                             min(retry_for, 60))
            if response.status_code == 200:
                report_html.write_text(response.text, encoding="utf-8")
            else:
                _log(f"the run's report could not be read (HTTP {response.status_code}): {_detail(response)}")
    code = {"pass": 0, "fail": 1, "warn": warn_exit_code, "error": error_exit_code, None: 0}[gate["verdict"]]
    # the comment says what this call does: the API wrote it with the default exit codes
    gate["summary_markdown"] = gate["summary_markdown"].replace(decision_line(gate["verdict"]),
                                                                decision_line(gate["verdict"], code))
    _gate_out(gate, summary_md, as_json, step_summary=True)
    # the decision itself, last, whatever the verdict's name: what the pipeline does next
    _log("no verdict yet (--no-wait): exit 0" if gate["verdict"] is None
         else deploy_decision(gate["verdict"], code))
    raise typer.Exit(code)


def _start(http: httpx.Client, url: str, body: dict, api: str, retry_for: float, error_exit_code: int,
           unreachable_exit_code: int) -> dict:
    """POST the gate (retried through connection errors and 5xx for up to 15 s); the gate as the
    API answered, or a one-line exit naming why it could not start."""
    import httpx

    for _ in range(3):
        try:
            response = _call(http, "POST", url, min(retry_for, 15), json=body)
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
    return response.json()


def _wait(http: httpx.Client, url: str, gate: dict, started: float, api: str, timeout: float, heartbeat: float,
          retry_for: float, summary_md: pathlib.Path | None, as_json: bool, error_exit_code: int,
          unreachable_exit_code: int) -> dict:
    """Poll the gate until it has a verdict, a line on stderr every `heartbeat` seconds; past
    `timeout`, or with the API away for longer than `retry_for`, exit saying the gate goes on."""
    import httpx

    last_line = started
    while gate["verdict"] is None:
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
            response = _call(http, "GET", url, retry_for)
        except httpx.TransportError as e:
            fail(f"the canary API at {api} stayed unreachable for {retry_for:.0f}s ({type(e).__name__}); gate "
                 f"{gate['gate_id']} goes on, and the same --idempotency-key picks it up again",
                 unreachable_exit_code)
        if response.status_code >= 400:
            fail(f"reading gate {gate['gate_id']} failed (HTTP {response.status_code}): {_detail(response)}",
                 error_exit_code if response.status_code >= 500 else 2)
        gate = response.json()
    return gate


def _poll_interval(elapsed: float) -> float:
    """Seconds between a waiting gate's polls: 0.25 s for its first 10 s (a smoke gate's verdict
    comes within seconds), 1 s up to a minute, then 2 s."""
    return 0.25 if elapsed < 10 else 1.0 if elapsed < 60 else 2.0


def _call(http: httpx.Client, method: str, url: str, retry_for: float, **kw: Any) -> httpx.Response:
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


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
        return detail if isinstance(detail, str) else json.dumps(detail)
    except ValueError:
        return response.text[:300]


def _gate_out(g: dict, summary_md: pathlib.Path | None, as_json: bool, step_summary: bool = False) -> None:
    if summary_md:
        summary_md.write_text(g["summary_markdown"], encoding="utf-8")
    if step_summary and os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as f:  # GitHub Actions' job summary
            f.write(g["summary_markdown"].rstrip("\n") + "\n\n")
    if as_json:
        from app.schemas import jsonable

        sys.stdout.write(json.dumps(jsonable(g)) + "\n")
    else:
        console.print(f"gate {g['gate_id']}: [bold]{g['verdict'] or 'pending'}[/] — candidate {g['candidate']} vs "
                      f"{g['baseline']}, run {g['run_id']} ({g['run_status']}); {escape(g['reason'] or '')}",
                      highlight=False, soft_wrap=True)
        for line in g.get("summary") or []:  # the verdict for people, as every surface prints it
            console.print(escape(line), highlight=False, soft_wrap=True)
