"""API request and response schemas (kept apart from the SQLAlchemy models)."""

from __future__ import annotations

from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator
from pydantic_core import to_jsonable_python

from app.config_base import DB_INT_MAX, NAME_PATTERN, NameRef
from app.config_file import ConfigEntry, GenerationSettings, PerplexitySettings, SuiteEntry
from vocabulary.comparison import STORED
from vocabulary.figures import RunFigures
from vocabulary.metrics import VERDICTS

Verdict = Literal[VERDICTS]  # type: ignore[valid-type]  # the metric table's verdicts, best to worst
RunVerdict = Literal["pass", "warn", "fail", "inconclusive", "incomplete", "error"]
Time = str  # ISO 8601 with its UTC offset, as stored



def jsonable(value: Any) -> Any:
    """A value that holds models (a run summary's ComparisonOut, say) as plain JSON values."""
    return to_jsonable_python(value)


class ProjectIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)


class ProjectOut(BaseModel):
    id: int
    name: str


class ModelIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN)
    path: str = Field(min_length=1, max_length=4096)


class ModelOut(BaseModel):
    id: int
    name: str
    path: str


class ConfigIn(ConfigEntry):
    model: NameRef = Field(description="name of a model in this project")


class ConfigOut(BaseModel):
    id: int
    name: str
    model: str
    baseline: bool
    spec: dict[str, Any]


class DocumentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=256)
    text: str = Field(min_length=1)
    reference: str | None = None
    contexts: list[str] | None = Field(None, max_length=256)
    cluster: str | None = Field(None, max_length=256)


class SuiteIn(SuiteEntry):
    # wider than the file's field on purpose (a client may send documents instead), which mypy rightly
    # flags as an unsafe override: SuiteIn is not used where a SuiteEntry is expected
    corpus: str | None = Field(None, max_length=4096,  # type: ignore[assignment]
                               description="server-side corpus (builtin:pydoc-heldout); or send documents")
    documents: list[DocumentIn] | None = Field(None, description="the suite's documents inline")


class SuiteOut(BaseModel):
    id: int
    name: str
    n_documents: int
    samples: int
    max_samples: int | None = Field(None, description="an undecided run tops up to this many samples; null: by "
                                                      "default (4 × samples within CANARY_TOP_UP_BUDGET_S)")
    top_up: bool = Field(True, description="false: an undecided run is never topped up")
    seed: int
    scorers: list[str]
    perplexity: PerplexitySettings
    generation: GenerationSettings


class RunIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    suite: NameRef
    configs: list[NameRef] | None = Field(None, max_length=256,
                                          description="config names; default all; the baseline is always included")
    samples: int | None = Field(None, ge=1, le=DB_INT_MAX,
                                description="documents drawn; at most the server's samples-per-run limit")
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    trigger: Literal["manual", "schedule"] = Field(
        "manual", description="manual, or schedule for a run an outside scheduler starts; gate and alert runs are the "
                              "canary's own (POST …/gates; an alert's escalation), queued at their own priority")

    @field_validator("trigger", mode="before")
    @classmethod
    def _not_the_canarys_own(cls, value: Any) -> Any:
        if value in ("gate", "alert"):
            where = "start a gate with POST …/gates" if value == "gate" else "escalations start on their own"
            raise ValueError(f"trigger '{value}' is kept for the canary's own runs, which it queues at their own "
                             f"priority: {where}, or leave trigger out (manual)")
        return value


class SampleResultOut(BaseModel):
    config: str
    sample_key: str
    metric: str
    value: float | None
    extra: dict[str, Any] | None


class SamplePage(BaseModel):
    total: int
    offset: int
    limit: int
    items: list[SampleResultOut]


# A config-run's figures: the fields of vocabulary.figures.RunFigures, each optional (a run stored by an
# older version lacks newer ones), and any other key the engine reported kept as it is.
FiguresOut = create_model(
    "FiguresOut", __config__=ConfigDict(extra="allow"),
    **{name: (kind | None, None) for name, kind in get_type_hints(RunFigures).items()},  # type: ignore[call-overload]
)


class ProgressOut(BaseModel):
    done: int | None = Field(description="documents and prompts scored so far")
    total: int | None


class RunConfigOut(BaseModel):
    config: str
    spec: dict[str, Any] = Field(description="the config's optimizations (credentials in URLs masked)")
    status: str = Field(description="queued | running | succeeded | failed | cancelled")
    attempt: int
    progress: ProgressOut
    error: str | None
    ablation_of: str | None = Field(None, description="the stacked config this single-optimization ablation is a "
                                                      "layer of (step back one layer), else null")
    ablation_axis: str | None = Field(None, description="weights | kv_cache | speculative: the one axis it takes "
                                                        "from the stacked config")


class ComparisonOut(BaseModel):
    """Candidate vs baseline on one metric (vocabulary.comparison.Comparison, named by config)."""

    config: str
    metric: str = Field(description="a name of the metric catalogue (GET /metrics)")
    estimate: float | None
    ci_low: float | None
    ci_high: float | None
    n: int = Field(description="paired samples behind the estimate")
    verdict: Verdict
    rule: str = Field(description="the threshold test that gave the verdict, in words")
    baseline_value: float | None
    candidate_value: float | None
    details: dict[str, Any]
    gated: bool = Field(description="false: its producer reported it without judging it (offline faithfulness, a "
                                    "lossless check over a noisy floor), so it has no say in any verdict; a metric "
                                    "the catalogue marks not gated (GET /metrics) has none either")

    @classmethod
    def of(cls, row: Any, config: str) -> ComparisonOut:
        """A stored comparison (app/models.py, the columns of vocabulary.comparison.Comparison), named by config."""
        fields = {name: getattr(row, name) for name in STORED if name != "config_id"}
        return cls.model_validate({**fields, "config": config, "details": row.details or {}})


class StepBackLayerOut(BaseModel):
    """One optimization of a stacked config, measured alone against the baseline (evals.step_back.Layer)."""

    axis: str = Field(description="weights | kv_cache | speculative")
    value: str = Field(description="the stacked config's value on that axis, e.g. awq-int4, turbo-2.5, draft-k4")
    config: str = Field(description="the config that ran this layer alone")
    ratio: float = Field(description="the layer's own ratio against the baseline on the metric")
    verdict: Verdict
    lossless: bool = Field(description="the layer keeps the baseline's weights and KV cache")
    share: float | None = Field(description="log(ratio) ÷ Σ log(ratio) over the layers; null when no layer loses alone")


class StepBackOut(BaseModel):
    """A stacked config's loss on one quality ratio, apportioned among its layers (evals/step_back.py)."""

    config: str = Field(description="the stacked config")
    metric: str
    stacked_ratio: float
    interaction: float = Field(description="log(stacked ratio) − Σ log(layer ratios): 0 when the losses multiply")
    disable: str | None = Field(description="the axis to disable: the largest share; null when no layer loses alone")
    advice: str = Field(description="the advice in words, as the verdict, the alerts and the gate summary give it")
    layers: list[StepBackLayerOut] = Field(description="largest share first")


class SummaryLineOut(BaseModel):
    """One breaching config in the verdict summary (app/summary.py)."""

    config: str
    group: str = Field(description="drop or fix | watch | slower than the baseline | undecided")
    text: str = Field(description="the line as printed: the config, its worst quality finding and its worst speed "
                                  "finding with their 95% CIs, and the step-back advice if any")
    findings: str = Field(description="the line without its config: the worst quality and speed findings")
    severity: float = Field(description="how far its worst finding lies past that metric's seed threshold (the "
                                        "line's place in its group: furthest first)")
    critical: int = Field(description="the config's critical comparisons")
    warn: int = Field(description="the config's warn comparisons")
    quality: ComparisonOut | None = Field(description="its worst quality comparison (null when none is off ok)")
    speed: ComparisonOut | None = Field(description="its worst speed comparison (null when none is off ok)")
    advice: str | None = Field(description="the step-back advice of a stacked config")
    decide_samples: int | None = Field(None, description="undecided: about how many documents would decide it "
                                                         "(its comparisons over the run's documents)")
    decide_settings: dict[str, int] = Field(default_factory=dict, description=(
        "undecided: the suite settings that count what its other comparisons are over (generation.prompts, "
        "labelled.max_items, perplexity.decode_samples, perplexity.distribution_samples), each with about how "
        "many would decide it"))
    decide_beyond: list[str] = Field(default_factory=list, description=(
        "undecided: its comparisons that need more samples than the suite can give, each with about how many "
        "(no run on this suite decides them; the decide command is not sized for them)"))


class VerdictSummaryOut(BaseModel):
    """The verdict for people: a line per breaching config, grouped, worst first, at most about 12 lines."""

    groups: dict[str, list[SummaryLineOut]] = Field(description="by group, in the order drop or fix, watch, slower "
                                                                "than the baseline, undecided; empty groups left out")
    lines: list[str] = Field(description="the summary as printed (group headings, then a line per config; the last "
                                         "line says how many configs are left out)")
    more: int = Field(description="configs not in `lines` (all of them are in `groups`)")
    counts: dict[str, int] = Field(description="configs per group")


class TradeOffPointOut(BaseModel):
    """A config on the quality-vs-speed plane (app/summary.py trade_off_points); the baseline is the origin."""

    config: str = Field(description="the config; the baseline's name ends ' (baseline)'")
    loss: float = Field(description="the perplexity ratio as % change")
    loss_low: float | None
    loss_high: float | None
    speed: float | None = Field(description="speed gain ×: 1 / paired TPOT ratio (else a tokens/s ratio, no CI)")
    speed_low: float | None
    speed_high: float | None
    speed_sure: bool = Field(description="false where the speed comparison is inconclusive or has no CI")
    memory: float = Field(description="memory saved %: weight bytes + KV bytes for a 512-token context")
    verdict: str = Field(description="the perplexity ratio's verdict; 'baseline' for the origin")


class RunOut(BaseModel):
    run_id: int
    status: str = Field(description="queued | running | aggregating | done | failed | cancelled (back to running "
                                    "while a breaching stacked config's single-optimization ablations run, or while "
                                    "a top-up reruns undecided configs on more samples)")
    verdict: RunVerdict | None = Field(description="the worst gated comparison's, once done")
    verdict_reason: str | None
    baseline: str | None
    suite_id: int
    trigger: str
    n_samples: int = Field(description="the samples the run was asked for")
    samples_drawn: int = Field(description="the samples it holds: more than n_samples once topped up after an "
                                           "inconclusive pass (by default, or to the suite's max_samples)")
    seed: int
    created_at: Time | None
    finished_at: Time | None
    configs: list[RunConfigOut]
    comparisons: list[ComparisonOut]
    figures: dict[str, FiguresOut] = Field(description="per config name")
    step_back: list[StepBackOut] = Field(default_factory=list, description=(
        "for a stacked config (two or more axes unlike the baseline's) warn or critical on a quality ratio: its "
        "single-optimization ablations' shares of the loss, run on the same samples"))
    trade_off: list[TradeOffPointOut] = Field(default_factory=list, description=(
        "each candidate with a perplexity ratio: quality lost against speed and memory gained, the baseline first"))
    summary: VerdictSummaryOut = Field(description="the verdict for people (app/summary.py); verdict_reason and "
                                                   "comparisons hold every finding")

    def figures_of(self, config: str | None) -> dict[str, Any]:
        """A config's figures as a mapping (every field of vocabulary.figures.RunFigures, None where not
        measured, and any other key the engine reported); empty when it has none."""
        found = self.figures.get(config or "")
        return found.model_dump() if found is not None else {}


class RunListItem(BaseModel):
    run_id: int
    status: str
    verdict: RunVerdict | None
    trigger: str
    n_samples: int
    samples_drawn: int = Field(description="more than n_samples once the run topped up")
    created_at: Time
    finished_at: Time | None


class ErrorOut(BaseModel):
    detail: str = Field(description="what is wrong, naming the field, and how to fix it")


class FieldErrorOut(BaseModel):
    model_config = ConfigDict(extra="allow")  # pydantic adds input and ctx
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorOut(BaseModel):
    detail: str | list[FieldErrorOut] = Field(
        description="one error per field when the request does not match the schema; one message naming the field(s) "
                    "when a check across fields or against stored objects fails")


_ERRORS = {
    400: "the body could not be parsed (not UTF-8 text); send a JSON document",
    401: "no API key, or an invalid or revoked one (keys are required in production)",
    403: "the API key is read-only, or may not do this",
    404: "the project, or a named object in it, does not exist (or belongs to another project than the key's)",
    408: "the request body did not arrive in full within the deadline (CANARY_BODY_TIMEOUT_SECONDS)",
    409: "an object with this name or Idempotency-Key exists already, or was written concurrently",
    413: "the request body exceeds the size limit",
    422: "invalid input; the detail names the field and the fix",
    429: "the per-key rate limit is exceeded",
}
ERROR_CODES = tuple(_ERRORS)
_HEADERS = {
    401: {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
    429: {"Retry-After": {"description": "seconds until a request may pass", "schema": {"type": "string"}}},
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` for the error answers a route (or router) gives."""
    return {code: {"model": ValidationErrorOut if code == 422 else ErrorOut, "description": _ERRORS[code],
                   **({"headers": _HEADERS[code]} if code in _HEADERS else {})} for code in codes}
