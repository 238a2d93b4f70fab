"""SQLAlchemy models: the domain model of docs/design.md. API schemas live in app/schemas.py."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, overload

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column, relationship

from app.db import Base
from vocabulary.suite import SuiteSpec

JSONType = JSON().with_variant(JSONB(), "postgresql")
BigId = BigInteger().with_variant(Integer(), "sqlite")  # SQLite autoincrements INTEGER keys only


# References into a project's history (runs, results) are checked at commit, so deleting a
# whole project cascades cleanly, while deleting one config that still has results is refused.
DEFERRED: dict[str, Any] = {"deferrable": True, "initially": "DEFERRED"}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@overload
def aware(dt: datetime) -> datetime: ...
@overload
def aware(dt: datetime | None) -> datetime | None: ...


def aware(dt: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    return dt.replace(tzinfo=timezone.utc) if dt is not None and dt.tzinfo is None else dt


class TimestampMixin:
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, nullable=False)


class Project(TimestampMixin, Base):
    __tablename__ = "projects"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)


class ApiKey(TimestampMixin, Base):
    """Keys are scoped to one project; only a hash is stored (docs/reference.md §10)."""

    __tablename__ = "api_keys"
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    name: Mapped[str] = mapped_column(String(128), nullable=False)
    key_hash: Mapped[str] = mapped_column(String(128), unique=True, nullable=False)
    scope: Mapped[str] = mapped_column(String(16), nullable=False)  # read | write
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Model(TimestampMixin, Base):
    __tablename__ = "models"
    __table_args__ = (UniqueConstraint("project_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    name: Mapped[str] = mapped_column(String(128), nullable=False)
    path: Mapped[str] = mapped_column(Text, nullable=False)  # local HF directory, builtin:NAME or endpoint URL


class OptimizationConfig(TimestampMixin, Base):
    __tablename__ = "optimization_configs"
    __table_args__ = (UniqueConstraint("project_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), nullable=False)
    name: Mapped[str] = mapped_column(String(128), nullable=False)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONType, nullable=False)  # engines.spec.OptimizationSpec
    is_baseline: Mapped[bool] = mapped_column(Boolean, default=False, nullable=False)
    # A single-optimization ablation of a stacked config (workers/step_back.py): the baseline with only
    # `ablation_axis` of `ablation_of`. Created by the service, never listed among the project's configs.
    ablation_of_id: Mapped[int | None] = mapped_column(ForeignKey("optimization_configs.id", ondelete="CASCADE"))
    ablation_axis: Mapped[str | None] = mapped_column(String(16))  # weights | kv_cache | speculative
    model: Mapped[Model] = relationship(lazy="joined")


class Suite(TimestampMixin, Base):
    __tablename__ = "suites"
    __table_args__ = (UniqueConstraint("project_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    name: Mapped[str] = mapped_column(String(128), nullable=False)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONType, nullable=False)  # app.config_file.SuiteEntry
    # Content hash of the current samples. Samples are immutable per version: a changed corpus
    # adds a version, so in-flight runs and history keep scoring the text they drew.
    version: Mapped[str] = mapped_column(String(64), nullable=False)
    n_documents: Mapped[int] = mapped_column(Integer, default=0, nullable=False)

    @property
    def settings(self) -> SuiteSpec:
        """The stored spec, typed, with this release's default for anything an older spec lacks."""
        return SuiteSpec.model_validate(self.spec)


class SuiteSample(Base):
    """One item of a suite: a domain document (perplexity), a prompt (+ reference) for the
    judge, or a RAG item (question + contexts). ``cluster`` groups samples that share a source."""

    __tablename__ = "suite_samples"
    __table_args__ = (UniqueConstraint("suite_id", "version", "key"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    suite_id: Mapped[int] = mapped_column(ForeignKey("suites.id", ondelete="CASCADE"), nullable=False)
    version: Mapped[str] = mapped_column(String(64), nullable=False)
    key: Mapped[str] = mapped_column(String(256), nullable=False)
    position: Mapped[int] = mapped_column(Integer, nullable=False)
    kind: Mapped[str] = mapped_column(String(16), default="document", nullable=False)  # document | prompt | rag
    text: Mapped[str] = mapped_column(Text, nullable=False)
    reference: Mapped[str | None] = mapped_column(Text)
    contexts: Mapped[list[str] | None] = mapped_column(JSONType)
    cluster: Mapped[str | None] = mapped_column(String(256))


class Run(TimestampMixin, Base):
    __tablename__ = "runs"
    __table_args__ = (UniqueConstraint("project_id", "idempotency_key"),
                      Index("ix_runs_project_created", "project_id", "created_at"))
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    suite_id: Mapped[int] = mapped_column(ForeignKey("suites.id", **DEFERRED), nullable=False)
    suite_version: Mapped[str] = mapped_column(String(64), nullable=False)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", **DEFERRED), nullable=False)
    baseline_config_id: Mapped[int] = mapped_column(ForeignKey("optimization_configs.id", **DEFERRED), nullable=False)
    trigger: Mapped[str] = mapped_column(String(16), nullable=False)  # manual | schedule | gate | alert
    # queued → running → aggregating → done | failed
    status: Mapped[str] = mapped_column(String(16), default="queued", nullable=False)
    # pass | warn | fail | inconclusive | incomplete | error (null until aggregated)
    verdict: Mapped[str | None] = mapped_column(String(16))
    verdict_reason: Mapped[str | None] = mapped_column(Text)
    n_samples: Mapped[int] = mapped_column(Integer, nullable=False)
    seed: Mapped[int] = mapped_column(Integer, default=0, nullable=False)
    sample_keys: Mapped[list[str]] = mapped_column(JSONType, nullable=False)  # the samples drawn, in order
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    config_runs: Mapped[list[ConfigRun]] = relationship(back_populates="run", order_by="ConfigRun.id")


class ConfigRun(TimestampMixin, Base):
    """One run × config: a unit of GPU work with a lease; ``attempt`` is the fencing token."""

    __tablename__ = "config_runs"
    __table_args__ = (UniqueConstraint("run_id", "config_id"), Index("ix_config_runs_status", "status"))
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    config_id: Mapped[int] = mapped_column(ForeignKey("optimization_configs.id", **DEFERRED), nullable=False)
    # queued | running | succeeded | failed
    status: Mapped[str] = mapped_column(String(16), default="queued", nullable=False)
    attempt: Mapped[int] = mapped_column(Integer, default=0, nullable=False)
    # the attempt at which this pass began: a top-up (workers/top_up.py) runs the row again, and
    # the attempt budget counts this pass's attempts (attempt - attempt_base) while attempt fences
    attempt_base: Mapped[int] = mapped_column(Integer, default=0, server_default="0", nullable=False)
    worker: Mapped[str | None] = mapped_column(String(256))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    enqueued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # the queue priority it was first sent with (app/dispatch.py; null: its run's trigger's), kept
    # for every re-send: a project past its fair share stays one step behind
    priority: Mapped[int | None] = mapped_column(Integer)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    progress_done: Mapped[int] = mapped_column(Integer, default=0, nullable=False)
    progress_total: Mapped[int] = mapped_column(Integer, default=0, nullable=False)
    error: Mapped[str | None] = mapped_column(Text)
    figures: Mapped[dict[str, Any] | None] = mapped_column(JSONType)  # serving + memory figures
    run: Mapped[Run] = relationship(back_populates="config_runs")
    config: Mapped[OptimizationConfig] = relationship(lazy="joined")


class SampleResult(TimestampMixin, Base):
    """Raw per-sample values all statistics are computed from; written idempotently."""

    __tablename__ = "sample_results"
    __table_args__ = (UniqueConstraint("run_id", "config_id", "sample_key", "metric", name="uq_sample_result"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    config_id: Mapped[int] = mapped_column(ForeignKey("optimization_configs.id", **DEFERRED), nullable=False)
    sample_key: Mapped[str] = mapped_column(String(256), nullable=False)
    metric: Mapped[str] = mapped_column(String(64), nullable=False)
    value: Mapped[float | None] = mapped_column(Float)  # None only with an error in extra
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSONType)  # token counts, text, timings


class ComparisonRow(TimestampMixin, Base):
    __tablename__ = "comparisons"
    __table_args__ = (UniqueConstraint("run_id", "config_id", "metric"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)
    config_id: Mapped[int] = mapped_column(ForeignKey("optimization_configs.id", **DEFERRED), nullable=False)
    metric: Mapped[str] = mapped_column(String(64), nullable=False)
    estimate: Mapped[float | None] = mapped_column(Float)
    ci_low: Mapped[float | None] = mapped_column(Float)
    ci_high: Mapped[float | None] = mapped_column(Float)
    n: Mapped[int] = mapped_column(Integer, nullable=False)
    verdict: Mapped[str] = mapped_column(String(32), nullable=False)  # vocabulary.metrics.VERDICTS
    rule: Mapped[str] = mapped_column(Text, nullable=False)
    baseline_value: Mapped[float | None] = mapped_column(Float)
    candidate_value: Mapped[float | None] = mapped_column(Float)
    details: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    # False: reported with its CI, no say in any verdict (vocabulary.comparison.Comparison.gated)
    gated: Mapped[bool] = mapped_column(Boolean, nullable=False, default=True, server_default=true())
    config: Mapped[OptimizationConfig] = relationship(lazy="joined")


class AlertRule(TimestampMixin, Base):
    """A threshold on a comparison metric; scope narrows it to a model or config (null = all)."""

    __tablename__ = "alert_rules"
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    metric: Mapped[str] = mapped_column(String(64), nullable=False)
    warn: Mapped[float] = mapped_column(Float, nullable=False)
    critical: Mapped[float | None] = mapped_column(Float)
    direction: Mapped[str] = mapped_column(String(8), nullable=False)  # above | below
    min_n: Mapped[int] = mapped_column(Integer, default=10, nullable=False)  # fewer samples → inconclusive
    for_runs: Mapped[int] = mapped_column(Integer, default=1, nullable=False)  # consecutive runs before firing
    model_id: Mapped[int | None] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    config_id: Mapped[int | None] = mapped_column(ForeignKey("optimization_configs.id", ondelete="CASCADE"))
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, nullable=False)


class Alert(Base):
    """One episode of an alert (pending → firing → resolved), identified by its fingerprint."""

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_fingerprint", "project_id", "fingerprint"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    rule_id: Mapped[int] = mapped_column(ForeignKey("alert_rules.id", ondelete="CASCADE"), nullable=False)
    fingerprint: Mapped[str] = mapped_column(String(64), nullable=False)
    labels: Mapped[dict[str, str]] = mapped_column(JSONType, nullable=False)
    annotations: Mapped[dict[str, str] | None] = mapped_column(JSONType)
    state: Mapped[str] = mapped_column(String(16), nullable=False)  # pending | firing | resolved
    severity: Mapped[str] = mapped_column(String(16), nullable=False)  # warn | critical
    value: Mapped[float | None] = mapped_column(Float)
    consecutive: Mapped[int] = mapped_column(Integer, default=1, nullable=False)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, nullable=False)
    fired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    resolved_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_notified_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    escalation_run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))


class Silence(TimestampMixin, Base):
    __tablename__ = "silences"
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    matchers: Mapped[list[dict[str, str]]] = mapped_column(JSONType, nullable=False)
    starts_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    ends_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    author: Mapped[str] = mapped_column(String(128), nullable=False)
    comment: Mapped[str] = mapped_column(Text, nullable=False)


class Channel(TimestampMixin, Base):
    __tablename__ = "channels"
    __table_args__ = (UniqueConstraint("project_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    name: Mapped[str] = mapped_column(String(128), nullable=False)
    kind: Mapped[str] = mapped_column(String(16), nullable=False)  # slack | teams | discord | webhook | alertmanager
    url: Mapped[str] = mapped_column(Text, nullable=False)  # a secret: never logged, masked in responses
    settings: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, nullable=False)
    # the circuit breaker (app/notify.py): failed or slow answers in a row, and no post before
    # breaker_until; a quick success closes it
    breaker_strikes: Mapped[int] = mapped_column(Integer, default=0, server_default="0", nullable=False)
    breaker_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Notification(TimestampMixin, Base):
    """Outbox row: at-least-once delivery with an idempotency key."""

    __tablename__ = "notifications"
    __table_args__ = (Index("ix_notifications_due", "status", "next_attempt_at"),)
    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    channel_id: Mapped[int] = mapped_column(ForeignKey("channels.id", ondelete="CASCADE"), nullable=False)
    alert_id: Mapped[int | None] = mapped_column(ForeignKey("alerts.id", ondelete="SET NULL"))
    idempotency_key: Mapped[str] = mapped_column(String(128), unique=True, nullable=False)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType, nullable=False)
    status: Mapped[str] = mapped_column(String(16), default="pending", nullable=False)  # pending | sent | dead
    attempts: Mapped[int] = mapped_column(Integer, default=0, nullable=False)
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Schedule(TimestampMixin, Base):
    __tablename__ = "schedules"
    __table_args__ = (UniqueConstraint("project_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    name: Mapped[str] = mapped_column(String(128), nullable=False)
    cron: Mapped[str] = mapped_column(String(128), nullable=False)
    suite_id: Mapped[int] = mapped_column(ForeignKey("suites.id", ondelete="CASCADE"), nullable=False)
    config_names: Mapped[list[str]] = mapped_column(JSONType, nullable=False)
    samples: Mapped[int | None] = mapped_column(Integer)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True, nullable=False)
    last_slot_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Gate(TimestampMixin, Base):
    """A run started by CI with a verdict policy; the verdict is durable here."""

    __tablename__ = "gates"
    __table_args__ = (UniqueConstraint("project_id", "idempotency_key"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", **DEFERRED), nullable=False)
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    candidate: Mapped[str] = mapped_column(String(128), nullable=False)
    baseline: Mapped[str] = mapped_column(String(128), nullable=False)
    policy: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    verdict: Mapped[str | None] = mapped_column(String(16))  # pass | warn | fail | error
    decided_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
