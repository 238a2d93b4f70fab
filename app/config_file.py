"""The canary.yaml schema: model, optimization configs (one baseline), suites, thresholds,
channels and schedules. `canary schema` prints its JSON Schema; errors name the field."""

from __future__ import annotations

import re
from collections.abc import Callable
from difflib import get_close_matches
from typing import Any, Literal, NamedTuple

from pydantic import Field, ValidationError, create_model, field_validator, model_validator

from app.channels import ChannelKind
from app.config_base import (
    DB_INT_MAX,
    NAME_PATTERN,
    STRICT,
    ConfigFileError,
    Strict,
    format_validation_error,
)
from engines.protocol import SAMPLING_EPS
from engines.spec import ConfigNotAvailable, OptimizationSpec, lossless_against
from vocabulary import suite as suite_settings
from vocabulary.metrics import METRICS, Metric, gated_metrics
from vocabulary.suite import SCORER_TABLE, scorer


class ModelEntry(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    path: str = Field(description="local Hugging Face directory (safetensors), or builtin:pydoc-target")


class ConfigEntry(OptimizationSpec):
    name: str = Field(pattern=NAME_PATTERN)
    baseline: bool = False

    def to_spec(self) -> OptimizationSpec:
        return OptimizationSpec.model_validate(self.model_dump(include=set(OptimizationSpec.model_fields)))

    @field_validator("engine_options")
    @classmethod
    def _secret_name(cls, v: dict) -> dict:
        from app.secret_names import check_secret_name

        if isinstance(v, dict) and v.get("api_key_env") is not None:
            check_secret_name(str(v["api_key_env"]), "api_key_env")
        return v


class PerplexitySettings(suite_settings.PerplexitySettings):
    model_config = STRICT


class GenerationSettings(suite_settings.GenerationSettings):
    model_config = STRICT


class JudgeSettings(suite_settings.JudgeSettings):
    model_config = STRICT

    @field_validator("api_key_env")
    @classmethod
    def _secret_name(cls, v: str | None) -> str | None:
        from app.secret_names import check_secret_name

        return None if v is None else check_secret_name(v, "api_key_env")


class FaithfulnessSettings(suite_settings.FaithfulnessSettings):
    model_config = STRICT


class LabelledSettings(suite_settings.LabelledSettings):
    model_config = STRICT


class SuiteEntry(suite_settings.SuiteSpec):
    model_config = STRICT
    name: str = Field(pattern=NAME_PATTERN)
    corpus: str = Field(
        description="builtin:pydoc-heldout, a .jsonl file ({'id', 'text'} per line) or a folder of .txt/.md files")
    perplexity: PerplexitySettings = Field(default_factory=PerplexitySettings)
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    judge: JudgeSettings = Field(default_factory=JudgeSettings)
    faithfulness: FaithfulnessSettings = Field(default_factory=FaithfulnessSettings)
    labelled: LabelledSettings = Field(default_factory=LabelledSettings)

    @model_validator(mode="after")
    def _scorer_settings(self) -> SuiteEntry:
        if self.max_samples is not None and not self.top_up:
            raise ValueError(f"max_samples: {self.max_samples} asks for top-ups that top_up: false turns off; "
                             "drop one of the two")
        if self.max_samples is not None and self.max_samples < self.samples:
            raise ValueError(f"max_samples: {self.max_samples} is below samples ({self.samples}); a top-up only adds "
                             f"documents, so set max_samples ≥ {self.samples} or leave it unset")
        # each scorer the suite runs, checked against its row of the scorer table (vocabulary/suite.py)
        for name in self.scorers:
            row = scorer(name)
            for need in row.needs:
                if need not in self.scorers:
                    raise ValueError(f"scorers: '{name}' reads the {need} scorer's output; add '{need}' to the "
                                     "suite's scorers")
            problem = row.check(self) if row.check is not None else None
            if problem:
                raise ValueError(problem)
        return self

    @field_validator("scorers")
    @classmethod
    def _scorers(cls, v: list[str]) -> list[str]:
        for name in v:
            scorer(name)  # an unknown name is an error listing the table's
        missing = [row.name for row in SCORER_TABLE.values() if row.required and row.name not in v]
        if missing:
            raise ValueError(f"the {', '.join(missing)} scorer is required (it is what every comparison pairs on)")
        return v


class Threshold(Strict):
    warn: float
    critical: float | None = None
    min_n: int = Field(10, ge=1, le=DB_INT_MAX, description="fewer paired samples than this → inconclusive")
    for_runs: int = Field(
        1, ge=1, le=100, description="consecutive breaching runs before the alert fires (Prometheus 'for')")


# The metrics that take thresholds, their directions and seed defaults: vocabulary/metrics.py, the one table.
METRIC_DIRECTIONS = {name: metric.direction for name, metric in gated_metrics().items()}


class _ThresholdsBase(Strict):
    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for metric in data:
                if metric in METRIC_DIRECTIONS:
                    continue
                if metric in METRICS:
                    raise ValueError(f"'{metric}' is informational (reported with its CI, no say in the verdict) and "
                                     f"takes no threshold; thresholds exist for: {', '.join(METRIC_DIRECTIONS)}")
                guess = get_close_matches(str(metric), METRIC_DIRECTIONS, n=1)
                hint = f"did you mean '{guess[0]}'? " if guess else ""
                raise ValueError(f"unknown metric '{metric}'; {hint}thresholds exist for: "
                                 f"{', '.join(METRIC_DIRECTIONS)}")
        return data

    @model_validator(mode="after")
    def _order(self) -> _ThresholdsBase:
        for metric, direction in METRIC_DIRECTIONS.items():
            threshold: Threshold = getattr(self, metric)
            warn, critical = threshold.warn, threshold.critical
            if critical is None:
                continue
            if (direction == "above" and critical < warn) or (direction == "below" and critical > warn):
                side = "≥" if direction == "above" else "≤"
                raise ValueError(f"{metric}: critical {critical} must be {side} warn {warn} (bad is {direction})")
        return self


# Any, not tuple[type[Threshold], FieldInfo]: create_model's **field_definitions would be checked against its
# own keywords (__doc__: str, __module__: str, ...) too
def _threshold_field(metric: Metric) -> Any:
    seed = Threshold(warn=metric.warn, critical=metric.critical, min_n=metric.min_n)
    bad = "above" if metric.direction == "above" else "below"
    return (Threshold, Field(default_factory=seed.model_copy,
                             description=f"{metric.definition} Unit: {metric.unit}; bad {bad} the threshold."))


# one field per gated metric of the table, with its seed thresholds as the default
Thresholds = create_model("Thresholds", __base__=_ThresholdsBase,
                          **{name: _threshold_field(metric) for name, metric in gated_metrics().items()})


class ChannelEntry(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    kind: ChannelKind
    url: str = Field(max_length=2048, description=(
        "webhook URL, or ${ENV_VAR}: the secret then stays out of the file and the database"))
    send_resolved: bool = True
    signing_secret: str | None = Field(
        None, max_length=256, description="webhook: ${ENV_VAR} holding the HMAC-SHA256 signing secret")

    @field_validator("signing_secret")
    @classmethod
    def _secret(cls, v: str | None) -> str | None:
        from app.secret_names import ENV_REF, check_secret_ref

        if v is not None and not ENV_REF.fullmatch(v):
            raise ValueError("give the signing secret as an ${ENV_VAR} reference, never the secret itself")
        return check_secret_ref(v, "signing_secret")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        from app.secret_names import ENV_REF, check_secret_ref
        from app.settings import get_settings
        from app.ssrf import has_credentials, mask_url

        if ENV_REF.fullmatch(v):
            check_secret_ref(v, "url")  # an allowed variable, or SecretNotAllowed naming it
            return v
        if not re.match(r"^https?://[^\s/]+", v):
            raise ValueError(f"'{mask_url(v)}' is not an http(s) URL or an ${{ENV_VAR}} reference")
        secret = has_credentials(v)
        if secret and get_settings().environment == "production":
            prefix = get_settings().secret_env_prefix or "CANARY_SECRET_"
            raise ValueError(f"'{mask_url(v)}' carries a credential ({secret}), which would be stored in plain text; "
                             f"in production give the URL as an ${{ENV_VAR}} reference, e.g. "
                             f"${{{prefix}SLACK_WEBHOOK_URL}}, set in the workers' environment")
        return v


def check_cron(v: str) -> str:
    from croniter import croniter

    if len(v.split()) != 5 or not croniter.is_valid(v):
        raise ValueError(f"'{v}' is not a valid five-field cron expression (minute hour day-of-month month "
                         "day-of-week), e.g. '0 6 * * *'")
    from datetime import datetime, timezone

    now = datetime.now(timezone.utc)
    try:  # croniter looks ahead (and back) 50 years: a slot that never comes, e.g. February 30
        croniter(v, now).get_next(datetime)
        croniter(v, now).get_prev(datetime)
    except (ValueError, OverflowError):
        raise ValueError(f"'{v}' never fires (no date matches it, e.g. February 30 or April 31); give a "
                         "day-of-month that exists in the month(s)") from None
    return v


class ScheduleEntry(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    cron: str = Field(description="five-field cron expression, UTC, e.g. '0 6 * * *'")
    suite: str
    configs: list[str] | Literal["all"] = "all"
    samples: int | None = Field(None, ge=1, le=DB_INT_MAX)

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str) -> str:
        return check_cron(v)


class CanaryFile(Strict):
    project: str = Field("default", pattern=NAME_PATTERN)
    model: ModelEntry
    configs: list[ConfigEntry] = Field(min_length=1)
    suites: list[SuiteEntry] = Field(min_length=1)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    channels: list[ChannelEntry] = Field(default_factory=list)
    schedules: list[ScheduleEntry] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _counts(cls, data: Any) -> Any:
        """More entries than the limits (settings) are refused before any entry is validated."""
        if isinstance(data, dict):
            for field, n, limit in list_limits():
                items = data.get(field)
                if isinstance(items, list) and len(items) > limit:
                    raise ValueError(f"{field}: {len(items)} entries exceed the limit of {limit} (setting CANARY_{n}); "
                                     "split the file or raise the limit")
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> CanaryFile:
        problems = []
        entries: tuple[tuple[str, list], ...] = (("configs", self.configs), ("suites", self.suites),
                                                 ("channels", self.channels), ("schedules", self.schedules))
        for kind, items in entries:
            seen: dict[str, int] = {}
            for i, item in enumerate(items):
                if item.name in seen:
                    problems.append(f"{kind}[{i}].name: duplicate name '{item.name}' (also {kind}[{seen[item.name]}]); "
                                    "names must be unique")
                seen.setdefault(item.name, i)
        baselines = [i for i, config in enumerate(self.configs) if config.baseline]
        if len(baselines) != 1:
            where = ", ".join(f"configs[{i}]" for i in baselines) or "none"
            problems.append(f"configs: exactly one config needs 'baseline: true' (found {where})")
        for i, config in enumerate(self.configs):
            try:
                config.to_spec().check_available()
            except ConfigNotAvailable as e:
                problems.append(f"configs[{i}].{e}")
        # a threshold on a metric that nothing in the file produces could never fire: refused, naming it. Nothing
        # does when no suite runs its scorer, or when the config axis or suite setting it needs is not used.
        scorers = {scorer for suite in self.suites for scorer in suite.scorers}
        for name in sorted(self.thresholds.model_fields_set):
            producer, requirement = METRICS[name].producer, METRICS[name].requires
            if producer not in scorers:
                problems.append(f"thresholds.{name}: no suite runs the '{producer}' scorer, which produces {name}, so "
                                f"this threshold could never apply; add '{producer}' to a suite's scorers or remove "
                                "the threshold")
            elif requirement and not _REQUIREMENTS[requirement].used(self):
                missing, fix = _REQUIREMENTS[requirement].missing, _REQUIREMENTS[requirement].fix
                problems.append(f"thresholds.{name}: {missing}, so this threshold could never apply; {fix} "
                                "or remove the threshold")
        suites = {suite.name for suite in self.suites}
        configs = {config.name for config in self.configs}
        for i, schedule in enumerate(self.schedules):
            if schedule.suite not in suites:
                problems.append(f"schedules[{i}].suite: unknown suite '{schedule.suite}'; declared suites: "
                                f"{', '.join(sorted(suites))}")
            if schedule.configs != "all":
                for name in schedule.configs:
                    if name not in configs:
                        problems.append(f"schedules[{i}].configs: unknown config '{name}'; declared configs: "
                                        f"{', '.join(sorted(configs))}")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def baseline(self) -> ConfigEntry:
        return next(config for config in self.configs if config.baseline)

    def suite(self, name: str | None) -> SuiteEntry:
        if name is None:
            return self.suites[0]
        for suite in self.suites:
            if suite.name == name:
                return suite
        declared = ", ".join(suite.name for suite in self.suites)
        raise ConfigFileError(f"--suite: unknown suite '{name}'; declared suites: {declared}")


class _Requirement(NamedTuple):
    used: Callable[[CanaryFile], bool]  # whether the file uses it
    missing: str  # what is missing when it does not
    fix: str


def _uses_lossless(file: CanaryFile) -> bool:
    bases = [config.to_spec() for config in file.configs if config.baseline]
    if not bases:  # refused already for that: "exactly one config needs 'baseline: true'"
        return True
    base = bases[0]
    greedy = any(suite.runs("generation") and suite.generation.temperature < SAMPLING_EPS for suite in file.suites)
    return greedy and any(not config.baseline and lossless_against(config.to_spec(), base) for config in file.configs)


# what a metric row's `requires` (vocabulary/metrics.py) names: how the file uses it, and the fix when it does not
_REQUIREMENTS = {
    "speculative": _Requirement(
        lambda file: any(config.speculative.method != "off" for config in file.configs),
        "no config uses speculative decoding", "add a config with `speculative`"),
    "lossless": _Requirement(
        _uses_lossless,
        "no config is lossless against the baseline (same weights and KV cache, or `lossless: true`) with a suite "
        "that generates greedily (generation.temperature 0)", "add such a config"),
    "perplexity.terms": _Requirement(
        lambda file: any(suite.perplexity.terms for suite in file.suites),
        "no suite lists perplexity.terms", "add terms to a suite (e.g. ['builtin:python-identifiers'])"),
}


def parse_config(data: object, source: str = "canary.yaml") -> CanaryFile:
    if not isinstance(data, dict):
        raise ConfigFileError(f"{source}: the top level must be a mapping with model, configs and suites")
    try:
        return CanaryFile.model_validate(data)
    except ValidationError as e:
        raise ConfigFileError(f"{source} is invalid:\n{format_validation_error(e)}") from None


def list_limits() -> list[tuple[str, str, int]]:
    """(field, setting name, limit) for the top-level lists of a config file."""
    from app.settings import get_settings

    st = get_settings()
    return [("configs", "MAX_CONFIGS", st.max_configs), ("suites", "MAX_SUITES", st.max_suites),
            ("channels", "MAX_CHANNELS", st.max_channels), ("schedules", "MAX_SCHEDULES", st.max_schedules)]


def json_schema() -> dict:
    return CanaryFile.model_json_schema()
