"""Where an alert's runbook is: the section of docs/runbooks.md that names its alert, as a link
(Alertmanager's `runbook_url` annotation). The sections are listed here, not read from the docs (an
installed wheel has no docs/); tests/unit/test_runbooks.py holds the list to the file's headings.

The link's base is the setting `runbook_url` (where a team publishes the canary's docs, e.g. its
repository's `…/blob/main/docs/runbooks.md`); unset, it is the path in the canary's repository."""

from __future__ import annotations

import re

RUNBOOKS = "docs/runbooks.md"
# docs/runbooks.md's alert sections (its "## " headings under "# Quality alerts"), in order
SECTIONS = (
    "CanaryRegressionCritical", "CanaryRegressionWarn", "CanaryPerplexityRatioHigh", "CanarySpecAcceptanceLow",
    "CanaryTTFTHigh", "CanaryTTFTRatioHigh, CanaryTPOTRatioHigh", "Judge alerts (judge_win_rate, judge_score_delta)",
    "Faithfulness alerts", "CanaryKvCacheUsageHigh", "CanaryMeasurementError", "CanaryGenerationNLLRatioHigh",
    "CanaryLosslessDiverged", "CanaryConfidentDivergence, CanaryBatchDivergence",
    "CanaryEmptyAnswers, CanaryDegenerateAnswers, CanaryMaxTokensHits, CanaryEarlyStops, CanaryOutputLengthLow",
    "CanaryFaithfulnessLow, CanaryJudgeWinRateLow, CanaryJudgeScoreDeltaLow", "CanaryQueueBacklog", "CanaryStale",
    "CanaryNotificationsStuck",
)
FALLBACK = "Quality alerts"  # the part every quality alert's section belongs to


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub and most Markdown renderers make it: lower case, punctuation
    other than '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def section(alertname: str) -> str:
    """The heading of the section that names the alert (a per-metric alert name, CanaryStale, …);
    the quality alerts' part for any other."""
    for heading in SECTIONS:
        if alertname in re.findall(r"\w+", heading):
            return heading
    return FALLBACK


def runbook_url(alertname: str, base: str = "") -> str:
    """The alert's runbook: `base` (the setting runbook_url) or the docs' path, with its section's anchor."""
    return f"{(base or RUNBOOKS).split('#')[0]}#{anchor(section(alertname))}"


def alert_runbook(labels: dict[str, str], base: str = "") -> str:
    """The runbook of an alert by its labels: its alertname (CanaryStale, …), else its metric's alert."""
    from vocabulary.metrics import METRICS

    name = labels.get("alertname") or ""
    metric = METRICS.get(labels.get("metric", ""))
    return runbook_url(name or (metric.alert if metric else ""), base)
