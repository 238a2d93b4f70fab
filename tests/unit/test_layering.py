"""docs/design.md's dependency direction, enforced: engines ← vocabulary ← evals ← workers → app → vocabulary;
app and the API image never import torch; the dashboard talks HTTP only (contracts in pyproject.toml)."""

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


def test_the_shared_vocabulary_needs_neither_numpy_nor_torch():
    # app reads the metric table, figures, suite settings (whose term lists vocabulary.terms checks), the
    # Comparison type and labelled items from the shared `vocabulary` package; its contract in pyproject.toml
    # forbids torch and numpy, and this imports it (and runs a labelled item's builtin loader, whose imports
    # are lazy) with both made unimportable. evals.records keeps the same promise (its docstring).
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None; sys.modules['transformers'] = None\n"
        "import vocabulary.metrics, vocabulary.figures, vocabulary.suite, vocabulary.comparison, vocabulary.terms\n"
        "import evals.records\n"
        "import vocabulary.labelled; vocabulary.labelled.builtin_items('pydoc-next-word')\n"
        "print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_design_doc_states_the_contracts_of_pyproject():
    # docs/design.md's app row names the shared `vocabulary` package and no module of evals (app's contract
    # forbids evals, and no contract has ignore_imports), and its paragraph on app's layers names every
    # module of the contract in order: both as pyproject.toml has them
    import re

    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    design = (ROOT / "docs/design.md").read_text()
    app_row = next(line for line in design.splitlines() if line.startswith("| `app/` |"))
    assert not [c["name"] for c in contracts if "ignore_imports" in c]
    forbidden = next(c for c in contracts if c["source_modules"] == ["app"] and c["type"] == "forbidden")
    assert "evals" in forbidden["forbidden_modules"] and "vocabulary" not in forbidden["forbidden_modules"]
    assert "`vocabulary`" in app_row and not re.findall(r"`(evals\.\w+)`", app_row)
    layers = next(c for c in contracts if c["type"] == "layers")
    paragraph = design[design.index("Inside `app/`, a `layers` contract"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    named = re.findall(r"`(app\.\w+)`", paragraph)
    in_contract = [m.strip() for layer in layers["layers"] for m in re.split(r"[:|]", layer)]
    assert named == in_contract
