"""The form gate: ruff (line length 120, the bug-finding rule sets) and mypy (check_untyped_defs)
over the whole service code (engines/, evals/, workers/, app/, dashboard/), configured in
pyproject.toml. Either one reporting a problem fails the test with its report."""

import os
import pathlib
import subprocess
import sys
import tempfile

from tests.conftest import ROOT

CODE = ["engines", "evals", "workers", "app", "dashboard"]
# Not yet ruff-clean: files that other changes were rewriting when app/ and dashboard/ joined the
# gate. Each joins (leaves this list) once `ruff check <file>` finds nothing. The modules mypy
# does not hold yet are listed, for the same reason, in pyproject.toml ([[tool.mypy.overrides]]
# with ignore_errors).
RUFF_PENDING: list[str] = []


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_ruff_finds_nothing():
    excluded = [arg for path in RUFF_PENDING for arg in ("--extend-exclude", path)]
    r = _run("ruff", "check", "--no-cache", *excluded, *CODE, timeout=120)
    assert r.returncode == 0, f"ruff check {' '.join(CODE)}:\n{r.stdout}{r.stderr}"


def test_ruff_pending_files_are_still_pending():
    # a file that has become clean leaves RUFF_PENDING, so the list never hides a file that passes
    clean = [path for path in RUFF_PENDING if _run("ruff", "check", "--no-cache", path, timeout=60).returncode == 0]
    assert clean == [], f"ruff finds nothing in {clean}: remove them from RUFF_PENDING"


def test_mypy_finds_nothing():
    # The files (pyproject.toml [tool.mypy] files) are engines, evals, workers, app and dashboard.
    # The cache lives outside the tree and is kept between runs (minutes cold on a busy 2-core
    # machine, seconds warm); mypy checks it against the sources, so a stale entry cannot hide an error.
    user = os.getuid() if hasattr(os, "getuid") else "user"
    cache = pathlib.Path(tempfile.gettempdir()) / f"inference-canary-mypy-{user}"
    r = _run("mypy", "--cache-dir", str(cache), timeout=900)
    assert r.returncode == 0, f"mypy ({' '.join(CODE)}):\n{r.stdout}{r.stderr}"
