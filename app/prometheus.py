"""Prometheus /metrics for the API, read from Postgres at scrape time (the database is the source
of truth; nothing is lost when an API process restarts).

Who sees what: without a key, only figures with no project in them (build info, the API
process's own figures, the rate limiter's bucket counts). A key with the `metrics` scope adds
the figures below for its own project; one with `metrics-all` (an operator's Prometheus) adds
them for every project. Other keys get 403, an unknown key 401 (docs/api.md).

Service metrics:
  canary_runs{project,status}                       runs by status
  canary_config_runs_queued / _running              GPU queue depth and work in flight
  canary_notifications_pending                      outbox backlog
  canary_config_run_duration_seconds                 a summary: {quantile} over the last 24 h's config-runs,
                                                    _count and _sum over every finished config-run
Canary metrics per model and config, from each config's latest finished run:
  canary_<metric> for every metric of the table (vocabulary/metrics.py) but ttft_ms, whose figure is
  the one below: canary_ppl_ratio, canary_judge_win_rate, …  {project,model,config} + _ci_low / _ci_high
  canary_ttft_p50_seconds, canary_ttft_p99_seconds (the latest run's percentiles, in seconds: a
  run's figure, not a summary of observations), canary_tokens_per_second, canary_kv_bytes_per_token
  canary_verdict{project,model,config,metric}        0 ok, 1 inconclusive, 2 warn, 3 critical
  canary_alerts_firing{project,severity}
  canary_schedule_stale{project,schedule}           1 when a schedule's runs stopped succeeding (app/staleness.py)
  canary_schedule_last_success_timestamp_seconds{project,schedule}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Select, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from app.models import (
    Alert,
    Channel,
    ComparisonRow,
    ConfigRun,
    Model,
    Notification,
    OptimizationConfig,
    Project,
    Run,
    aware,
    utcnow,
)
from vocabulary.metrics import METRICS, VERDICT_CODES, VERDICTS

if TYPE_CHECKING:
    from typing_extensions import Unpack

    AnySelect = Select[Unpack[tuple[Any, ...]]]  # a select of any columns

# every metric of the table is a gauge with its CI; TTFT is exported from the config-run's
# figures instead (p50 and p99 in seconds, canary_ttft_p50_seconds below)
COMPARISON_GAUGES = tuple(name for name in METRICS if name != "ttft_ms")
VERDICT_HELP = ", ".join(f"{VERDICT_CODES[v]} {v}" for v in VERDICTS)


class CanaryCollector(Collector):
    def __init__(self, session_factory: Callable[[], AbstractContextManager[Session]],
                 project_id: int | None = None) -> None:
        self.session_factory = session_factory
        self.project_id = project_id  # None: every project

    def _mine(self, q: AnySelect, project_column: InstrumentedAttribute[int]) -> AnySelect:
        return q if self.project_id is None else q.where(project_column == self.project_id)

    def collect(self) -> Iterator[Metric]:
        with self.session_factory() as session:
            yield from self._service(session)
            yield from self._canary(session)

    def _service(self, session: Session) -> Iterator[Metric]:
        runs = GaugeMetricFamily("canary_runs", "Runs by status", labels=["project", "status"])
        by_status = self._mine(select(Project.name, Run.status, func.count())
                               .join(Project, Project.id == Run.project_id), Run.project_id)
        by_status = by_status.group_by(Project.name, Run.status)
        for project, status, count in session.execute(by_status):
            runs.add_metric([project, status], count)
        yield runs
        for status in ("queued", "running"):
            count = session.scalar(self._mine(select(func.count()).select_from(ConfigRun)
                                              .join(Run, Run.id == ConfigRun.run_id)
                                              .where(ConfigRun.status == status), Run.project_id)) or 0
            yield GaugeMetricFamily(f"canary_config_runs_{status}", f"Config-runs {status}", value=count)
        pending = session.scalar(self._mine(select(func.count()).select_from(Notification)
                                            .join(Channel, Channel.id == Notification.channel_id)
                                            .where(Notification.status == "pending"), Channel.project_id)) or 0
        yield GaugeMetricFamily("canary_notifications_pending", "Notifications waiting in the outbox", value=pending)
        since = utcnow() - timedelta(hours=24)
        finished = self._mine(select(ConfigRun.started_at, ConfigRun.finished_at).join(Run, Run.id == ConfigRun.run_id)
                              .where(ConfigRun.finished_at.is_not(None), ConfigRun.started_at.is_not(None)),
                              Run.project_id)
        durations, total, count = [], 0.0, 0
        for started, ended in session.execute(finished):
            seconds = (ended - started).total_seconds()
            total, count = total + seconds, count + 1
            ended_at = aware(ended)  # never None: the query keeps finished config-runs only
            if ended_at is not None and ended_at >= since:
                durations.append(seconds)
        # a summary: quantiles over a sliding window (the last 24 h), _count and _sum over every
        # finished config-run, so that rate() of them is the mean duration
        summary = Metric("canary_config_run_duration_seconds", "Config-run wall time (quantiles over the last 24 h)",
                         "summary")
        durations.sort()
        for quant in (0.5, 0.95, 1.0):
            if durations:
                summary.add_sample("canary_config_run_duration_seconds", {"quantile": str(quant)},
                                   durations[min(len(durations) - 1, int(quant * (len(durations) - 1) + 0.5))])
        summary.add_sample("canary_config_run_duration_seconds_count", {}, count)
        summary.add_sample("canary_config_run_duration_seconds_sum", {}, total)
        yield summary
        yield GaugeMetricFamily("canary_config_runs_finished_24h", "Config-runs finished in the last 24 h",
                                value=len(durations))
        firing = GaugeMetricFamily("canary_alerts_firing", "Alerts firing", labels=["project", "severity"])
        by_severity = self._mine(select(Project.name, Alert.severity, func.count())
                                 .join(Project, Project.id == Alert.project_id).where(Alert.state == "firing"),
                                 Alert.project_id).group_by(Project.name, Alert.severity)
        for project, severity, count in session.execute(by_severity):
            firing.add_metric([project, severity], count)
        yield firing
        from app.staleness import schedule_health

        stale = GaugeMetricFamily("canary_schedule_stale", "1 when the run a schedule owes after its last success is "
                                  "overdue by more than one period (app/staleness.py)", labels=["project", "schedule"])
        beat = GaugeMetricFamily("canary_schedule_last_success_timestamp_seconds",
                                 "When the schedule's last successful run ended (its creation if none)",
                                 labels=["project", "schedule"])
        for health in schedule_health(session, project_id=self.project_id):
            stale.add_metric([health.project, health.schedule], float(health.stale))
            beat.add_metric([health.project, health.schedule], health.heartbeat.timestamp())
        yield stale
        yield beat

    def _canary(self, session: Session) -> Iterator[Metric]:
        # each config's latest finished (done) run that included it
        latest = (select(ConfigRun.config_id, func.max(ConfigRun.run_id).label("run_id"))
                  .join(Run, Run.id == ConfigRun.run_id).where(Run.status == "done", ConfigRun.status == "succeeded")
                  .group_by(ConfigRun.config_id).subquery())
        rows = session.execute(self._mine(select(latest.c.config_id, latest.c.run_id, OptimizationConfig.name,
                                                 Model.name, Project.name)
                                          .join(OptimizationConfig, OptimizationConfig.id == latest.c.config_id)
                                          .join(Model, Model.id == OptimizationConfig.model_id)
                                          .join(Project, Project.id == Model.project_id)
                                          # a stacked config's ablations (step back) are no config to alert on
                                          .where(OptimizationConfig.ablation_of_id.is_(None)), Project.id)).all()
        labels = ["project", "model", "config"]
        gauges = {metric: GaugeMetricFamily(f"canary_{metric}", f"Latest {metric} vs baseline ({METRICS[metric].unit})",
                                            labels=labels)
                  for metric in COMPARISON_GAUGES}
        bounds = {(metric, side): GaugeMetricFamily(f"canary_{metric}_ci_{side}", f"95% CI {side} of canary_{metric}",
                                                    labels=labels)
                  for metric in COMPARISON_GAUGES for side in ("low", "high")}
        verdict = GaugeMetricFamily("canary_verdict", VERDICT_HELP, labels=[*labels, "metric"])
        ttft = {q: GaugeMetricFamily(f"canary_ttft_{q}_seconds", f"Time to first token, {q} of the latest run (s)",
                                     labels=labels) for q in ("p50", "p99")}
        tokens_per_second = GaugeMetricFamily("canary_tokens_per_second", "Decode tokens per second", labels=labels)
        kv_bytes = GaugeMetricFamily("canary_kv_bytes_per_token", "KV-cache bytes per token", labels=labels)
        by_run: dict[int, list] = {}
        for config_id, run_id, config, model, project in rows:
            by_run.setdefault(run_id, []).append((config_id, config, model, project))
        for run_id, configs in by_run.items():
            comparisons = {(row.config_id, row.metric): row
                           for row in session.scalars(select(ComparisonRow).where(ComparisonRow.run_id == run_id))}
            figures = {config_run.config_id: config_run.figures or {}
                       for config_run in session.scalars(select(ConfigRun).where(ConfigRun.run_id == run_id))}
            for config_id, config, model, project in configs:
                values = [project, model, config]
                for metric in COMPARISON_GAUGES:
                    comparison = comparisons.get((config_id, metric))
                    if comparison is not None and comparison.estimate is not None:
                        gauges[metric].add_metric(values, comparison.estimate)
                        if comparison.ci_low is not None:
                            bounds[(metric, "low")].add_metric(values, comparison.ci_low)
                            bounds[(metric, "high")].add_metric(values, cast(float, comparison.ci_high))  # with ci_low
                for (compared_config, metric), comparison in comparisons.items():
                    if compared_config == config_id:
                        verdict.add_metric([*values, metric], VERDICT_CODES.get(comparison.verdict, 1))
                config_figures = figures.get(config_id, {})
                for q in ("p50", "p99"):
                    if config_figures.get(f"ttft_ms_{q}") is not None:
                        ttft[q].add_metric(values, config_figures[f"ttft_ms_{q}"] / 1000)
                if config_figures.get("tokens_per_second") is not None:
                    tokens_per_second.add_metric(values, config_figures["tokens_per_second"])
                if config_figures.get("kv_bytes_per_token") is not None:
                    kv_bytes.add_metric(values, config_figures["kv_bytes_per_token"])
        yield from gauges.values()
        yield from bounds.values()
        yield from (verdict, *ttft.values(), tokens_per_second, kv_bytes)


class PublicCollector(Collector):
    """Figures with no project in them, shown without a key: the build and the API process's
    rate-limit bucket counts (app/api/limits.py)."""

    def __init__(self, version: str, buckets: dict[str, tuple[int, int]]):
        self.version = version
        self.buckets = buckets  # kind -> (entries, cap)

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("canary_build_info", "The API's version", labels=["version"])
        info.add_metric([self.version], 1)
        yield info
        held = GaugeMetricFamily("canary_rate_limit_buckets", "Rate-limit buckets held by this API process",
                                 labels=["kind"])
        cap = GaugeMetricFamily("canary_rate_limit_buckets_max", "The most rate-limit buckets this API process holds",
                                labels=["kind"])
        for kind, (entries, most) in self.buckets.items():
            held.add_metric([kind], entries)
            cap.add_metric([kind], most)
        yield held
        yield cap
