"""One Settings object, read from CANARY_* environment variables (and a .env file)."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CANARY_", env_file=".env", extra="ignore")

    environment: Literal["dev", "test", "production"] = "dev"
    # Embedded default: a SQLite file and tasks run in-process. Production: Postgres + Celery.
    database_url: str = "sqlite:///canary.db"
    broker_url: str | None = Field(None, description="Redis URL; unset = run tasks in-process")
    result_backend: str | None = None
    execution: Literal["inline", "celery"] | None = Field(
        None, description="task execution; default: celery when broker_url is set, else inline"
    )
    # Liveness of GPU work lives in Postgres (docs/reference.md §8): a lease renewed by heartbeat.
    lease_seconds: int = 600
    max_attempts: int = 3
    requeue_after_seconds: int = 300  # the reconciler re-enqueues config-runs queued longer
    reconcile_seconds: float = 60.0  # how often beat runs the reconciler
    # each Celery worker process serves its task counters (workers/base.py) on the first free port
    # of the 32 from here, for Prometheus; unset: not served
    worker_metrics_port: int | None = Field(None, ge=1, le=65535 - 31)
    # how long a worker keeps retrying a write while the database is unreachable (a restart or
    # failover) before it leaves the config-run to the reconciler
    db_retry_seconds: float = 120.0
    # the directory model and draft paths must resolve under (symlinks, `..` and /proc resolved
    # first; app/model_paths.py), e.g. "/models"; builtin:NAME models are always allowed. Unset:
    # any local directory in dev and test, none in production (builtin models only)
    model_root: str | None = None
    # with model_root: a project reads only <model_root>/<project>/ and <model_root>/_shared/
    model_root_per_project: bool = False
    max_samples_per_run: int = 5000
    # a suite that sets no max_samples tops an undecided run up by default (workers/top_up.py), while the
    # run's age plus the next pass's estimate stays within this many seconds (0: default top-ups never run)
    top_up_budget_s: float = Field(1800.0, ge=0)
    # one project's queue cannot starve the others: past this many of its config-runs queued, a new
    # run of it is refused (429; 0 = no cap) ...
    max_queued_config_runs_per_project: int = Field(100, ge=0)
    # ... and past this many, its new config-runs (gates excepted) go one priority step behind
    # other projects' work of the same kind (app/services.py start_run)
    fair_share_queued_config_runs: int = Field(8, ge=1)
    max_suite_documents: int = 20000
    max_document_chars: int = 200_000
    # bounds on one canary.yaml (`canary run -f`) and on what the API stores per project: more
    # entries are refused with an error naming the field and the limit
    max_configs: int = Field(200, ge=1, description="optimization configs per file / per project")
    max_suites: int = Field(50, ge=1, description="suites per file / per project")
    max_channels: int = Field(50, ge=1, description="alert channels per file / per project")
    max_schedules: int = Field(100, ge=1, description="schedules per file / per project")
    max_config_file_bytes: int = Field(1024 * 1024, ge=1024, description="size of a config file")
    max_config_depth: int = Field(32, ge=4, description="YAML nesting depth of a config file")
    max_config_values: int = Field(
        50_000, ge=100, description="YAML values (scalars, lists, mappings, aliases expanded) in a config file")
    dashboard_url: str = "http://localhost:8501"
    # where the canary's docs/runbooks.md is published (e.g. a repository's …/blob/main/docs/runbooks.md): an
    # alert's runbook link is it with the alert's section (app/runbooks.py); empty: the path docs/runbooks.md
    runbook_url: str = ""
    # a newly firing alert starts one full-suite run of its config (off for one-shot CLI runs)
    escalation: bool = True
    # threads per API process that run the (synchronous) route handlers; requests beyond it wait
    # their turn in arrival order (benchmarks/dashboard_api.py measures the latency it gives)
    api_threads: int = Field(8, ge=1, le=256)
    # how many of the suite's documents an escalation run scores (the seed's weekly depth), at most
    # the suite's size and max_samples_per_run
    escalation_samples: int = Field(500, ge=1)
    # a gate's baseline takes the results of an earlier run of the same baseline config on the same
    # samples when nothing that decides them changed: the model's files by content, the config, the
    # suite, the worker's code and library versions (workers/baseline_reuse.py inputs_key). False: every
    # gate recomputes its baseline
    gate_reuse_baseline: bool = True
    # Alertmanager channels: firing alerts are re-sent this often with endsAt 4 intervals ahead
    # (Prometheus' resend_delay), so Alertmanager never resolves one the canary still fires
    alertmanager_resend_seconds: float = Field(60.0, gt=0, le=3600)
    # a notification's POST, connect to last byte, must end within this many seconds (a receiver
    # that trickles its answer is cut off and retried later; app/notify.py)
    notify_timeout_seconds: float = Field(15.0, gt=0, le=300)
    # API keys: required in production (default), optional elsewhere; a key that is sent is
    # always checked
    require_api_keys: bool | None = None
    # hosts and ports outbound URLs (webhooks, engines, judges) may reach although they resolve to
    # non-public addresses, comma-separated: `host` for ports 80 and 443 only, `host:port`, `host:*`
    # for every port, e.g. "alertmanager.internal:9093,10.0.0.5" (app/ssrf.py)
    url_allowlist: str = ""
    # the only environment variables a configuration may name as a secret (engine and judge
    # api_key_env, a channel's ${VAR}): names with this prefix, plus those listed (comma-separated)
    secret_env_prefix: str = "CANARY_SECRET_"
    secret_env_names: str = ""
    # which project may name which secret: a project names its own, <prefix><PROJECT>__… (e.g.
    # CANARY_SECRET_ALPHA__ENGINE_KEY), and those granted here, `NAME=alpha+beta,OTHER=*`; names
    # listed in secret_env_names serve every project. "shared": one team, any allowed name serves
    # every project (app/ssrf.py)
    secret_grants: str = ""
    secret_scope: Literal["project", "shared"] = "project"
    # requests per minute per API key id (or per client address without a key), per API replica;
    # 0 = unlimited (app/api/limits.py)
    rate_limit_per_minute: int = 600
    # failed authentications (missing, malformed, unknown or revoked key) per minute per client
    # address; past it, that address's failures get 429 instead of 401 (a valid key from the same
    # address is never counted or limited); 0 = unlimited
    rate_limit_auth_failures_per_minute: int = 30
    # how many rate-limit buckets each replica keeps (least recently used go first)
    rate_limit_max_buckets: int = 10000
    # request bodies are cut off with 413 past this many bytes received (chunked bodies too)
    max_body_bytes: int = 64 * 1024 * 1024
    # a request's whole body must arrive within this many seconds of its headers, or it gets 408;
    # only then does the request take one of the api_threads places (app/api/limits.py)
    body_timeout_seconds: float = Field(60.0, gt=0, le=3600)
    # a request declaring a body over large_body_bytes is read and handled only while it holds
    # one of large_bodies_in_flight places in the API process, and one per API key (per client
    # address without one): one tenant's big uploads queue behind each other, not in front of
    # everyone's small requests; a request that waits body_timeout_seconds for a place gets 429
    large_body_bytes: int = Field(1024 * 1024, ge=1)
    large_bodies_in_flight: int = Field(2, ge=1)
    # the reverse proxies whose X-Forwarded-For gives the client address (rate limits, the
    # failed-authentication limit): comma-separated addresses or networks, e.g. "10.0.0.5" or
    # "10.0.0.0/24"; "*" trusts every peer. Empty (default): no proxy is trusted and the peer's
    # own address counts, loopback included (`canary serve`)
    forwarded_allow_ips: str = ""

    @field_validator("url_allowlist")
    @classmethod
    def _allowlist_entries(cls, value: str) -> str:
        from app.ssrf import parse_allowlist

        parse_allowlist(value)  # a malformed entry stops the service at start, naming the entry
        return value

    @property
    def auth_required(self) -> bool:
        return self.require_api_keys if self.require_api_keys is not None else self.environment == "production"

    @property
    def execution_mode(self) -> str:
        return self.execution or ("celery" if self.broker_url else "inline")


@lru_cache
def get_settings() -> Settings:
    return Settings()
