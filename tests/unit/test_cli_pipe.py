"""`canary run` and the read commands as CI runs them: through a pipe, no terminal, stderr read
back. Progress lines and heartbeats, the exit status of a failing verdict, a table that fits,
one-line errors for a database or broker that cannot be reached, and the --no-wait warning."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml
from app.cli import RunWatch, _ago, run_exit_code, worst_comparison
from engines.zoo import resolve_corpus_path

from tests.conftest import ROOT
from tests.loopback import refused_port


def canary(*args: str, cwd, db: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """The CLI with stdout and stderr as pipes (no terminal), on the embedded default."""
    base = {"CANARY_DATABASE_URL": db, "CANARY_EXECUTION": "inline", "PATH": "/usr/bin:/bin", "HOME": str(cwd),
            "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=cwd, env={**base, **env}, capture_output=True,
                          text=True, timeout=timeout)


def tiny_config(tmp_path) -> str:
    lines = resolve_corpus_path("builtin:pydoc-heldout").read_text().splitlines()[:12]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines))
    (tmp_path / "canary.yaml").write_text(yaml.safe_dump({
        "project": "pipe", "model": {"name": "tiny", "path": "builtin:pydoc-target"},
        "configs": [{"name": "fp32", "baseline": True, "engine": "reference", "weights": "fp32"},
                    {"name": "int2", "engine": "reference", "weights": "rtn-int2"}],
        "suites": [{"name": "s", "corpus": str(tmp_path / "docs.jsonl"), "samples": 12, "seed": 1, "scorers": ["perplexity"],
                    "perplexity": {"window": 64}}],
        # int2 weights cost this model ≈ 6 % perplexity: critical at 1.03, so the run fails
        "thresholds": {"ppl_ratio": {"warn": 1.01, "critical": 1.03}}}))
    return str(tmp_path / "canary.yaml")


@pytest.mark.integration
def test_a_failing_run_through_a_pipe_moves_exits_1_and_fits(tmp_path):
    db = f"sqlite:///{tmp_path / 'c.db'}"
    r = canary("run", "-f", tiny_config(tmp_path), "--heartbeat", "1", cwd=tmp_path, db=db)
    assert r.returncode == 1, r.stderr[-3000:]  # the verdict is fail
    log = r.stderr.splitlines()
    assert log[0].startswith("canary: run 1 started: 2 configs, 12 samples each"), log
    # one line per finished config, in the order they finish, each counting the configs done
    done = [line for line in log if " succeeded (" in line]
    assert len(done) == 2 and "(1/2 configs done" in done[0] and "(2/2 configs done" in done[1], log
    # the model's load and scoring take more than the 1 s heartbeat: a heartbeat line comes first
    assert any(line.startswith("canary: run 1 running: 0/2 configs done") for line in log[:log.index(done[0])]), log
    table = r.stdout.splitlines()
    assert max(map(len, table)) <= 120, r.stdout  # no terminal: the default table fits 120 columns
    [int2] = [line for line in table if line.startswith("│ int2")]
    assert "critical" in int2 and "[" in int2, int2  # ratio with its CI, and the verdict
    # the verdict for people: its group, then the config with its worst figure and CI (app/summary.py)
    verdict = r.stdout[r.stdout.index("verdict: fail"):].splitlines()
    assert verdict[:2] == ["verdict: fail", "drop or fix (1):"], r.stdout
    assert verdict[2].startswith("  int2: ppl ratio +") and verdict[2].endswith("] critical"), verdict
    # the run's report to share: one HTML file, through a pipe; a run that does not exist is one line
    rep = canary("report", "1", "-p", "pipe", "-o", str(tmp_path / "r.html"), cwd=tmp_path, db=db)
    assert rep.returncode == 0 and "report of run 1 written to" in rep.stderr, rep.stderr[-2000:]
    html = (tmp_path / "r.html").read_text()
    assert html.startswith("<!doctype html>") and "drop or fix (1):" in html and "<svg" not in html  # no speed figures
    missing = canary("report", "99", "-p", "pipe", cwd=tmp_path, db=db)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "99" in missing.stderr
    # the read commands on the same database
    runs = json.loads(canary("runs", "list", "-p", "pipe", "--json", cwd=tmp_path, db=db).stdout)
    assert [(x["run_id"], x["suite"], x["verdict"]) for x in runs] == [(1, "s", "fail")]
    shown = json.loads(canary("runs", "show", "1", "-p", "pipe", "--json", cwd=tmp_path, db=db).stdout)
    [ratio] = [c for c in shown["comparisons"] if c["metric"] == "ppl_ratio"]
    assert ratio["config"] == "int2" and ratio["verdict"] == "critical" and ratio["n"] == 12
    wide = canary("runs", "show", "1", "-p", "pipe", "--wide", cwd=tmp_path, db=db)
    assert wide.returncode == 0 and "TTFT p50 ms" in wide.stdout and "weights" in wide.stdout
    alerts = canary("alerts", "list", "-p", "pipe", "--json", cwd=tmp_path, db=db)
    assert alerts.returncode == 0 and isinstance(json.loads(alerts.stdout), list)
    assert json.loads(canary("gates", "list", "-p", "pipe", "--json", cwd=tmp_path, db=db).stdout) == []
    missing = canary("runs", "show", "9", "-p", "pipe", cwd=tmp_path, db=db)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1 and "9" in missing.stderr


@pytest.mark.parametrize("verdict,fail_on,code", [
    ("pass", "fail", 0), ("warn", "fail", 0), ("inconclusive", "fail", 0), ("fail", "fail", 1), ("incomplete", "fail", 1),
    ("error", "fail", 1), ("warn", "warn", 1), ("inconclusive", "warn", 1), ("pass", "warn", 0), ("fail", "never", 0),
])
def test_run_exit_code(verdict, fail_on, code):
    assert run_exit_code(verdict, fail_on) == code


def test_worst_comparison_skips_informational_metrics():
    from app.schemas import ComparisonOut

    def c(metric, verdict, gated=True):
        return ComparisonOut(config="x", metric=metric, estimate=None, ci_low=None, ci_high=None, n=1, verdict=verdict,
                             rule="", baseline_value=None, candidate_value=None, details={}, gated=gated)

    comps = [c("ppl_ratio", "warn"), c("exact_match", "critical"), c("gen_nll_ratio", "critical"), c("ttft_ratio", "ok")]
    assert worst_comparison(comps).metric == "gen_nll_ratio"  # exact_match is reported only, never decides
    # a gated metric its producer reported without judging it (gated false) never decides either
    assert worst_comparison([c("ppl_ratio", "warn"), c("lossless_exact_match", "critical", gated=False)]).metric == "ppl_ratio"
    assert worst_comparison([c("gen_nll_ratio", "warn"), c("ppl_ratio", "warn")]).metric == "ppl_ratio"  # first among equals
    assert worst_comparison([]) is None


class _Cfg:
    def __init__(self, name):
        self.name = name


class _CR:
    def __init__(self, name, status, done=0, total=0):
        self.config, self.status, self.progress_done, self.progress_total, self.error = _Cfg(name), status, done, total, None


def test_heartbeat_line_and_its_estimate():
    """Worked by hand: of 4 configs, 1 succeeded and int8 is 25/100 done: 1.25 of 4 done after
    100 s, so 2.75 / 1.25 × 100 s = 220 s = 3m40s are left."""
    watch = RunWatch(7, heartbeat=30, bars=False)
    watch.finished = {"fp16"}
    crs = [_CR("fp16", "succeeded"), _CR("int8", "running", 25, 100), _CR("int4", "queued"), _CR("int2", "queued")]
    assert watch.heartbeat_line(crs, 100.0) == "run 7 running: 1/4 configs done; int8 25/100; 1m40s elapsed, about 3m40s left"
    assert _ago(59.6) == "1m00s" and _ago(3725) == "1h02m" and _ago(-3) == "0s"


def test_unreachable_database_is_one_line_and_exit_2(tmp_path):
    with refused_port() as port:
        dead = f"postgresql+psycopg://canary:s3cret@127.0.0.1:{port}/canary"
        for args in (("run", "-f", tiny_config(tmp_path)), ("runs", "list", "-p", "pipe")):
            r = canary(*args, cwd=tmp_path, db=dead, timeout=120)
            assert r.returncode == 2, r.stderr[-2000:]
            assert r.stderr.startswith("error: the database at postgresql+psycopg://***@127.0.0.1:"), r.stderr
            assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr and "s3cret" not in r.stderr


@pytest.mark.integration
def test_unreachable_broker_is_one_line_and_exit_2(tmp_path):
    with refused_port() as port:
        r = canary("run", "-f", tiny_config(tmp_path), cwd=tmp_path, db=f"sqlite:///{tmp_path / 'c.db'}", timeout=120,
                   CANARY_EXECUTION="celery", CANARY_BROKER_URL=f"redis://127.0.0.1:{port}/0")
    assert r.returncode == 2 and r.stderr.startswith("error: the broker at redis://127.0.0.1:"), r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and "CANARY_BROKER_URL" in r.stderr


def test_no_wait_on_the_embedded_default_warns_that_nothing_runs_it(tmp_path):
    r = canary("run", "-f", tiny_config(tmp_path), "--no-wait", cwd=tmp_path, db=f"sqlite:///{tmp_path / 'c.db'}")
    assert r.returncode == 0 and json.loads(r.stdout) == {"run_id": 1, "status": "queued"}
    assert "warning: run 1 is queued, but on the embedded default" in r.stderr and "canary serve" in r.stderr


def test_version_and_a_wrong_fail_on(tmp_path):
    r = canary("--version", cwd=tmp_path, db="sqlite://")
    assert r.returncode == 0 and r.stdout.startswith("inference-canary ")
    bad = canary("run", "--fail-on", "sometimes", cwd=tmp_path, db="sqlite://")
    assert bad.returncode == 2 and "--fail-on must be one of fail, warn, never" in bad.stderr


def test_serve_with_several_workers_needs_celery(tmp_path):
    r = canary("serve", "--workers", "2", "--port", "1", cwd=tmp_path, db=f"sqlite:///{tmp_path / 'w.db'}", timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--workers" in r.stderr and "CANARY_BROKER_URL" in r.stderr


def test_a_bad_setting_is_one_line_naming_the_variable(tmp_path):
    r = canary("runs", "list", cwd=tmp_path, db=f"sqlite:///{tmp_path / 'c.db'}", timeout=120, CANARY_API_THREADS="0")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: CANARY_API_THREADS='0': Input should be greater than or equal to 1 "
                                             "(fix the environment variable or unset it for the default)"]


@pytest.mark.integration
def test_an_undecided_run_tops_up_through_a_pipe(tmp_path):
    """4 documents are fewer than min_n (10), and fewer than the 5 on which a CI wholly beyond
    critical decides (evals/stats.clear_failure_n): the run draws 4 more, and on 8 int2's ratio
    lies wholly beyond critical: judged critical there, without drawing the last 4 (max_samples 12)."""
    path = tiny_config(tmp_path)
    cfg = yaml.safe_load(open(path))
    cfg["suites"][0].update(samples=4, max_samples=12)
    (tmp_path / "canary.yaml").write_text(yaml.safe_dump(cfg))
    r = canary("run", "-f", path, "--wide", cwd=tmp_path, db=f"sqlite:///{tmp_path / 'c.db'}")
    assert r.returncode == 1, r.stderr[-3000:]
    out = " ".join(r.stdout.split())
    assert "run 1 — baseline fp32, 8 documents (topped up from 4)" in out, r.stdout
    assert "verdict: fail on 8 samples (topped up from 4) drop or fix (1): int2: ppl ratio +" in out
    assert "every finding: int2 ppl_ratio critical" in out and "though n=8 < min_n=10" in out  # --wide: the reason
    assert out.endswith("topped up from 4 to 8 samples (max_samples 12) after an inconclusive pass"), out
    db = f"sqlite:///{tmp_path / 'c.db'}"
    [listed] = json.loads(canary("runs", "list", "-p", "pipe", "--json", cwd=tmp_path, db=db).stdout)
    assert (listed["n_samples"], listed["samples_drawn"]) == (4, 8)
    table = canary("runs", "list", "-p", "pipe", cwd=tmp_path, db=db).stdout
    assert "8 (of 4, topped up)" in " ".join(table.split()), table


@pytest.mark.integration
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_serve_with_the_dashboard_starts_both_and_stopping_it_stops_both(tmp_path, stop):
    """`canary serve --dashboard` (the demo's last line): the API and, on it, the Streamlit dashboard,
    one command; an interrupt stops the API and the dashboard with it. The same port twice is a one-line error."""
    import signal

    import httpx

    from tests.loopback import free_port, wait_http

    db = f"sqlite:///{tmp_path / 'd.db'}"
    same = canary("serve", "--port", "8123", "--dashboard", "--dashboard-port", "8123", cwd=tmp_path, db=db, timeout=60)
    assert same.returncode == 2 and "--dashboard-port: 8123 is the API's own --port" in same.stderr, same.stderr
    api, ui = free_port(), free_port()
    log = tmp_path / "serve.log"
    env = {"CANARY_DATABASE_URL": db, "CANARY_EXECUTION": "inline", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(api), "--dashboard",
                             "--dashboard-port", str(ui)], cwd=tmp_path, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{api}/healthz", proc, str(log))
        wait_http(f"http://127.0.0.1:{ui}/_stcore/health", proc, str(log))
        assert f"dashboard: http://127.0.0.1:{ui} (on the API at http://127.0.0.1:{api})" in log.read_text()
    finally:
        proc.send_signal(getattr(signal, stop))  # Ctrl-C, or a service manager's stop
        proc.wait(60)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # both gone (the dashboard a moment after the API)
        try:
            httpx.get(f"http://127.0.0.1:{ui}/_stcore/health", timeout=2)
        except httpx.HTTPError:
            break
        time.sleep(0.3)
    for port in (api, ui):
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
