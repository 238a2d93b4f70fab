"""The benchmark scripts are run as `python benchmarks/X.py`, which puts benchmarks/ first on
sys.path, and some tests import them from there. A script whose name is also the top-level module of
an installed package (or of the standard library) shadows it for every import that follows:
benchmarks/kernels.py once hid the `kernels` package that transformers imports when it is installed,
and every model load in the test run failed."""

from __future__ import annotations

import importlib.metadata
import sys

from tests.conftest import ROOT


def test_no_benchmark_script_shadows_an_installed_or_standard_module():
    taken = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    clashes = sorted(scripts & taken)
    assert not clashes, f"benchmarks/{clashes[0]}.py shadows an installed module of that name; rename the script"


def test_the_check_sees_a_clash_where_there_is_one():
    # the installed set the check reads holds what this run imports (a vacuous set would pass anything)
    taken = set(importlib.metadata.packages_distributions())
    assert {"torch", "transformers", "pytest"} <= taken
