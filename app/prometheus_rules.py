"""The Prometheus alerting rules file (deploy/prometheus/canary-rules.yml), written from the metric
table (vocabulary/metrics.py): `canary alert-rules > deploy/prometheus/canary-rules.yml`. A test holds
the committed file to what this writes, so a new metric's rule comes with its row.

Two kinds of rule: canary_verdict (the canary's own CI-based verdict under each metric's
thresholds, project rules included: alert on it), and one rule per gated metric on its raw gauge
against the seed warn threshold, for teams that alert from Prometheus alone."""

from __future__ import annotations

import yaml

from vocabulary.metrics import VERDICT_CODES, Metric, gated_metrics

HEADER = """\
# Prometheus alerting rules for teams that alert from Prometheus instead of the canary's own
# channels. They read the canary API's /metrics (app/prometheus.py). canary_verdict already applies
# each metric's thresholds and confidence intervals (2 = warn, 3 = critical, 4 = measurement
# error): alert on it rather than re-implementing thresholds here; the raw figures are there for
# dashboards.
# Written by `canary alert-rules` from the metric table (vocabulary/metrics.py): do not edit by hand.
"""


def _verdict_rule(level: str, severity: str, summary: str, description: str, alert: str = "") -> dict:
    return {"alert": alert or f"CanaryRegression{level.capitalize()}",
            "expr": f"canary_verdict == {VERDICT_CODES[level]}", "for": "0m", "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description}}


def _metric_rule(metric: Metric) -> dict:
    warn = metric.warn
    if warn is None:  # a gated metric always has one (Metric.__post_init__); an informational one gets no rule
        raise ValueError(f"metric {metric.name}: no seed warn threshold to alert on")
    if metric.name == "ttft_ms":  # exported from the config-run's figures in seconds, not as a comparison gauge
        expr, shown = f"canary_ttft_p50_seconds > {warn / 1000:g}", "p50 s"
    elif metric.direction == "above":  # surely past warn: the CI's low end is
        expr, shown = f"canary_{metric.name}_ci_low > {warn:g}", "CI low"
    else:
        expr, shown = f"canary_{metric.name}_ci_high < {warn:g}", "CI high"
    side = "above" if metric.direction == "above" else "below"
    summary = (f"{{{{ $labels.config }}}} {metric.name} {{{{ $value }}}} ({shown}) {side} {warn:g} "
               "on {{ $labels.model }}")
    return {"alert": metric.alert, "expr": expr, "for": "0m", "labels": {"severity": "warning"},
            "annotations": {"summary": summary,
                            "description": f"Seed warn threshold {warn:g} ({metric.unit}). {metric.definition}."}}


SERVICE_RULES = [
    {"alert": "CanaryQueueBacklog", "expr": "canary_config_runs_queued > 50", "for": "30m",
     "labels": {"severity": "warning"},
     "annotations": {"summary": "{{ $value }} config-runs queued for 30 min: are the GPU workers up?",
                     "description": "See the runbook: workers consuming the gpu queue, broker reachability."}},
    {"alert": "CanaryNotificationsStuck", "expr": "canary_notifications_pending > 0", "for": "1h",
     "labels": {"severity": "warning"},
     "annotations": {"summary": "{{ $value }} notifications undelivered for an hour",
                     "description": "A chat webhook is down or rate-limiting; the outbox retries with backoff."}},
    {"alert": "CanaryStale", "expr": "canary_schedule_stale == 1", "for": "0m", "labels": {"severity": "critical"},
     "annotations": {"summary": "schedule {{ $labels.schedule }} of {{ $labels.project }} has not succeeded for over "
                                "a period: its verdicts are old",
                     "description": "The run due after the schedule's last success is overdue by more than one "
                                    "period. Is the beat up (exactly one), are the workers consuming gpu and cpu? "
                                    "See docs/runbooks.md, CanaryStale."}},
]


def render() -> str:
    rules = [
        _verdict_rule("critical", "critical",
                      "{{ $labels.config }} {{ $labels.metric }} is critical on {{ $labels.model }}",
                      "The latest canary run judged {{ $labels.metric }} of config {{ $labels.config }} past its "
                      "critical threshold (CI-based verdict)."),
        _verdict_rule("warn", "warning",
                      "{{ $labels.config }} {{ $labels.metric }} is past warn on {{ $labels.model }}",
                      "The latest canary run judged {{ $labels.metric }} of config {{ $labels.config }} past its warn "
                      "threshold."),
        _verdict_rule("measurement_error", "warning",
                      "{{ $labels.config }} {{ $labels.metric }} cannot be measured on {{ $labels.model }}",
                      "The latest canary run found a figure that cannot be right (all-zero or NaN log-probs, an "
                      "estimate outside the metric's range, spec-decode counters moved by other traffic): the run is "
                      "incomplete and the gate does not pass.", alert="CanaryMeasurementError"),
        *(_metric_rule(metric) for metric in gated_metrics().values()),
        *SERVICE_RULES,
    ]
    body = yaml.safe_dump({"groups": [{"name": "inference-canary", "rules": rules}]}, sort_keys=False,
                          allow_unicode=True, width=1000)
    return HEADER + body
