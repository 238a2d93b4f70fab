"""Deploy files that can be checked here: the CI gate workflow calls flags the CLI has; the
Prometheus rules pass promtool when it is installed."""

from __future__ import annotations

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


def test_prometheus_rules_parse():
    rules = yaml.safe_load((ROOT / "deploy/prometheus/canary-rules.yml").read_text())
    names = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert "CanaryRegressionCritical" in names
    promtool = shutil.which("promtool")
    if promtool:
        r = subprocess.run([promtool, "check", "rules", str(ROOT / "deploy/prometheus/canary-rules.yml")], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
