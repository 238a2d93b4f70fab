"""The verdict summary for people (app/summary.py), from hand-made comparison rows whose lines are
worked out by hand."""

from __future__ import annotations

from app.schemas import ComparisonOut, StepBackOut
from app.summary import MAX_LINES, finding, verdict_summary


def row(config, metric, estimate, low, high, verdict, n=12, rule="", informational=False):
    return ComparisonOut(config=config, metric=metric, estimate=estimate, ci_low=low, ci_high=high, n=n, verdict=verdict,
                         rule=rule, baseline_value=None, candidate_value=None, details={}, gated=not informational)


def test_each_config_gets_one_line_in_its_group_worst_first():
    rows = [
        row("fp16", "ppl_ratio", 1.0, 1.0, 1.0, "ok"),  # the baseline: no line
        # int2: critical on two quality metrics and warn on TTFT; its worst quality finding is the ppl ratio
        # (the table's first metric among equal verdicts): 1.059 → +5.90 %, CI 1.045..1.082 → +4.50..+8.20
        row("int2", "gen_nll_ratio", 1.4, 1.35, 1.5, "critical"),
        row("int2", "ppl_ratio", 1.059, 1.045, 1.082, "critical"),
        row("int2", "ttft_ratio", 1.3, 1.26, 1.4, "warn"),
        # kv-int2: one critical finding, but further past critical 1.3 than int2's: log 1.5 / log 1.3 = 1.55
        # against log 1.059 / log 1.3 = 0.22, so first
        row("kv-int2", "ppl_ratio", 1.5, 1.4, 1.6, "critical"),
        # int4: warn on quality → watch
        row("int4", "ppl_ratio", 1.2, 1.16, 1.25, "warn"),
        # fp8-kv: quality ok, TPOT critical → slower than the baseline; its empty-answer share 0 → not shown
        row("fp8-kv", "ppl_ratio", 1.0, 0.99, 1.01, "ok"),
        row("fp8-kv", "tpot_ratio", 1.6, 1.55, 1.7, "critical"),
        # kivi: only inconclusive → undecided, saying how many samples would decide it
        row("kivi", "ppl_ratio", 1.1, 1.0, 1.2, "inconclusive", n=20,
            rule="CI [1, 1.2] straddles warn 1.15: more samples needed (about 80 at this effect)"),
        # int8: all ok → no line; an informational breach never counts
        row("int8", "ppl_ratio", 1.001, 0.99, 1.01, "ok"),
        row("int8", "exact_match", 0.5, 0.4, 0.6, "critical", informational=True),
    ]
    advice = [StepBackOut(config="kv-int2", metric="ppl_ratio", stacked_ratio=1.5, interaction=0.0, disable="kv_cache",
                          advice="disable kv_cache int2: 100 %", layers=[])]
    summary = verdict_summary(rows, advice, baseline="fp16")
    assert summary.lines == [
        "drop or fix (2):",
        "  kv-int2: ppl ratio +50.00% [+40.00, +60.00] critical — step back: disable kv_cache int2: 100 %",
        "  int2: ppl ratio +5.90% [+4.50, +8.20] critical; TTFT ratio +30.00% [+26.00, +40.00] warn",
        "watch (1):",
        "  int4: ppl ratio +20.00% [+16.00, +25.00] warn",
        "slower than the baseline (1):",
        "  fp8-kv: TPOT ratio +60.00% [+55.00, +70.00] critical",
        "undecided (1):",
        "  kivi: ppl ratio +10.00% [+0.00, +20.00] inconclusive at n=20 (about 80 samples would decide it)",
        "ship (1): int8",
    ]
    assert summary.more == 0
    assert summary.counts == {"drop or fix": 2, "watch": 1, "slower than the baseline": 1, "undecided": 1, "ship": 1}
    assert [round(line.severity, 2) for line in summary.groups["drop or fix"]] == [1.55, 0.22]
    int2 = summary.groups["drop or fix"][1]
    assert (int2.critical, int2.warn, int2.quality.metric, int2.speed.metric) == (2, 1, "ppl_ratio",
                                                                                                     "ttft_ratio")


def test_fifteen_breaching_configs_fit_twelve_lines_with_a_count_of_the_rest():
    """15 critical configs: a heading, 10 config lines and '… and 5 more configs' = 12 lines."""
    rows = [row(f"c{i:02d}", "ppl_ratio", 1.5, 1.4, 1.6, "critical") for i in range(15)]
    summary = verdict_summary(rows)
    assert len(summary.lines) == MAX_LINES == 12
    assert summary.lines[0] == "drop or fix (15):" and summary.lines[1].startswith("  c00: ")
    assert summary.lines[-1] == "… and 5 more configs (every finding: --wide, --json or the run page)"
    assert summary.more == 5 and len(summary.groups["drop or fix"]) == 15  # every config stays in groups
    # 9 critical, 6 warn: a heading and 9 lines make 10; the watch heading, its first line and the count
    # would make 13, so the summary stops at 10 and counts the 6 left out (no heading without its line)
    mixed = rows[:9] + [row(f"w{i}", "ppl_ratio", 1.2, 1.16, 1.25, "warn") for i in range(6)]
    lines = verdict_summary(mixed).lines
    assert len(lines) == 11 and "watch (6):" not in lines and lines[-1].startswith("… and 6 more configs")


def test_nothing_breaching_is_ship_and_a_measurement_error_is_to_fix():
    assert verdict_summary([row("int8", "ppl_ratio", 1.0, 0.99, 1.01, "ok")]).lines == ["ship (1): int8"]
    assert verdict_summary([]).lines == []
    broken = verdict_summary([row("x", "ppl_ratio", None, None, None, "measurement_error")])
    assert broken.lines == ["drop or fix (1):", "  x: ppl ratio measurement_error"]
    assert finding(row("x", "empty_answers", 0.25, 0.1, 0.4, "critical")) == "empty 25.0% [10.0, 40.0] critical"


def test_the_cap_never_cuts_the_undecided_and_every_candidate_has_one_group():
    # 15 critical configs fill the cap (a heading, 10 lines, the count of 5 more); the 2 undecided
    # ones still show, each with its n and what decides it, and the 3 that are fine in one ship line
    rows = [row(f"c{i:02d}", "ppl_ratio", 1.5, 1.4, 1.6, "critical") for i in range(15)]
    rows += [row("u1", "ppl_ratio", 1.1, 1.0, 1.2, "inconclusive", n=12, rule="… (about 48 at this effect)"),
             row("u2", "ttft_ratio", 1.1, 0.9, 1.4, "inconclusive", n=3)]
    rows += [row(name, "ppl_ratio", 1.0, 0.99, 1.01, "ok") for name in ("s1", "s2", "s3")]
    summary = verdict_summary(rows)
    assert summary.lines[:12][-1].startswith("… and 5 more configs")
    assert summary.lines[12:] == [
        # the one nearer its critical threshold first: log 1.1 / log 1.3 = 0.36 against log 1.1 / log 1.5 = 0.24
        "undecided (2):",
        "  u1: ppl ratio +10.00% [+0.00, +20.00] inconclusive at n=12 (about 48 samples would decide it)",
        "  u2: TTFT ratio +10.00% [-10.00, +40.00] inconclusive at n=3 (below min_n 10)",
        "ship (3): s1, s2, s3",
    ]
    every = [line.config for lines in summary.groups.values() for line in lines]
    assert sorted(every) == sorted({r.config for r in rows}) and len(every) == len(set(every))


def test_a_speed_finding_names_its_engine_and_device_and_the_undecided_get_a_command():
    from app.services import decide_command

    rows = [row("fp8-kv", "tpot_ratio", 1.6, 1.55, 1.7, "critical"),
            row("served", "tpot_ratio", 1.6, 1.55, 1.7, "critical"),
            # two undecided configs: the command asks for the most either needs (80), for both
            row("a", "ppl_ratio", 1.1, 1.0, 1.2, "inconclusive", rule="… (about 80 at this effect)"),
            row("b", "ppl_ratio", 1.1, 1.0, 1.2, "inconclusive", n=4, rule="CI straddles warn")]
    figures = {"fp8-kv": {"engine": "reference", "device": "cuda:0:NVIDIA H200"},
               # a served model's device is its URL: named by host, never with a credential it may carry
               "served": {"engine": "openai", "device": "http://user:secret@vllm.internal:8000/v1"}}
    run = decide_command("serving", "pydoc-smoke", "manual")
    lines = verdict_summary(rows, figures=figures, decide_with=run).lines
    assert "  fp8-kv: TPOT ratio +60.00% [+55.00, +70.00] critical (reference engine on cuda:0:NVIDIA H200)" in lines
    assert "  served: TPOT ratio +60.00% [+55.00, +70.00] critical (openai engine on vllm.internal)" in lines
    assert "secret" not in "\n".join(lines)
    # b stands below ppl_ratio's min_n with no figure in its rule: min_n decides it; a's 80 is more
    assert lines[-1] == "  decide: canary run -f canary.yaml --suite pydoc-smoke --configs a,b --samples 80"
    # a gate's run has one candidate: the gate again, on more samples
    gate = decide_command("serving", "pydoc-smoke", "gate")
    assert verdict_summary(rows[2:3], decide_with=gate).lines[-1] == (
        "  decide: canary gate --candidate a --suite pydoc-smoke --project serving --samples 80")
    # a suite of 50 documents cannot give a's 80 (the rule a top-up follows: workers/top_up.py reachable):
    # the command is sized for b alone, and a is named apart
    capped = verdict_summary(rows, figures=figures, decide_with=run, decide_cap=50).lines[-2:]
    assert capped == ["  decide: canary run -f canary.yaml --suite pydoc-smoke --configs b --samples 10",
                      "  decide: not on this suite (a larger corpus or task would): a's ppl ratio needs about 80 "
                      "documents (at most 50 here)"]
    # …and when the run drew all 50 already, no command can decide them there
    spent = verdict_summary(rows, figures=figures, decide_with=run, decide_cap=50, drawn=50).lines[-1]
    # (a's n, 12, counts 12 of the 50 drawn: about 80 of them means 80 × 50 / 12 = 334 drawn; b's 10 of 4: 125)
    assert spent == ("  decide: not on this suite (a larger corpus or task would): a's ppl ratio needs about 334 "
                     "documents (at most 50 here), b's ppl ratio needs about 125 documents (at most 50 here)")
    # the demo's case: 100 documents drawn of a larger corpus, and configs undecided on answers (n = the
    # suite's 16 prompts, "about 60 would decide"): more documents add no prompts, so no --samples command
    # for them (it asked for 60, fewer than drawn, and called the suite spent); the suite's
    # generation.prompts is what decides them, said for the configs it counts
    answers = [row("kv-fp8", "degenerate_answers", 0.0625, 0.0, 0.188, "inconclusive", n=16,
                   rule="… (about 60 at this effect)"),
               row("int8", "degenerate_answers", 0.125, 0.0, 0.312, "inconclusive", n=16,
                   rule="… (about 28 at this effect)")]
    demo = decide_command("demo", "pydoc", "manual")
    assert verdict_summary(answers, decide_with=demo, decide_cap=1000, drawn=100).lines[-1] == (
        "  decide: raise the suite's generation.prompts about 60 (int8, kv-fp8: more documents alone would not)")
    # both kinds: a --samples command for the documents' comparison, and the setting for the answers'
    ppl = row("b2", "ppl_ratio", 1.1, 1.0, 1.2, "inconclusive", n=100, rule="… (about 180 at this effect)")
    both = verdict_summary([*answers, ppl], decide_with=run, decide_cap=1000, drawn=100).lines
    assert both[-2:] == ["  decide: canary run -f canary.yaml --suite pydoc-smoke --configs b2 --samples 180",
                         "  decide: raise the suite's generation.prompts about 60 (int8, kv-fp8: more documents "
                         "alone would not)"]
    # a comparison over some of the documents (those with domain terms: 40 of 100) needs 80 of them: about
    # 80 × 100 / 40 = 200 drawn, never a --samples at or below the 100 the run drew
    terms = row("t", "term_nll_ratio", 1.1, 1.0, 1.2, "inconclusive", n=40, rule="… (about 80 at this effect)")
    assert verdict_summary([terms], decide_with=run, decide_cap=1000, drawn=100).lines[-1] == (
        "  decide: canary run -f canary.yaml --suite pydoc-smoke --configs t --samples 200")
    # the demo: one command for both, its prompts drawn from its documents (so at least as many documents)
    from app.services import decide_settings_commands

    commands = decide_settings_commands("demo")
    demo_lines = verdict_summary([*answers, ppl], decide_with=demo, decide_cap=1000, drawn=100,
                                 decide_settings_with=commands).lines
    assert demo_lines[-1] == "  decide: canary demo --samples 180 --prompts 60"
    assert verdict_summary(answers, decide_with=demo, decide_cap=1000, drawn=100,
                           decide_settings_with=commands).lines[-1] == "  decide: canary demo --samples 100 --prompts 60"
    # more prompts than the corpus gives (600 documents; a suite takes at most 1000): not sized for, named
    # apart, as is a timing ratio that needs a hundred thousand (kv-fp8's TTFT on a shared CPU, the demo's
    # case); the command asks only for what int8 needs
    many = [row("kv-fp8", "degenerate_answers", 0.01, 0.0, 0.05, "inconclusive", n=16, rule="… (about 2400 at this effect)"),
            row("kv-fp8", "ttft_ratio", 1.2, 1.1, 1.3, "inconclusive", n=16, rule="… (about 102067 at this effect)"),
            answers[1]]
    assert verdict_summary(many, decide_with=demo, decide_cap=600, drawn=100,
                           decide_settings_with=commands).lines[-2:] == [
        "  decide: canary demo --samples 100 --prompts 28",
        "  decide: not on this suite (a larger corpus or task would): kv-fp8's degenerate needs about 2400 prompts (at "
        "most 600 here), kv-fp8's TTFT ratio needs about 102067 prompts (at most 600 here; a quieter host narrows a "
        "timing ratio)"]
    # labelled items only: the demo's command raises --items and draws what the run drew (never --samples 0);
    # elsewhere the setting is named in words
    flips = [row("int8", "task_flips", 0.0125, 0.002, 0.0675, "inconclusive", n=80, rule="… (about 172 at this effect)")]
    assert verdict_summary(flips, decide_with=demo, decide_cap=600, drawn=100, decide_settings_with=commands).lines[-1] \
        == "  decide: canary demo --samples 100 --items 172"
    assert verdict_summary(flips, decide_with=run, decide_cap=600, drawn=100).lines[-1] == (
        "  decide: raise the suite's labelled.max_items about 172 (int8: more documents alone would not)")
    # the same run's user outside the demo: canary.yaml holds the prompts, so they are named in words
    assert verdict_summary(many, decide_with=run, decide_cap=600, drawn=100).lines[-2] == (
        "  decide: raise the suite's generation.prompts about 28 (int8: more documents alone would not)")
    assert decide_settings_commands("shop") == {}
    assert decide_command("demo", "pydoc", "manual") == "canary demo --samples {samples}"
    assert decide_command("p", "s", "schedule") == "canary run -f canary.yaml --suite s --configs {configs} --samples {samples}"
