"""The CLI-only install the example workflow (deploy/ci/github-actions-gate.yml) uses, run as its
step runs it: a fresh virtual environment, the API image's requirements, the package without its
dependencies. The gate client then works without torch, transformers or numpy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import yaml

from tests.conftest import ROOT

SKIP = shutil.ignore_patterns(".venv", ".venv-*", ".git", "__pycache__", "build", "dist", "*.egg-info", "*.db", "celerybeat-schedule*",
                              ".pytest_cache", "out")


def test_workflow_install_step_gives_a_cli_without_the_model_stack(tmp_path):
    wf = yaml.safe_load((ROOT / "deploy/ci/github-actions-gate.yml").read_text())
    step = next(s for s in wf["jobs"]["gate"]["steps"] if s.get("name", "").startswith("Install the canary CLI"))
    checkout = next(s for s in wf["jobs"]["gate"]["steps"] if str(s.get("uses", "")).startswith("actions/checkout"))
    shutil.copytree(ROOT, tmp_path / checkout["with"]["path"], ignore=SKIP)  # what actions/checkout leaves there
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", step["run"]], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1].startswith("inference-canary "), r.stdout  # `canary --version`
    python = str(venv / "bin" / "python")
    for module in ("torch", "transformers", "numpy"):
        absent = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert absent.returncode != 0, f"{module} was installed: the CLI-only path pulls the model stack"
    # the gate client itself runs: an API that is not there is its one-line error, exit 3 (unreachable)
    gate = subprocess.run([str(venv / "bin" / "canary"), "gate", "--api", "http://127.0.0.1:9", "--project", "p",
                           "--candidate", "c", "--suite", "s", "--retry-for", "0"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert gate.returncode == 3, gate.stdout + gate.stderr
    assert "Traceback" not in gate.stderr and len(gate.stderr.strip().splitlines()) == 1, gate.stderr
