"""The benchmarks' shared timing harness and their command lines: alternating order, spreads and
ratios worked by hand, the speculative theory from per-position acceptance worked by hand, and
`--help` on every script printing usage without running anything."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT

BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402
import speculative  # noqa: E402


def test_alternate_reverses_the_order_every_round():
    calls = []
    t = _common.alternate({"a": lambda: calls.append("a") or 1, "b": lambda: calls.append("b") or 2}, 4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert len(t["a"].wall) == len(t["a"].cpu) == 4 and (t["a"].result, t["b"].result) == (1, 2)


def test_spread_rate_and_ratio_by_hand():
    ours = _common.Timings(wall=[2.0, 1.0, 4.0], cpu=[2.0, 2.0, 2.0])
    peer = _common.Timings(wall=[4.0, 3.0, 4.0], cpu=[6.0, 2.0, 4.0])
    assert _common.spread(ours.wall) == {"median": 2.0, "min": 1.0, "max": 4.0}
    # 100 tokens over 2, 1 and 4 s: 50, 100 and 25 tokens/s
    assert _common.rate(100, ours)["wall"] == {"median": 50.0, "min": 25.0, "max": 100.0}
    # per round: 4/2, 3/1, 4/4 = 2, 3, 1 by wall; 6/2, 2/2, 4/2 = 3, 1, 2 by CPU
    assert _common.ratio(ours, peer) == {"wall": {"median": 2.0, "min": 1.0, "max": 3.0},
                                         "cpu": {"median": 2.0, "min": 1.0, "max": 3.0}}


def gen(itl_steps: int, drafts: int, draft_tokens: int, accepted: int, per_position: tuple[int, ...]):
    from engines.protocol import SpeculativeStats

    return SimpleNamespace(itl_ms=(1.0,) * itl_steps, spec=SpeculativeStats(drafts, draft_tokens, accepted, per_position))


def test_speculative_theory_by_hand():
    """Two requests, k = 2: 10 drafts in all, first position accepted 6 times, both 3 times; 12
    steps, so 2 without a draft. E = 1 + 0.6 + 0.3 = 1.9 tokens per draft pass; with c = 0.25 a
    draft pass costs 1 + 2 × 0.25 = 1.5, so theory = (10 × 1.9 + 2) / (10 × 1.5 + 2) = 21 / 17."""
    outs = [gen(7, 6, 12, 5, (4, 1)), gen(5, 4, 8, 4, (2, 2))]
    th = speculative.theory(outs, 0.25)
    assert th["drafts"] == 10 and th["passes_without_draft"] == 2
    assert th["per_position_acceptance"] == [0.6, 0.3] and th["tokens_per_draft_pass"] == 1.9
    assert th["theory_speedup"] == round(21 / 17, 3) and th["acceptance_rate"] == 0.45  # 9 of 20 draft tokens
    # n-gram lookup costs nothing: (10 × 1.9 + 2) / (10 + 2)
    assert speculative.theory(outs, 0.0)["theory_speedup"] == round(21 / 12, 3)


@pytest.mark.parametrize("script", ["perplexity_throughput.py", "reference_decode.py", "speculative.py", "detection.py", "demo.py",
                                    "tiny_model_outliers.py", "dashboard_api.py", "kernel_resources.py", "gate.py"])
def test_help_prints_usage_and_runs_nothing(script):
    r = subprocess.run([sys.executable, str(BENCH / script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage:"), r.stdout + r.stderr
    assert "{" not in r.stdout.splitlines()[-1]  # no JSON figures: nothing ran


def test_fewer_than_three_repeats_is_refused():
    r = subprocess.run([sys.executable, str(BENCH / "speculative.py"), "--repeats", "2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "--repeats must be at least 3" in r.stderr
