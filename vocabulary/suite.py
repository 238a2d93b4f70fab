"""A suite's settings as stored with it and read by the workers: what a run scores, on how many
documents, and how it generates (torch-free: the API, the workers and the aggregation read it).

Every default lives here, once. app/config_file.py extends these models for the canary.yaml and
the API (unknown keys refused, secret names and the scorers checked against what is available);
a stored spec is read back with `SuiteSpec.model_validate(suite.spec)`, which fills a default a
spec stored by an older release lacks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


@dataclass(frozen=True)
class Scorer:
    """A name a suite's `scorers` may list: what it measures, which other scorers' output it reads,
    and what it needs of the suite's settings. The worker's producers (workers/producers/) and the
    run's CPU scorers (workers/score.py) each name the scorer that switches them on; the canary.yaml
    and the API check a suite against this table (app/config_file.py), never against a list of their own."""

    name: str
    what: str  # one line, for the error that lists the choices
    needs: tuple[str, ...] = ()  # scorers whose output it reads (judge, faithfulness and agreement: generation)
    required: bool = False  # every suite runs it
    check: Callable[[SuiteSpec], str | None] | None = None  # a settings problem with its fix, or None


SCORER_TABLE: dict[str, Scorer] = {}


def register_scorer(scorer: Scorer) -> Scorer:
    """Add a scorer to the table (a new producer's, or a test's toy); a name already there is an error."""
    if scorer.name in SCORER_TABLE:
        raise ValueError(f"scorer '{scorer.name}' is registered already")
    unknown = [need for need in scorer.needs if need not in SCORER_TABLE]
    if unknown:
        raise ValueError(f"scorer '{scorer.name}' needs unknown scorer(s) {', '.join(unknown)}")
    SCORER_TABLE[scorer.name] = scorer
    return scorer


def scorer(name: str) -> Scorer:
    """The table's row for a scorer (installed plugins' scorers too: vocabulary/plugins.py); a name
    not in it is an error naming the choices."""
    if name not in SCORER_TABLE:
        from vocabulary import plugins

        plugins.load(plugins.VOCABULARY)
    try:
        return SCORER_TABLE[name]
    except KeyError:
        raise ValueError(f"unknown scorer '{name}'; choose from {', '.join(SCORER_TABLE)}") from None


def _judge_configured(suite: SuiteSpec) -> str | None:
    if suite.judge.base_url and suite.judge.model:
        return None
    return "judge: the judge scorer (or faithfulness with method 'judge') needs judge.base_url and judge.model"


def _labelled_items(suite: SuiteSpec) -> str | None:
    return None if suite.labelled.items else ("labelled: the labelled scorer needs labelled.items "
                                              "(builtin:pydoc-next-word or a .jsonl file of items)")


class _Settings(BaseModel):
    # NaN and ±Infinity (which JSON parsers accept) are never a setting; a key this release does not
    # know is left out when a stored spec is read (the canary.yaml and the API refuse it: app/config_file.py)
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# characters per token a long-context document is sized by (long_documents): more than English or code
# average on any common tokenizer (about 3 to 5), so a document of window × this many characters fills its window
LONG_CHARS_PER_TOKEN = 6


class PerplexitySettings(_Settings):
    window: int = Field(256, ge=2, le=32768, description="tokens per window (≤ the model's context)")
    stride: int | None = Field(None, ge=1, description="tokens between window starts; default = window (disjoint)")
    terms: list[str] = Field(default_factory=list, max_length=1000, description=(
        "domain terms whose tokens are also scored apart (term_nll_ratio): a literal term as written, "
        "'re:<regex>', or 'builtin:python-identifiers'"))
    decode_samples: int = Field(0, ge=0, le=1000, description=(
        "documents (the suite's first ones) a config with a lossy KV cache also scores one token per decode "
        "step, each token read back from its compressed cache (decode_nll_ratio and the prefill-vs-decode gap); "
        "0 = off. The reference engine only (others score nothing here): over HTTP, gen_nll_ratio is the "
        "decode-regime signal"))
    long_documents: bool = Field(False, description=(
        f"join the corpus's documents, in order, into long-context documents that fill the window (at least "
        f"window × {LONG_CHARS_PER_TOKEN} characters each, within the server's document limit), so that every "
        f"position bucket up to the window's length is scored: a loss deep in the context (a compressed KV cache "
        f"read far back) shows in the late buckets. Short documents alone never reach them. samples then counts "
        f"joined documents; generation prompts are their openings (fewer documents, so fewer prompts to draw "
        f"from); decode_samples and distribution_samples score whole joined documents (costlier)"))
    distribution_samples: int = Field(0, ge=0, le=1000, description=(
        "documents (the suite's first ones) on which a candidate's every next-token distribution is compared "
        "with the baseline's, as llama-perplexity --kl-divergence does: KLD mean and percentiles, Δp, same top p "
        "(kld_mean); 0 = off. The reference engine on both sides"))

    layer_samples: int = Field(4, ge=1, le=100, description=(
        "documents (the suite's first ones) on which the layers scorer compares a candidate's forward pass with the "
        "baseline's layer by layer, on each one's first window (layer_drift): where the drift starts and how it "
        "grows. In-process engines on both sides"))

    @field_validator("terms")
    @classmethod
    def _terms(cls, v: list[str]) -> list[str]:
        from vocabulary.terms import compile_terms

        for i, entry in enumerate(v):
            try:
                compile_terms([entry])
            except ValueError as e:
                raise ValueError(f"terms[{i}]: {e}") from e
        return v

    @model_validator(mode="after")
    def _stride(self) -> PerplexitySettings:
        if self.stride is None:
            self.stride = self.window
        if self.stride > self.window:
            raise ValueError(f"stride {self.stride} > window {self.window}; use a stride ≤ window")
        return self


class GenerationSettings(_Settings):
    prompts: int = Field(16, ge=0, le=1000, description="documents whose opening is used as a prompt")
    prompt_words: int = Field(24, ge=1, le=2000)
    max_new_tokens: int = Field(32, ge=1, le=4096)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    paired_timing: bool = Field(True, description=(
        "a candidate's run also times the baseline on the same prompts, "
        "interleaved, for ttft_ratio and tpot_ratio (load on the host cancels out)"))
    concurrency: int = Field(8, ge=1, le=256, description=(
        "generation requests in flight at once against a serving engine (openai, vllm), as production traffic "
        "has them; engine_options.concurrency overrides it per config. The in-process reference engine decodes "
        "engine_options.concurrency rows together (default 1)"))
    noise_floor: bool = Field(True, description=(
        "a candidate's run also sends the baseline a second pass over the prompts, interleaved with the "
        "candidate's batches: the baseline against itself, the floor that confident_divergence is judged beyond"))
    near_tie_nats: float = Field(0.25, ge=0, le=10, description=(
        "two greedy outputs that part where the baseline model's log-probs of the two tokens are within this many "
        "nats part at a near-tie: noise on a server that is not batch-invariant, reported, not judged "
        "(vLLM's greedy_atol)"))
    solo_probes: int = Field(8, ge=0, le=256, description=(
        "prompts each config also sends alone, one at a time, to compare with its answers inside a full batch "
        "(batch_divergence); only where generation runs more than one request at a time. A top-up adds as many "
        "per prompt it adds (solo_probes per prompts)"))


class JudgeSettings(_Settings):
    base_url: str | None = Field(
        None, max_length=2048, description="the judge's OpenAI-compatible base URL, e.g. http://judge.internal:8000/v1")
    model: str | None = Field(None, max_length=256, description="the judge model's name on that server")
    api_key_env: str | None = Field(
        None, max_length=256, description="environment variable holding the judge's API key (never the key itself)")
    mode: Literal["pairwise", "rubric", "both"] = "pairwise"
    concurrency: int = Field(4, ge=1, le=64)
    requests_per_second: float | None = Field(None, gt=0)
    timeout_s: float = Field(30, gt=0, le=600)

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("https://", "http://")):
            raise ValueError(f"'{v}' is not an http(s) URL; give the judge's base URL, e.g. http://judge.internal:8000/v1")
        return v


class FaithfulnessSettings(_Settings):
    method: Literal["offline", "judge"] = Field(
        "offline",
        description="offline: the labelled all-MiniLM-L6-v2 approximation (no endpoint); judge: the suite's judge")
    threshold: float = Field(
        0.6, gt=0, lt=1, description="offline: cosine similarity that counts a statement as supported")


class LabelledSettings(_Settings):
    items: str | None = Field(None, max_length=4096, description=(
        "labelled items the labelled scorer asks every config (vocabulary/labelled.py): builtin:pydoc-next-word, or a "
        ".jsonl file of {id, prompt, answer, choices?, match?} objects; lm-eval's --log_samples output converts "
        "with `canary tasks import-lm-eval`"))
    max_items: int = Field(500, ge=1, le=20000, description="items each run scores: the first ones, in file order")
    max_new_tokens: int = Field(32, ge=1, le=4096, description="the answer's length for an item scored by "
                                                               "generating (match exact, regex or number)")


TOP_UP_FACTOR = 4  # without max_samples, an undecided run tops up to this many times its samples at most


class SuiteSpec(_Settings):
    """A suite's stored settings (the canary.yaml's suite entry without its name)."""

    samples: int = Field(100, ge=1, description="documents drawn per run (daily ≈ 100, weekly ≥ 500)")
    max_samples: int | None = Field(
        None, ge=1, description="top up an undecided run: while a gated comparison is inconclusive, draw as many "
                                "documents again (up to this many in all) and score the baseline and the undecided "
                                f"configs on those added; unset: up to {TOP_UP_FACTOR} × samples within the "
                                "deployment's CANARY_TOP_UP_BUDGET_S (workers/top_up.py)")
    top_up: bool = Field(True, description="false: an undecided run is never topped up (it ends inconclusive)")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    scorers: list[str] = Field(default_factory=lambda: ["perplexity", "generation"], max_length=16)
    perplexity: PerplexitySettings = Field(default_factory=PerplexitySettings)
    generation: GenerationSettings = Field(default_factory=GenerationSettings)
    judge: JudgeSettings = Field(default_factory=JudgeSettings)
    faithfulness: FaithfulnessSettings = Field(default_factory=FaithfulnessSettings)
    labelled: LabelledSettings = Field(default_factory=LabelledSettings)

    def runs(self, name: str) -> bool:
        """Whether the suite runs a scorer; a name not in the scorer table is an error (a typo never
        reads as "off")."""
        return scorer(name).name in self.scorers


for _row in (
    Scorer("perplexity", "documents' rolling log-likelihood (and the signals read beside it)", required=True),
    Scorer("generation", "greedy or sampled answers to prompts, their timings and the baseline's reading"),
    Scorer("judge", "an LLM judge's pairwise or rubric verdict on the answers", needs=("generation",),
           check=_judge_configured),
    Scorer("faithfulness", "the share of an answer's statements its contexts support", needs=("generation",),
           check=lambda suite: _judge_configured(suite) if suite.faithfulness.method == "judge" else None),
    Scorer("agreement", "top-1 and exact-match agreement with the baseline's tokens", needs=("generation",)),
    Scorer("labelled", "labelled items answered right (task accuracy and flips)", check=_labelled_items),
    Scorer("layers", "where a candidate's forward pass starts to drift from the baseline's, layer by layer "
                     "(perplexity.layer_samples documents; in-process engines)"),
):
    register_scorer(_row)

