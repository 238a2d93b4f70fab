"""Deploy files that can be checked here: the CI gate workflow calls flags the CLI has; the
Prometheus rules pass promtool when it is installed."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import yaml

from tests.conftest import ROOT


def test_gate_workflow_uses_real_cli_flags():
    wf = yaml.safe_load((ROOT / "deploy/ci/github-actions-gate.yml").read_text())
    script = next(s["run"] for s in wf["jobs"]["gate"]["steps"] if s.get("id") == "gate")
    help_text = subprocess.run([sys.executable, "-m", "app.cli", "gate", "--help"], capture_output=True, text=True, cwd=ROOT,
                               env={"COLUMNS": "200", "PATH": ""}).stdout
    flags = [w for w in script.replace("\\", " ").split() if w.startswith("--")]
    assert flags and all(f in help_text for f in flags), (flags, help_text)


def test_gate_workflow_scripts_pass_shellcheck():
    """Every `run:` script of the example workflow, with each ${{ expression }} as a shell word."""
    import re

    shellcheck = shutil.which("shellcheck") or str(pathlib.Path(sys.executable).parent / "shellcheck")
    wf = yaml.safe_load((ROOT / "deploy/ci/github-actions-gate.yml").read_text())
    scripts = [s["run"] for s in wf["jobs"]["gate"]["steps"] if "run" in s]
    assert len(scripts) >= 3
    for script in scripts:
        shell = re.sub(r"\$\{\{[^}]*\}\}", "GITHUB_EXPRESSION", script)
        r = subprocess.run([shellcheck, "--shell=bash", "-"], input=shell, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{script}\n{r.stdout}{r.stderr}"


def test_prometheus_rules_parse():
    rules = yaml.safe_load((ROOT / "deploy/prometheus/canary-rules.yml").read_text())
    names = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert "CanaryRegressionCritical" in names
    promtool = shutil.which("promtool")
    if promtool:
        r = subprocess.run([promtool, "check", "rules", str(ROOT / "deploy/prometheus/canary-rules.yml")], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_prometheus_rules_are_written_from_the_metric_table():
    """The committed rules file is what `canary alert-rules` writes from vocabulary/metrics.py, with one
    seed-threshold rule per gated metric on the gauge app/prometheus.py exports for it."""
    from app.prometheus import COMPARISON_GAUGES
    from app.prometheus_rules import render
    from vocabulary.metrics import gated_metrics

    assert (ROOT / "deploy/prometheus/canary-rules.yml").read_text() == render(), \
        "regenerate: canary alert-rules > deploy/prometheus/canary-rules.yml"
    rules = {r["alert"]: r for g in yaml.safe_load(render())["groups"] for r in g["rules"]}
    for name, m in gated_metrics().items():
        expr = rules[m.alert]["expr"]
        gauge = "canary_ttft_p50_seconds" if name == "ttft_ms" else f"canary_{name}_ci_{'low' if m.direction == 'above' else 'high'}"
        warn = m.warn / 1000 if name == "ttft_ms" else m.warn  # exported in seconds, the base unit
        assert expr.startswith(gauge) and expr.endswith(f"{'>' if m.direction == 'above' else '<'} {warn:g}"), expr
        assert name == "ttft_ms" or name in COMPARISON_GAUGES
    assert rules["CanaryPerplexityRatioHigh"]["expr"] == "canary_ppl_ratio_ci_low > 1.15"  # worked by hand from the seed row
