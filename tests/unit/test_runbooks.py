"""An alert's runbook link (app/runbooks.py): the section of docs/runbooks.md that names it, its anchor
worked out by hand, on every surface that shows an alert."""

from __future__ import annotations

import re

from app.runbooks import FALLBACK, SECTIONS, alert_runbook, anchor, runbook_url, section
from vocabulary.metrics import METRICS

from tests.conftest import ROOT


def test_the_sections_are_the_runbooks_alert_headings():
    text = (ROOT / "docs/runbooks.md").read_text()
    part = text[text.index("\n# Quality alerts"):text.index("\n# Failures")]
    assert tuple(re.findall(r"^## (.+)$", part, re.M)) == SECTIONS
    assert f"\n# {FALLBACK}\n" in text


def test_anchors_and_links_by_hand():
    assert anchor("CanaryTTFTRatioHigh, CanaryTPOTRatioHigh") == "canaryttftratiohigh-canarytpotratiohigh"
    assert anchor("Judge alerts (judge_win_rate, judge_score_delta)") == "judge-alerts-judge_win_rate-judge_score_delta"
    assert runbook_url("CanaryTPOTRatioHigh", "https://docs.example/canary/runbooks.md#old") == (
        "https://docs.example/canary/runbooks.md#canaryttftratiohigh-canarytpotratiohigh")
    assert alert_runbook({"metric": "ppl_ratio", "config": "int4"}) == "docs/runbooks.md#canaryperplexityratiohigh"
    assert alert_runbook({"alertname": "CanaryStale"}) == "docs/runbooks.md#canarystale"
    assert alert_runbook({"metric": "no_such_metric"}) == "docs/runbooks.md#quality-alerts"


def test_every_gated_metric_has_a_section_or_the_quality_alerts_part():
    # the metrics without a section of their own are listed: a new metric's alert should get one
    without = sorted(m.name for m in METRICS.values() if m.gated and section(m.alert) == FALLBACK)
    assert without == ["task_flips", "task_recovery", "term_nll_ratio"], without

