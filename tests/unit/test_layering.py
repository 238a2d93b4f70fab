"""docs/design.md's dependency direction, enforced: engines ← evals ← workers → app; app and the
API image never import torch; the dashboard talks HTTP only (contracts in pyproject.toml)."""

import subprocess
import sys

from tests.conftest import ROOT


def test_import_contracts_hold():
    r = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    contracts = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"Contracts: {contracts} kept, 0 broken" in r.stdout


def test_api_app_imports_without_torch():
    # The API process must start on an image without torch: import it with torch made unimportable.
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "import app.api.main, app.cli, app.services, app.dispatch\n"
        "print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_parts_of_evals_that_app_reads_need_neither_numpy_nor_torch():
    # pyproject's contract lets app import evals.metrics, evals.figures, evals.suite, evals.comparison and evals.labelled
    # (ignore_imports; evals.suite
    # checks term lists with evals.terms): that
    # edge hides what they import in turn, so check it here
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None; sys.modules['transformers'] = None\n"
        "import evals.metrics, evals.figures, evals.suite, evals.comparison, evals.records, evals.terms\n"
        "import evals.labelled; evals.labelled.builtin_items('pydoc-next-word')\n"
        "print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
