"""The Overview's per-model card (dashboard/views/card.py): every tile's value, source config and
state computed by hand from a tiny overview of three configs and a baseline."""

from __future__ import annotations

from datetime import datetime, timezone

from dashboard.views.card import card_html, check_times, model_tiles
from vocabulary.metrics import METRICS

NOW = datetime(2026, 11, 25, 12, 0, 0, tzinfo=timezone.utc)
CATALOGUE = [m.as_dict() for m in METRICS.values()]  # what GET /metrics serves


def cell(estimate, low, high, verdict, n=20, baseline_value=None, candidate_value=None):
    return {"estimate": estimate, "ci_low": low, "ci_high": high, "n": n, "verdict": verdict,
            "rule": f"{verdict} by hand", "baseline_value": baseline_value, "candidate_value": candidate_value}


def config(name, comparisons, figures, baseline=False, checked_at="2026-11-25T10:00:00"):
    return {"config": name, "baseline": baseline, "comparisons": comparisons, "figures": figures,
            "checked_at": checked_at, "run_id": 1}


CONFIGS = [
    config("fp16", {"kv_cache_usage": cell(0.40, None, None, "ok", n=1), "faithfulness": cell(0.90, 0.85, 0.95, "ok")},
           {"tokens_per_second": 31.0}, baseline=True, checked_at="2026-11-25T09:00:00"),
    config("int4", {"ppl_ratio": cell(1.20, 1.16, 1.25, "warn", baseline_value=8.0),
                    "ttft_ms": cell(120.0, 100.0, 140.0, "ok"), "tpot_ratio": cell(1.10, 1.02, 1.18, "ok"),
                    "kv_cache_usage": cell(0.50, None, None, "ok", n=1), "faithfulness": cell(0.85, 0.8, 0.9, "ok")},
           {"tokens_per_second": 80.6, "ttft_ms_p99": 310.4}),
    config("kv2", {"ppl_ratio": cell(1.40, 1.31, 1.52, "critical", baseline_value=8.0),
                   "ttft_ms": cell(90.0, 80.0, 101.0, "ok"), "tpot_ratio": cell(1.30, 1.20, 1.40, "warn"),
                   "kv_cache_usage": cell(0.97, None, None, "critical", n=1),
                   "faithfulness": cell(0.70, 0.60, 0.80, "warn"),
                   "judge_score_delta": cell(-0.2, -0.5, 0.1, "ok"), "judge_win_rate": cell(0.35, 0.30, 0.40, "warn")},
           {"tokens_per_second": 70.2, "ttft_ms_p99": 200.0}, checked_at="2026-11-25T10:30:00")
    # kv2's evidence is its own run: the baseline there ran at 100.2 tok/s, not fp16's 31.0 of another run
    | {"baseline_figures": {"tokens_per_second": 100.2}},
    config("spec", {"spec_acceptance_rate": cell(0.45, 0.40, 0.50, "warn")}, {"tokens_per_second": 150.0}),
]


def tiles_by_title(configs=CONFIGS, catalogue=CATALOGUE):
    return {t.title: t for t in model_tiles(configs, catalogue)}


def test_each_tile_shows_the_worst_config_its_value_and_its_state():
    tiles = tiles_by_title()
    assert list(tiles) == ["domain PPL", "judge score", "faithfulness", "spec-decode acceptance", "TTFT p50 / p99",
                           "throughput", "KV-cache usage", "lossless outputs", "generation health", "task accuracy",
                           "next-token KLD", "KV cache by decode"]
    ppl = tiles["domain PPL"]  # kv2 is critical, int4 only warn: (1.40 − 1) × 100 = +40.0; CI +31.0, +52.0
    assert (ppl.state, ppl.value, ppl.ci, ppl.source) == ("critical", "+40.0%", "[+31.0, +52.0]",
                                                          "kv2, worst of 2 on ppl ratio")
    assert ppl.lines == ["baseline fp16 PPL 8.00"]
    # the judge: kv2's win rate is warn, its score delta ok; the worse verdict heads the tile, 0.35 → 35%
    judge = tiles["judge score"]
    assert (judge.state, judge.value, judge.ci, judge.source) == ("warn", "35%", "[30, 40]", "kv2")
    assert judge.lines == ["judge Δ -0.20 [-0.50, +0.10] (kv2, ok)"]
    # faithfulness: the baseline is judged too (3 configs); kv2's 0.70 is warn
    faith = tiles["faithfulness"]
    assert (faith.state, faith.value, faith.ci, faith.source) == ("warn", "70%", "[60, 80]",
                                                                  "kv2, worst of 3 on faithful")
    accept = tiles["spec-decode acceptance"]
    assert (accept.state, accept.value, accept.ci, accept.source) == ("warn", "45%", "[40, 50]", "spec")
    # TTFT: both ok, so the slower p50 is the worst: int4's 120 ms (not kv2's 90 ms), with int4's p99 310.4 → 310
    ttft = tiles["TTFT p50 / p99"]
    assert (ttft.state, ttft.value, ttft.ci, ttft.source) == ("ok", "p50 120 ms", "[100, 140]",
                                                              "int4, worst of 2 on TTFT p50 ms")
    assert ttft.lines == ["p99 310 ms (no threshold of its own)"]
    # throughput: kv2's TPOT ratio is warn (+30 %); its 70.2 tok/s against the baseline's 100.2 in kv2's run
    tput = tiles["throughput"]
    assert (tput.state, tput.value, tput.source) == ("warn", "70 tok/s", "kv2, worst of 2 on TPOT ratio")
    assert tput.lines == ["baseline 100 tok/s (same run)", "TPOT ratio +30.0% [+20.0, +40.0]"]
    # KV usage: a peak, one reading, no CI: 0.97 → 97 %, critical, the worst of the three
    kv = tiles["KV-cache usage"]
    assert (kv.state, kv.value, kv.ci, kv.source) == ("critical", "97%", "", "kv2, worst of 3 on KV use")


def test_no_data_shows_no_figure_and_unknown_metrics_have_no_tile():
    only_ppl = [CONFIGS[0], config("int4", {"ppl_ratio": cell(1.02, 0.99, 1.05, "inconclusive", baseline_value=8.0)},
                                   {})]
    tiles = tiles_by_title(only_ppl)
    assert tiles["domain PPL"].state == "inconclusive" and tiles["domain PPL"].value == "+2.0%"
    for title in ("judge score", "spec-decode acceptance", "TTFT p50 / p99", "throughput"):
        assert (tiles[title].state, tiles[title].value, tiles[title].lines) == ("no data", "", [])
    # a catalogue without the judge metrics: no judge tile at all
    no_judge = [m for m in CATALOGUE if m["producer"] != "judge"]
    assert "judge score" not in tiles_by_title(catalogue=no_judge)


def test_card_html_names_each_state_in_words_and_escapes_config_names():
    odd = [config("<b>x</b>", {"ppl_ratio": cell(1.5, 1.4, 1.6, "measurement_error", baseline_value=8.0)}, {})]
    page = card_html(model_tiles(odd, CATALOGUE), *check_times(odd, None, NOW))
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page
    assert 'data-state="measurement_error"' in page and ">measurement error<" in page
    # every figure but the perplexity ratio has no data: named in one small tile, no figure, no verdict colour
    assert page.count('data-state="no data"') == 1 and ('<div class="s">judge score, faithfulness, spec-decode '
                                                        'acceptance, TTFT p50 / p99, throughput, KV-cache usage, '
                                                        'lossless outputs, generation health, task accuracy, '
                                                        'next-token KLD, '
                                                        'KV cache by decode</div>'
                                                        in page)
    assert "last <b>2 hours ago</b>" in page and "next <b>not scheduled</b>" in page


def test_check_times_the_models_latest_run_and_the_suites_next_slot():
    # the model's configs were checked at 09:00, 10:00 (twice) and 10:30; now is 12:00 → 1 hour 30 min → "1 hour ago"
    assert check_times(CONFIGS, "2026-11-25T18:00:00+00:00", NOW) == ("1 hour ago", "in 6 hours")
    never = [dict(c, checked_at=None) for c in CONFIGS]
    assert check_times(never, None, NOW) == ("never", "not scheduled")


def test_a_figure_reported_but_not_judged_is_never_coloured_ok():
    # faithfulness by the offline approximation: verdict "ok" whatever the figure, judged false
    offline = dict(cell(0.0, 0.0, 0.0, "ok"), judged=False, rule="offline approximation: reported, not judged")
    configs = [config("fp16", {"faithfulness": offline}, {}, baseline=True),
               config("int4", {"faithfulness": dict(offline, estimate=0.1, ci_high=0.2)}, {})]
    faith = tiles_by_title(configs)["faithfulness"]
    assert (faith.state, faith.value, faith.ci) == ("not judged", "0%", "[0, 0]")  # the lower of the two, fp16's
    assert faith.lines == ["offline approximation: reported, not judged"]
    page = card_html([faith], "never", "not scheduled")
    assert 'class="canary-tile neutral" data-state="not judged"' in page and "#c8e6c9" not in page  # no ok green


def test_the_task_accuracy_tile_shows_recovery_its_accuracies_and_the_flips():
    """kv2 recovers 0.96 of fp16's accuracy (0.55 → 0.53, CI across warn 0.95: inconclusive), and
    flips 10 % of the items either way, a Wilson interval wholly above warn 0.05: the tile takes the
    worse verdict, the flips'."""
    task = [config("fp16", {}, {}, baseline=True),
            config("kv2", {"task_recovery": cell(0.96, 0.90, 1.02, "inconclusive", n=200, baseline_value=0.55,
                                                 candidate_value=0.53),
                           "task_flips": cell(0.10, 0.066, 0.149, "warn", n=200)}, {})]
    tile = tiles_by_title(task)["task accuracy"]
    assert (tile.state, tile.value, tile.ci, tile.source) == ("warn", "10%", "[7, 15]", "kv2")
    assert tile.lines == ["accuracy 55% → 53% (kv2)", "recovery -4.0% [-10.0, +2.0] (kv2, inconclusive)"]
    only_recovery = [task[0], config("kv2", {"task_recovery": task[1]["comparisons"]["task_recovery"]}, {})]
    tile = tiles_by_title(only_recovery)["task accuracy"]
    assert (tile.state, tile.value, tile.lines) == ("inconclusive", "-4.0%", ["accuracy 55% → 53% (kv2)"])
    # the accuracies are the headline config's: int8 flips more (critical) while kv2 recovers less
    both = [*task, config("int8", {"task_recovery": cell(1.0, 0.98, 1.02, "ok", n=200, baseline_value=0.55,
                                                         candidate_value=0.55),
                                   "task_flips": cell(0.2, 0.15, 0.26, "critical", n=200)}, {})]
    tile = tiles_by_title(both)["task accuracy"]
    assert (tile.state, tile.source) == ("critical", "int8, worst of 2 on flips")
    assert tile.lines[0] == "accuracy 55% → 55% (int8)" and tile.lines[1].endswith("(kv2, inconclusive)")
