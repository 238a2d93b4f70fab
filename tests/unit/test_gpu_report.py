"""benchmarks/gpu_report.py without a GPU: each section is its own command writing its own JSON
the moment it ends; a collection error costs only its module; a section past --section-timeout is
stopped and says so, and the sections before it are already on disk."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # subprocess runs of benchmarks/gpu_report.py

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_report.py"


def run(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_help_runs_nothing():
    p = run("--help")
    assert p.returncode == 0 and "--section" in p.stdout and "--section-timeout" in p.stdout


def test_sections_write_their_own_json(tmp_path):
    p = run("--device", "cpu", "--smoke", "--section", "tests", "w4a16", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert list(summary["sections"]) == ["tests", "w4a16"]
    tests = json.loads((tmp_path / "tests.json").read_text())
    assert tests["section"] == "tests" and tests["passed"] >= 1 and tests["failed"] == tests["errors"] == 0
    assert (tmp_path / "tests.xml").exists()
    w4 = json.loads((tmp_path / "w4a16.json").read_text())
    assert w4["exit_code"] == 0 and w4["benchmark"]["all_checks_equal"] and "decode_8b" not in w4["benchmark"]
    assert "[gpu-report" in p.stderr and "w4a16: ok" in p.stderr  # progress lines


def test_a_collection_error_costs_its_module_only(tmp_path):
    (tmp_path / "test_broken.py").write_text("import no_such_module_here\n")
    (tmp_path / "test_fine.py").write_text("def test_fine():\n    assert True\n")
    p = run("--device", "cpu", "--smoke", "--section", "tests", "--out", str(tmp_path / "out"),
            "--tests", str(tmp_path / "test_broken.py"), str(tmp_path / "test_fine.py"))
    assert p.returncode == 1
    tests = json.loads((tmp_path / "out" / "tests.json").read_text())
    assert tests["passed"] == 1 and tests["errors"] == 1, tests


def test_a_section_past_its_timeout_is_stopped_and_said_so(tmp_path):
    p = run("--device", "cpu", "--smoke", "--section", "w4a16", "decode", "--section-timeout", "1.5",
            "--out", str(tmp_path))
    assert p.returncode == 1
    for name in ("w4a16", "decode"):
        d = json.loads((tmp_path / f"{name}.json").read_text())
        assert "stopped after 1.5 s" in d["error"], d
