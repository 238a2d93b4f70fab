"""Plugins found by their package's entry points (vocabulary/plugins.py): an installed
distribution's scorer and metric row reach the API's checks, and its producer reaches a worker's
loop, in a fresh process with nothing registered by hand. The distribution is a real one: a
`*.dist-info` folder with its METADATA and entry_points.txt on sys.path, as pip installs it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

VOCAB = '''
from vocabulary.metrics import Metric, register_metric
from vocabulary.suite import Scorer, register_scorer

register_scorer(Scorer("toy_plugin", "an installed plugin's toy"))
register_metric(Metric("toy_plugin_delta", "toy delta", "points", "above", "mean", "toy_plugin",
                       "an installed plugin's toy row", gated=False, compare="toy_canary_plugin.vocab:compare"))


def compare(ctx):
    return None
'''

PRODUCER = '''
from workers.producers import Batch, Producer, register_producer


@register_producer
class ToyPlugin(Producer):
    scorer = "toy_plugin"

    def batches(self):
        yield Batch([], 0)
'''


def install(tmp_path, vocab: str = VOCAB, producer: str = PRODUCER, name: str = "toy-canary-plugin"):
    """A distribution as pip lays it out: the package, and its dist-info with both entry points."""
    pkg = tmp_path / "toy_canary_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "vocab.py").write_text(textwrap.dedent(vocab))
    (pkg / "producer.py").write_text(textwrap.dedent(producer))
    info = tmp_path / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[inference_canary.vocabulary]\ntoy = toy_canary_plugin.vocab\n\n"
                                           "[inference_canary.producers]\ntoy = toy_canary_plugin.producer\n")
    return tmp_path


def fresh(code: str, path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.integration  # fresh Python processes
def test_a_fresh_worker_process_runs_an_installed_producer_after_the_built_in_ones(tmp_path):
    p = fresh("""
        from workers.producers import PRODUCERS
        from vocabulary import plugins
        from vocabulary.metrics import METRICS
        print([c.scorer for c in PRODUCERS][-1], "toy_plugin_delta" in METRICS, plugins.loaded())
    """, install(tmp_path))
    assert p.returncode == 0, p.stderr[-2000:]
    last, metric, loaded = p.stdout.strip().split(" ", 2)
    assert last == "toy_plugin" and metric == "True"
    assert "toy = toy_canary_plugin.producer (toy-canary-plugin)" in loaded
    assert "toy = toy_canary_plugin.vocab (toy-canary-plugin)" in loaded


@pytest.mark.integration  # fresh Python processes
def test_the_api_process_checks_a_suite_against_an_installed_scorer_without_importing_workers(tmp_path):
    # the API package loads the vocabulary group before its routes: a suite listing the plugin's
    # scorer is accepted, one listing a scorer nobody installed is refused naming the plugin's among
    # the choices, and the trends route accepts the plugin's metric
    p = fresh("""
        import sys
        import app.api.main
        from app.config_file import parse_config
        base = {"project": "p", "model": {"name": "tiny", "path": "builtin:pydoc-target"},
                "configs": [{"name": "fp16", "baseline": True, "weights": "fp16"}],
                "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "scorers": ["perplexity", "toy_plugin"]}]}
        parse_config(base)
        try:
            parse_config({**base, "suites": [{**base["suites"][0], "scorers": ["perplexity", "nobody"]}]})
        except Exception as e:
            print("REFUSED", "toy_plugin" in str(e))
        from typing import get_args
        from app.api.routes import views
        print("TRENDS", "toy_plugin_delta" in get_args(views.MetricName))  # a route's accepted metric names
        print("WORKERS", any(m == "workers" or m.startswith("workers.") for m in sys.modules))
    """, install(tmp_path))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "REFUSED True" in p.stdout and "TRENDS True" in p.stdout and "WORKERS False" in p.stdout


@pytest.mark.integration  # fresh Python processes
def test_a_plugin_that_fails_to_load_is_one_error_naming_it_and_the_fix(tmp_path):
    path = install(tmp_path, vocab="raise ImportError('no module named toy_dependency')\n")
    p = fresh("""
        from vocabulary import plugins
        for attempt in range(2):  # the second load raises the same error, not the plugin's second import's
            try:
                plugins.load(plugins.VOCABULARY)
            except plugins.PluginError as e:
                print(e)
    """, path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert ("plugin 'toy' (toy_canary_plugin.vocab, from toy-canary-plugin) in entry-point group "
            "inference_canary.vocabulary failed to load: ImportError: no module named toy_dependency; "
            "fix or uninstall toy-canary-plugin") in p.stdout
    assert len(set(p.stdout.strip().splitlines())) == 1 and len(p.stdout.strip().splitlines()) == 2
    # and the CLI says it in one line, exit 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(ROOT)])}
    cli = subprocess.run([sys.executable, "-c", "from app.cli import main; main()", "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    out = cli.stdout + cli.stderr
    assert cli.returncode == 2 and "error: plugin 'toy'" in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1


def test_an_unknown_group_is_refused():
    from vocabulary import plugins

    with pytest.raises(ValueError, match=r"unknown plugin group 'nope'; choose from inference_canary\.vocabulary"):
        plugins.load("nope")
