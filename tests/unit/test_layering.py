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


def test_design_doc_states_the_contracts_of_pyproject():
    # docs/design.md's app row names what app may read of evals, and its paragraph on app's layers
    # names every module of the contract in order: both as pyproject.toml has them
    import re

    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    design = (ROOT / "docs/design.md").read_text()
    app_row = next(line for line in design.splitlines() if line.startswith("| `app/` |"))
    forbidden = next(c for c in contracts if c["source_modules"] == ["app"] and c["type"] == "forbidden")
    readable = [rule.split("->")[1].strip() for rule in forbidden.get("ignore_imports", [])]
    assert re.findall(r"`(evals\.\w+)`", app_row) == readable
    layers = next(c for c in contracts if c["type"] == "layers")
    paragraph = design[design.index("Inside `app/`, a `layers` contract"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    named = re.findall(r"`(app\.\w+)`", paragraph)
    in_contract = [m.strip() for layer in layers["layers"] for m in re.split(r"[:|]", layer)]
    assert named == in_contract
