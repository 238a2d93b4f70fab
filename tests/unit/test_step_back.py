"""Step back one layer: which axes make a config stacked, its single-optimization ablations, and
each layer's share of the loss — every figure worked out by hand from the ratios below."""

from __future__ import annotations

import math

import pytest
from app.config_file import ConfigFileError, parse_config
from app.gates import step_back_lines, summary_markdown
from app.models import Gate
from app.schemas import RunConfigOut
from engines.spec import OptimizationSpec, axis_value, changed_axes, single_axis_ablation
from evals.step_back import Layer, StepBack, format_share, layer_shares

from tests.summaries import run_config, run_out

BASE = OptimizationSpec(engine="reference", weights="fp16")
STACKED = OptimizationSpec(engine="reference", weights="awq-int4", kv_cache="turbo-2.5",
                           speculative={"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 4})


def test_shares_of_two_layers_by_hand():
    # log 1.05 = 0.048790, log 1.20 = 0.182322, Σ = 0.231112 → 0.2111 and 0.7889;
    # interaction log 1.30 − Σ = 0.262364 − 0.231112 = 0.031252
    shares, interaction = layer_shares(1.30, {"weights": 1.05, "kv_cache": 1.20})
    assert shares == pytest.approx({"weights": 0.21111, "kv_cache": 0.78889}, abs=1e-5)
    assert interaction == pytest.approx(0.031252, abs=1e-6)
    assert sum(shares.values()) == pytest.approx(1.0)


def test_a_layer_that_loses_nothing_gets_no_share_and_no_loss_alone_gives_no_shares():
    # log 1.0 = 0: the lossless layer's share is 0; log 1.21 = 2 log 1.1 → the other takes all
    shares, interaction = layer_shares(1.21, {"speculative": 1.0, "kv_cache": 1.21})
    assert shares == {"speculative": 0.0, "kv_cache": 1.0} and interaction == pytest.approx(0.0, abs=1e-12)
    # neither layer loses alone (Σ log = log 0.99 + log 1.0 < 0): the whole loss is the interaction
    shares, interaction = layer_shares(1.10, {"weights": 0.99, "kv_cache": 1.0})
    assert shares is None and interaction == pytest.approx(math.log(1.10) - math.log(0.99))
    with pytest.raises(ValueError, match="ratio of kv_cache: 0 is not a positive number"):
        layer_shares(1.1, {"weights": 1.05, "kv_cache": 0})


def test_advice_names_the_largest_share_first_with_each_layer_alone():
    layers = [Layer("weights", "awq-int4", "s~weights-only", 1.05, "ok", False, None),
              Layer("kv_cache", "turbo-2.5", "s~kv_cache-only", 1.20, "critical", False, None),
              Layer("speculative", "draft-k4", "s~speculative-only", 1.0, "ok", True, None)]
    found = StepBack.from_ratios("ppl_ratio", 1.30, layers)
    assert [layer.axis for layer in found.layers] == ["kv_cache", "weights", "speculative"]
    assert found.disable is not None and found.disable.axis == "kv_cache"
    # shares 78.9 % → "79 %", 21.1 % → "21 %", 0 %; interaction exp(0.031252) = 1.0317 → "×1.03"
    assert found.advice() == ("disable kv_cache turbo-2.5: 79 % of the ppl_ratio loss (ppl_ratio 1.2 alone); "
                              "weights awq-int4 21 % (1.05 alone); speculative draft-k4 0 % (1 alone, lossless); "
                              "interaction ×1.03")
    assert found.as_dict()["disable"] == "kv_cache"
    # whole percent, but a small share is not rounded away: log 1.0024 / (log 1.0024 + log 5.37) = 0.14 %
    tiny = math.log(1.0024) / (math.log(1.0024) + math.log(5.37))
    assert (format_share(tiny), format_share(1 - tiny), format_share(0.0), format_share(None)) == (
        "0.1 %", "99.9 %", "0 %", "—")
    nothing_alone = StepBack.from_ratios("ppl_ratio", 1.10, [Layer("weights", "int8", "a", 0.99, "ok", False, None),
                                                             Layer("kv_cache", "int2", "b", 1.0, "ok", False, None)])
    assert nothing_alone.disable is None and "from their interaction" in nothing_alone.advice()


def test_stacked_axes_and_their_ablations():
    assert changed_axes(STACKED, BASE) == ["weights", "kv_cache", "speculative"]
    # int8 weights with `auto` KV is not a KV change; an fp16 KV on an fp16 baseline with `auto` is none either
    assert changed_axes(OptimizationSpec(engine="reference", weights="int8"), BASE) == ["weights"]
    assert changed_axes(OptimizationSpec(engine="reference", kv_cache="fp16"), BASE) == []
    kv_alone = single_axis_ablation(STACKED, BASE, "kv_cache")
    assert (kv_alone.weights, kv_alone.kv_cache, kv_alone.speculative.method) == ("fp16", "turbo-2.5", "off")
    spec_alone = single_axis_ablation(STACKED, BASE, "speculative")
    assert (spec_alone.weights, spec_alone.kv_cache, axis_value(spec_alone, "speculative")) == ("fp16", "auto",
                                                                                                  "draft-k4")
    with pytest.raises(ValueError, match="axis: 'engine' is not an optimization axis"):
        single_axis_ablation(STACKED, BASE, "engine")


def test_step_back_opt_out_is_validated_in_the_config_file():
    doc = {"project": "p", "model": {"name": "m", "path": "builtin:pydoc-target"},
           "configs": [{"name": "fp16", "baseline": True, "engine": "reference"},
                       {"name": "stack", "engine": "reference", "weights": "int8", "kv_cache": "int2",
                        "step_back": False}],
           "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout"}]}
    assert parse_config(doc).configs[1].to_spec().step_back is False
    doc["configs"][1]["step_back"] = "sometimes"
    with pytest.raises(ConfigFileError,
                       match=r"configs\[1\]\.step_back: expected true or false, got .sometimes.; false keeps"):
        parse_config(doc)


def out(fields: dict):
    """A run summary's comparison (app/schemas.py ComparisonOut) from the fields a test cares about."""
    from app.schemas import ComparisonOut

    return ComparisonOut.model_validate({"baseline_value": None, "candidate_value": None, "details": {}, "gated": True,
                                         **fields})


def test_gate_summary_lines_from_a_step_back():
    layers = [{"axis": "kv_cache", "value": "int2", "config": "s~kv_cache-only", "ratio": 1.5, "verdict": "critical",
               "lossless": False, "share": 0.9},
              {"axis": "weights", "value": "int8", "config": "s~weights-only", "ratio": 1.046, "verdict": "ok",
               "lossless": False, "share": 0.1}]
    summary = {"comparisons": [out({"config": "s", "metric": "ppl_ratio", "verdict": "critical", "estimate": 1.6,
                                    "ci_low": 1.5, "ci_high": 1.7, "n": 4, "rule": ""})],
               "step_back": [{"config": "s", "metric": "ppl_ratio", "stacked_ratio": 1.6, "interaction": 0.0,
                              "disable": "kv_cache", "advice": "disable kv_cache int2: 90 %", "layers": layers}]}
    assert step_back_lines(run_out(**summary), "other") == []
    assert step_back_lines(run_out(**summary), "s") == [
        "", "**Step back one layer** (each layer's share of the loss on ppl_ratio):", "",
        "| layer | ppl_ratio alone | share of the loss | run alone as |", "|---|---|---|---|",
        "| kv_cache int2 | 1.5 | 90.0 % | `s~kv_cache-only` |",
        "| weights int8 | 1.046 | 10.0 % | `s~weights-only` |"]


def test_gate_summary_gives_the_step_back_once():
    """The verdict reason carries the advice too (for alerts and the API); the gate summary shows
    it in its own lines and leaves it out of its Reason line."""
    advice = "disable kv_cache int2: 90 %; weights int8 10 % (1.046 alone); interaction ×1"
    layers = [{"axis": "kv_cache", "value": "int2", "config": "s~kv_cache-only", "ratio": 1.5, "verdict": "critical",
               "lossless": False, "share": 0.9}]
    summary = {"run_id": 7, "n_samples": 4, "figures": {},
               "comparisons": [out({"config": "s", "metric": "ppl_ratio", "verdict": "critical", "estimate": 1.6,
                                    "ci_low": 1.5, "ci_high": 1.7, "n": 4, "rule": ""})],
               "verdict_reason": f"s ppl_ratio critical; step back s: {advice}",
               "step_back": [{"config": "s", "metric": "ppl_ratio", "stacked_ratio": 1.6, "interaction": 0.0,
                              "disable": "kv_cache", "advice": advice, "layers": layers}]}
    md = summary_markdown(Gate(candidate="s", baseline="fp16", verdict="fail"), run_out(**summary), "http://dash/",
                          "smoke")
    assert md.count("disable kv_cache int2") == 1
    assert md.rstrip().splitlines()[-1] == "Reason: s ppl_ratio critical"


def test_cli_table_lists_each_layer_under_its_stacked_config(capsys):
    from app.cli import _print_summary, layers_under_their_config

    def config(name, of=None, axis=None):
        return RunConfigOut.model_validate(run_config(name, spec={"weights": "fp16"}, ablation_of=of, ablation_axis=axis))

    configs = [config("fp16"), config("s~kv_cache-only", "s", "kv_cache"), config("s"), config("int8"),
               config("s~weights-only", "s", "weights")]
    assert [c.config for c in layers_under_their_config(configs)] == [
        "fp16", "s", "s~kv_cache-only", "s~weights-only", "int8"]
    ppl = {"metric": "ppl_ratio", "ci_low": None, "ci_high": None, "n": 4, "rule": ""}
    summary = {"run_id": 3, "baseline": "fp16", "n_samples": 4, "configs": configs, "figures": {}, "verdict": "fail",
               "verdict_reason": "s ppl_ratio critical",
               "comparisons": [out({**ppl, "config": "s", "estimate": 5.99, "verdict": "critical"}),
                               out({**ppl, "config": "s~kv_cache-only", "estimate": 5.37, "verdict": "critical"}),
                               out({**ppl, "config": "s~weights-only", "estimate": 1.0024, "verdict": "ok"}),
                               out({**ppl, "config": "int8", "estimate": 1.001, "verdict": "ok"})]}
    _print_summary(run_out(**summary))
    rows = [line for line in capsys.readouterr().out.splitlines() if "│" in line and "ppl ratio" not in line]
    cells = [row.split("│")[1].strip() for row in rows]
    assert cells == ["fp16", "s", "└ kv_cache alone", "└ weights alone", "int8"]
    assert "5.3700" in rows[2] and "critical" in rows[2] and "1.0024" in rows[3]
