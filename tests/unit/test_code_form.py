"""The form gate: ruff (line length 120, 160 in tests/ and benchmarks/; the bug-finding rule sets)
over the whole repository, and mypy (check_untyped_defs) over the service code (engines/, vocabulary/,
evals/, workers/, app/, dashboard/), configured in
pyproject.toml. Either one reporting a problem fails the test with its report."""

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration  # ruff and mypy subprocesses (mypy: a minute cold)

CODE = ["engines", "vocabulary", "evals", "workers", "app", "dashboard"]
# ruff and mypy hold every file of CODE: no module is exempt (no [[tool.mypy.overrides]] with
# ignore_errors in pyproject.toml).


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_ruff_finds_nothing():
    # the whole repository: tests/ and benchmarks/ too (their ruff.toml allows 160-character lines)
    r = _run("ruff", "check", "--no-cache", ".", timeout=120)
    assert r.returncode == 0, f"ruff check .:\n{r.stdout}{r.stderr}"


def test_mypy_finds_nothing():
    # The files (pyproject.toml [tool.mypy] files) are engines, vocabulary, evals, workers, app and dashboard.
    # The cache is mypy's own (.mypy_cache in the checkout), the one `make check` fills: `make test`
    # runs `make check` before any test, so here it is warm (seconds; minutes cold on a
    # busy 2-core machine). mypy checks every entry against the sources, so a stale one cannot hide an error.
    r = _run("mypy", timeout=900)
    assert r.returncode == 0, f"mypy ({' '.join(CODE)}):\n{r.stdout}{r.stderr}"
