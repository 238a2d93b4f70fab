"""Typed sample records: what an engine or a scorer produced for one sample, as stored in the
sample_results table (one row per run × config × sample × record kind, `metric` naming the kind).

Plain dataclasses with no numpy or torch, so the API (app/) reads the same records it serves.
Each record is the one writer and the one reader of its row: `to_row()` gives
{"sample_key", "metric", "value", "extra"}, `from_row(sample_key, value, extra)` reads one back,
and `read_row` picks the record by the row's kind. Nothing else reads a row's `extra` JSON by key.

    kind            record              value            what extra holds
    nll             DocRecord           Σ −log p (nats)  token/word/byte counts, top-1 hits, cluster, greedy ids,
                                                         domain-term NLL and token count, position buckets, the
                                                         decode-regime NLL, next-token distributions against the
                                                         baseline's, the config's own top-k next tokens
    generation      GenerationRecord    TTFT (ms)        prompt, text, token counts and ids, ITL, tok/s, spec counters,
                                                         finish reason, the output as the baseline model scored it
    baseline_repeat RepeatRecord        TTFT (ms)        as generation: the baseline's second pass (the noise floor)
    solo            SoloRecord          TTFT (ms)        as generation: a prompt sent alone (batch invariance)
    judge_pairwise  PairwiseRecord      1 / ½ / 0        winner, per-order verdicts, consistency, rationale
    judge_score     RubricRecord        score 1–5        stated and probability-weighted scores, rationale
    faithfulness    FaithfulnessRecord  fraction 0–1     outcome, method, statements and whether each is supported
    item            ItemRecord          1 right / 0      the answer read (the chosen index, or the text), each choice's
                                                         Σ log p (multiple choice)

A config-run's own figures (config_runs.figures) are not a sample's: they are vocabulary/figures.py's.
"""

from __future__ import annotations

import base64
import hashlib
import math
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from engines.protocol import GenerationResult, RollingResult, ServerTiming, SpeculativeStats
from evals.health import Scored
from evals.positions import PositionBucket


def _spec_from(extra: Mapping[str, Any] | None) -> SpeculativeStats | None:
    if not extra:
        return None
    return SpeculativeStats(int(extra["num_drafts"]), int(extra["num_draft_tokens"]), int(extra["num_accepted_tokens"]),
                     tuple(int(a) for a in extra.get("accepted_per_position") or ()))


def speculative_to_json(spec: SpeculativeStats) -> dict[str, Any]:
    return {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens, "accepted_per_position": list(spec.accepted_per_position)}


@dataclass(frozen=True)
class DocDistribution:
    """A document's next-token distributions under a candidate against the baseline's, per scored
    token (evals/distribution.py; suite perplexity.distribution_samples)."""

    kld: tuple[float, ...]  # KL(baseline ‖ candidate), nats
    dp: tuple[float, ...]  # q(x) − p(x): the right token's probability, candidate minus baseline
    same: tuple[int, ...]  # 1 where the two argmaxes agree
    ln_ratio: tuple[float, ...]  # log p(x) − log q(x)
    kl_lower: tuple[float, ...]  # bounds on kld from the baseline's top-k log-probs alone
    kl_upper: tuple[float, ...]
    k: int
    # False where each side gave only its top-k (an HTTP server): kld then holds the lower bound
    # (evals/distribution.py doc_distribution_topk) and kl_upper is infinite
    exact: bool = True
    positions: tuple[tuple[int, int, float, int], ...] = ()  # (lo, hi, Σ KLD, tokens) by position (evals/positions.py)

    def to_json(self) -> dict[str, Any]:
        # 6 significant digits; an infinite bound as null (JSON, and PostgreSQL's jsonb, have no infinity)
        short = lambda xs: [float(f"{x:.6g}") if math.isfinite(x) else None for x in xs]  # noqa: E731
        return {"kld": short(self.kld), "dp": short(self.dp), "same": list(self.same), "ln_ratio": short(self.ln_ratio),
                "kl_lower": short(self.kl_lower), "kl_upper": short(self.kl_upper), "k": self.k,
                **({} if self.exact else {"exact": False}),
                **({"positions": [list(b) for b in self.positions]} if self.positions else {})}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DocDistribution:
        floats = lambda key: tuple(math.inf if x is None else float(x) for x in d[key])  # noqa: E731
        return cls(floats("kld"), floats("dp"), tuple(int(x) for x in d["same"]), floats("ln_ratio"),
                   floats("kl_lower"), floats("kl_upper"), int(d["k"]), bool(d.get("exact", True)),
                   tuple((int(lo), int(hi), float(t), int(n)) for lo, hi, t, n in d.get("positions") or ()))


def _packed(kind: str, values: Sequence[float] | Sequence[int]) -> str:
    """Numbers as base64 of little-endian int32 ('i') or float32 ('f'): a top-k table is k times
    a document's tokens, too many for JSON numbers."""
    a = array(kind, values)
    if sys.byteorder == "big":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode("ascii")


def _unpacked(kind: str, text: str) -> tuple:
    a = array(kind)
    a.frombytes(base64.b64decode(text))
    if sys.byteorder == "big":
        a.byteswap()
    return tuple(a)


def tokens_digest(token_ids: Sequence[int]) -> str:
    """A short digest of a document's token ids: two configs' top-k tables pair only over the same tokens."""
    return hashlib.sha256(array("i", token_ids).tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class DocTopK:
    """A config's own k most likely next tokens at each scored token of a document, most likely
    first, and the log p of the document's own token there: what a server gives (echo, `logprobs:
    k`), stored once per config-run so that any candidate's table can be compared with the
    baseline's later, at aggregation (evals/distribution.py doc_distribution_stored), and a reused
    baseline carries its table with its rows. Flat, row-major [T × k]; float32."""

    k: int
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    target: tuple[float, ...]  # log p of the document's own token at each position [T]
    window: tuple[int, int]  # the suite's perplexity window (max_length, stride): positions by bucket
    tokens: str  # tokens_digest of the document's token ids

    def to_json(self) -> dict[str, Any]:
        return {"k": self.k, "ids": _packed("i", self.ids), "logprobs": _packed("f", self.logprobs),
                "target": _packed("f", self.target), "window": list(self.window), "tokens": self.tokens}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> DocTopK:
        max_length, stride = d["window"]
        return cls(int(d["k"]), _unpacked("i", d["ids"]), _unpacked("f", d["logprobs"]), _unpacked("f", d["target"]),
                   (int(max_length), int(stride)), str(d["tokens"]))


@dataclass(frozen=True)
class DocRecord:
    """One document's rolling log-likelihood (perplexity, top-1 agreement)."""

    KIND: ClassVar[str] = "nll"
    sample_key: str
    nll: float  # Σ −log p over the document's tokens, nats
    n_tokens: int
    n_words: int
    n_bytes: int
    top1_hits: int = 0  # positions where the argmax token is the document's token
    cluster: str | None = None  # documents that share a source are resampled together
    greedy_ids: tuple[int, ...] = ()  # argmax token per position, kept when the suite scores agreement
    # the suite's domain terms (vocabulary/terms.py): Σ −log p over the tokens that overlap one, and their
    # count; None when the suite lists no terms or the engine cannot place its tokens in the text
    term_nll: float | None = None
    term_tokens: int | None = None
    # per position bucket of the suite's window (evals/positions.py), in order: (first slot, slot
    # after the last, Σ −log p, tokens); empty in a record stored before buckets were kept
    positions: tuple[PositionBucket, ...] = ()
    # the same tokens scored one per decode step through the KV cache (suite perplexity.decode_samples):
    # Σ −log p and its position buckets; None where the document was not scored so
    decode_nll: float | None = None
    decode_positions: tuple[PositionBucket, ...] = ()
    distribution: DocDistribution | None = None  # a candidate's, on the suite's first distribution_samples
    topk: DocTopK | None = None  # this config's own top-k, on the suite's first distribution_samples

    @classmethod
    def from_result(cls, r: RollingResult, cluster: str | None, keep_ids: bool,
                    terms: tuple[float, int] | None = None,
                    positions: Sequence[PositionBucket] = (),
                    decode: tuple[float, Sequence[PositionBucket]] | None = None,
                    distribution: DocDistribution | None = None, topk: DocTopK | None = None) -> DocRecord:
        top1 = sum(int(a == b) for a, b in zip(r.greedy_ids, r.token_ids, strict=False))  # no greedy ids: 0
        term_nll, term_tokens = terms or (None, None)
        decode_nll, decode_positions = decode or (None, ())
        return cls(r.doc_id, r.nll, len(r.token_ids), r.n_words, r.n_bytes, top1, cluster,
                   tuple(r.greedy_ids) if keep_ids else (), term_nll, term_tokens, tuple(positions),
                   decode_nll, tuple(decode_positions), distribution, topk)

    def to_row(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"n_tokens": self.n_tokens, "n_words": self.n_words, "n_bytes": self.n_bytes,
                                 "top1_hits": self.top1_hits, "cluster": self.cluster}
        if self.greedy_ids:
            extra["greedy_ids"] = list(self.greedy_ids)
        if self.term_tokens is not None:
            extra["term_nll"], extra["term_tokens"] = self.term_nll, self.term_tokens
        if self.positions:
            extra["positions"] = [list(b) for b in self.positions]
        if self.decode_nll is not None:
            extra["decode_nll"] = self.decode_nll
            extra["decode_positions"] = [list(b) for b in self.decode_positions]
        if self.distribution is not None:
            extra["distribution"] = self.distribution.to_json()
        if self.topk is not None:
            extra["topk"] = self.topk.to_json()
        return {"sample_key": self.sample_key, "metric": self.KIND, "value": self.nll, "extra": extra}

    @classmethod
    def from_row(cls, sample_key: str, value: float | None, extra: Mapping[str, Any] | None) -> DocRecord:
        e = extra or {}
        nll = float(value) if value is not None else float("nan")
        term_tokens = e.get("term_tokens")
        return cls(sample_key, nll, int(e["n_tokens"]), int(e["n_words"]), int(e["n_bytes"]),
                   int(e.get("top1_hits") or 0), e.get("cluster"), tuple(e.get("greedy_ids") or ()),
                   float(e["term_nll"]) if term_tokens is not None else None,
                   int(term_tokens) if term_tokens is not None else None,
                   _buckets(e.get("positions")),
                   float(e["decode_nll"]) if e.get("decode_nll") is not None else None,
                   _buckets(e.get("decode_positions")),
                   DocDistribution.from_json(e["distribution"]) if e.get("distribution") else None,
                   DocTopK.from_json(e["topk"]) if e.get("topk") else None)


def _scored_from(stored: Mapping[str, Any] | None) -> Scored | None:
    if not stored:
        return None
    leaves = stored.get("leaves")  # absent: stored before the greedy path was checked, or not known
    read_back = stored.get("read_back_at")  # absent: none, or stored before it was kept
    return Scored(tuple(stored["ids"]), tuple(stored["logprobs"]),
                  tuple((int(i), float(gap)) for i, gap in leaves or ()), leaves is not None,
                  None if read_back is None else int(read_back))


def _buckets(stored: Any) -> tuple[PositionBucket, ...]:
    return tuple((int(lo), int(hi), float(nll), int(n)) for lo, hi, nll, n in stored or ())


@dataclass(frozen=True)
class GenerationRecord:
    """One prompt's generation with its timings. `spec` holds the speculative-decoding counters:
    per request from an in-process engine, or (spec_scope 'batch') a server's counter deltas over
    the whole batch, stored on the batch's first request."""

    KIND: ClassVar[str] = "generation"
    sample_key: str
    ttft_ms: float | None
    prompt: str
    text: str
    n_tokens: int
    prompt_tokens: int
    itl_ms: tuple[float, ...] = ()
    tokens_per_second: float | None = None
    token_ids: tuple[int, ...] = ()  # kept when the suite scores agreement
    spec: SpeculativeStats | None = None
    spec_scope: str = "request"  # "request" or "batch"
    # the output scored by the run's baseline model, teacher-forced after the prompt (gen_nll_ratio):
    # Σ −log p of its tokens and how many there were; None where the baseline engine could not score it
    baseline_nll: float | None = None
    baseline_nll_tokens: int | None = None
    # the baseline engine timed on the same prompt right before or after this one (ttft_ratio, tpot_ratio)
    paired_baseline_ttft_ms: float | None = None
    paired_baseline_tpot_ms: float | None = None
    finish_reason: str | None = None  # "stop" | "length" (OpenAI's), None where the engine did not say
    batch: int | None = None  # which batch of the config-run it was generated in (timings within one are correlated)
    # the output as the baseline model read it (its tokens and their log-probs), for the near-tie rule
    # (evals/health.py); None where the baseline engine could not score it
    scored: Scored | None = None
    # the server's own clock for this request, where it reported one (ServerTiming); the verdicts
    # on timing use the client's (ttft_ms, itl_ms), measured the same way on every engine
    server_timing: ServerTiming | None = None

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first: the mean time between tokens."""
        return sum(self.itl_ms) / len(self.itl_ms) if self.itl_ms else None

    @classmethod
    def from_result(cls, g: GenerationResult, prompt: str, keep_ids: bool) -> GenerationRecord:
        return cls(g.request_id, g.ttft_ms, prompt, g.text, g.n_tokens, g.prompt_tokens,
                   tuple(round(x, 3) for x in g.itl_ms), g.tokens_per_second,
                   tuple(g.token_ids) if keep_ids and g.token_ids else (), g.spec, finish_reason=g.finish_reason,
                   server_timing=g.server_timing)

    @property
    def sequence(self) -> Sequence[int] | str:
        """What agreement compares: token ids where the engine knows them, else the text (an HTTP stream)."""
        return self.token_ids or self.text

    def to_row(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"text": self.text, "prompt": self.prompt, "n_tokens": self.n_tokens,
                                 "prompt_tokens": self.prompt_tokens, "itl_ms": list(self.itl_ms),
                                 "tokens_per_second": self.tokens_per_second}
        if self.token_ids:
            extra["token_ids"] = list(self.token_ids)
        if self.spec is not None:
            extra["spec"] = speculative_to_json(self.spec) | ({"scope": "batch"} if self.spec_scope == "batch" else {})
        if self.baseline_nll is not None:
            extra["baseline_nll"], extra["baseline_nll_tokens"] = self.baseline_nll, self.baseline_nll_tokens
        if self.paired_baseline_ttft_ms is not None:
            extra["paired_baseline"] = {"ttft_ms": self.paired_baseline_ttft_ms,
                                        "tpot_ms": self.paired_baseline_tpot_ms}
        if self.finish_reason is not None:
            extra["finish_reason"] = self.finish_reason
        if self.batch is not None:
            extra["batch"] = self.batch
        if self.scored is not None:
            extra["scored"] = {"ids": list(self.scored.ids), "logprobs": [round(x, 5) for x in self.scored.logprobs],
                               **({"leaves": [list(x) for x in self.scored.leaves]} if self.scored.greedy_known
                                  else {}),
                               **({"read_back_at": self.scored.read_back_at}
                                  if self.scored.read_back_at is not None else {})}
        if self.server_timing is not None:
            extra["server_timing"] = {k: v for k, v in asdict(self.server_timing).items() if v is not None}
        return {"sample_key": self.sample_key, "metric": self.KIND, "value": self.ttft_ms, "extra": extra}

    @classmethod
    def from_row(cls, sample_key: str, value: float | None, extra: Mapping[str, Any] | None) -> GenerationRecord:
        e = extra or {}
        spec = e.get("spec")
        return cls(sample_key, value, e.get("prompt", ""), e.get("text", ""), int(e.get("n_tokens") or 0),
                   int(e.get("prompt_tokens") or 0), tuple(e.get("itl_ms") or ()), e.get("tokens_per_second"),
                   tuple(e.get("token_ids") or ()), _spec_from(spec), (spec or {}).get("scope", "request"),
                   e.get("baseline_nll"), e.get("baseline_nll_tokens"),
                   (e.get("paired_baseline") or {}).get("ttft_ms"), (e.get("paired_baseline") or {}).get("tpot_ms"),
                   e.get("finish_reason"), e.get("batch"),
                   _scored_from(e.get("scored")),
                   ServerTiming(**e["server_timing"]) if e.get("server_timing") else None)


@dataclass(frozen=True)
class RepeatRecord(GenerationRecord):
    """The baseline's second, independent pass over a prompt, made in a candidate's config-run
    (interleaved with the candidate's batches, at the same concurrency): the noise floor. Its
    outputs against the baseline's own first pass say how far the server disagrees with itself."""

    KIND: ClassVar[str] = "baseline_repeat"


@dataclass(frozen=True)
class SoloRecord(GenerationRecord):
    """A config's output for a prompt sent alone (nothing else in flight from the canary), to
    compare with its output for the same prompt inside a full batch (batch invariance)."""

    KIND: ClassVar[str] = "solo"



@dataclass(frozen=True)
class PairwiseRecord:
    """The judge's pairwise verdict on candidate vs baseline for one prompt (value: 1 candidate
    won, ½ tie, 0 baseline won; None when the judge's replies could not be parsed)."""

    KIND: ClassVar[str] = "judge_pairwise"
    WIN_VALUE: ClassVar[dict[str, float]] = {"candidate": 1.0, "tie": 0.5, "baseline": 0.0}
    sample_key: str
    winner: str | None
    consistent: bool | None
    orders: tuple[Any, ...] = ()
    parse_failures: int = 0
    rationale: str | None = None
    cluster: str | None = None

    @property
    def value(self) -> float | None:
        return self.WIN_VALUE.get(self.winner) if self.winner is not None else None

    def to_row(self) -> dict[str, Any]:
        return {"sample_key": self.sample_key, "metric": self.KIND, "value": self.value,
                "extra": {"winner": self.winner, "consistent": self.consistent, "orders": list(self.orders),
                          "parse_failures": self.parse_failures, "rationale": self.rationale, "cluster": self.cluster}}

    @classmethod
    def from_row(cls, sample_key: str, value: float | None, extra: Mapping[str, Any] | None) -> PairwiseRecord:
        e = extra or {}
        return cls(sample_key, e.get("winner"), e.get("consistent"), tuple(e.get("orders") or ()),
                   int(e.get("parse_failures") or 0), e.get("rationale"), e.get("cluster"))


@dataclass(frozen=True)
class RubricRecord:
    """The judge's single-answer rubric score (1–5) of one config's answer to one prompt."""

    KIND: ClassVar[str] = "judge_score"
    sample_key: str
    score: float | None
    stated: float | None = None
    weighted: float | None = None
    parse_failures: int = 0
    rationale: str | None = None
    cluster: str | None = None

    def to_row(self) -> dict[str, Any]:
        return {"sample_key": self.sample_key, "metric": self.KIND, "value": self.score,
                "extra": {"stated": self.stated, "weighted": self.weighted, "parse_failures": self.parse_failures,
                          "rationale": self.rationale, "cluster": self.cluster,
                          "outcome": "scored" if self.score is not None else "parse_failure"}}

    @classmethod
    def from_row(cls, sample_key: str, value: float | None, extra: Mapping[str, Any] | None) -> RubricRecord:
        e = extra or {}
        return cls(sample_key, value, e.get("stated"), e.get("weighted"), int(e.get("parse_failures") or 0),
                   e.get("rationale"), e.get("cluster"))


@dataclass(frozen=True)
class FaithfulnessRecord:
    """Faithfulness of one answer to its contexts: the share of its statements they support."""

    KIND: ClassVar[str] = "faithfulness"
    sample_key: str
    score: float | None
    outcome: str  # scored | no_statements | parse_failure
    method: str  # "judge" or "offline …" (the labelled approximation)
    parse_failures: int = 0
    statements: tuple[tuple[str, bool], ...] = ()
    cluster: str | None = None

    def to_row(self) -> dict[str, Any]:
        return {"sample_key": self.sample_key, "metric": self.KIND, "value": self.score,
                "extra": {"outcome": self.outcome, "method": self.method, "parse_failures": self.parse_failures,
                          "statements": [{"statement": st, "supported": ok} for st, ok in self.statements],
                          "cluster": self.cluster}}

    @classmethod
    def from_row(cls, sample_key: str, value: float | None, extra: Mapping[str, Any] | None) -> FaithfulnessRecord:
        e = extra or {}
        return cls(sample_key, value, e.get("outcome") or "", e.get("method") or "", int(e.get("parse_failures") or 0),
                   tuple((s["statement"], bool(s["supported"])) for s in e.get("statements") or ()), e.get("cluster"))


@dataclass(frozen=True)
class ItemRecord:
    """One labelled item as a config answered it (vocabulary/labelled.py; the labelled scorer)."""

    KIND: ClassVar[str] = "item"
    sample_key: str  # the item's id
    correct: bool
    answer: str | None  # what was read from the answer: the chosen choice's index, or the extracted text
    scores: tuple[float, ...] = ()  # each choice's Σ log p (multiple choice)
    output: str | None = None  # the generated answer (match exact, regex, number)

    def to_row(self) -> dict[str, Any]:
        return {"sample_key": self.sample_key, "metric": self.KIND, "value": 1.0 if self.correct else 0.0,
                "extra": {"answer": self.answer, "scores": list(self.scores), "output": self.output}}

    @classmethod
    def from_row(cls, sample_key: str, value: float | None, extra: Mapping[str, Any] | None) -> ItemRecord:
        e = extra or {}
        return cls(sample_key, bool(value), e.get("answer"), tuple(e.get("scores") or ()), e.get("output"))


Record = DocRecord | GenerationRecord | PairwiseRecord | RubricRecord | FaithfulnessRecord | ItemRecord
RECORDS: dict[str, Any] = {cls.KIND: cls for cls in (DocRecord, GenerationRecord, RepeatRecord, SoloRecord,
                                                      PairwiseRecord, RubricRecord, FaithfulnessRecord, ItemRecord)}
# what a config-run's engine pass writes (a reused baseline's rows are these; a top-up keeps them); scorers (a
# judge, faithfulness) add the other kinds later. A producer's own kinds join with register_record
_ENGINE_KINDS: list[str] = [DocRecord.KIND, GenerationRecord.KIND, RepeatRecord.KIND, SoloRecord.KIND, ItemRecord.KIND]


def engine_kinds() -> tuple[str, ...]:
    """The record kinds a config-run's engine pass writes."""
    return tuple(_ENGINE_KINDS)


def register_record(cls: Any, *, engine_pass: bool = False) -> Any:
    """Make a record kind readable (a producer's own: KIND, to_row, from_row); engine_pass: written
    by a config-run's engine pass, so a reused baseline copies it and a top-up keeps it. Registering
    the same class again is a no-op; another class under a known kind is an error."""
    known = RECORDS.get(cls.KIND)
    if known is not None and known is not cls:
        raise ValueError(f"record kind '{cls.KIND}' is {known.__name__}'s already")
    RECORDS[cls.KIND] = cls
    if engine_pass and cls.KIND not in _ENGINE_KINDS:
        _ENGINE_KINDS.append(cls.KIND)
    return cls


def unregister_record(cls: Any) -> None:
    """Forget a kind registered by register_record (a test's toy)."""
    kind: str = cls.KIND
    if RECORDS.get(kind) is cls and cls not in _BUILTIN:
        del RECORDS[kind]
        if kind in _ENGINE_KINDS:
            _ENGINE_KINDS.remove(kind)


_BUILTIN = tuple(RECORDS.values())


def read_row(kind: str, sample_key: str, value: float | None, extra: Mapping[str, Any] | None) -> Record:
    """The typed record of a stored row; an unknown kind is an error naming it."""
    try:
        cls = RECORDS[kind]
    except KeyError:
        raise ValueError(f"sample_results.metric: unknown record kind '{kind}'; known: {', '.join(RECORDS)}") from None
    record: Record = cls.from_row(sample_key, value, extra)
    return record


@dataclass
class ConfigRecords:
    """One config's records in a run, by kind and sample key (in the order they were stored)."""

    docs: dict[str, DocRecord]
    generations: dict[str, GenerationRecord]
    pairwise: dict[str, PairwiseRecord]
    rubric: dict[str, RubricRecord]
    faithfulness: dict[str, FaithfulnessRecord]
    repeats: dict[str, RepeatRecord] = field(default_factory=dict)  # the baseline's second pass (a candidate's run)
    solos: dict[str, SoloRecord] = field(default_factory=dict)  # prompts sent alone
    items: dict[str, ItemRecord] = field(default_factory=dict)  # labelled items answered
    kinds: dict[str, dict[str, Any]] = field(default_factory=dict)  # a registered producer's own kinds, by kind

    @classmethod
    def empty(cls) -> ConfigRecords:
        return cls({}, {}, {}, {}, {})

    def add(self, record: Record) -> None:
        tables: dict[type, dict[str, Any]] = {
            DocRecord: self.docs, GenerationRecord: self.generations, RepeatRecord: self.repeats,
            SoloRecord: self.solos, PairwiseRecord: self.pairwise, RubricRecord: self.rubric,
            FaithfulnessRecord: self.faithfulness, ItemRecord: self.items}
        table = tables.get(type(record))
        if table is None:  # a kind a producer registered (register_record)
            table = self.kinds.setdefault(record.KIND, {})
        table[record.sample_key] = record


class RunRecords(dict[int, ConfigRecords]):
    """A run's records by config id, read once by the aggregation (a missing config reads as empty)."""

    def __missing__(self, config_id: int) -> ConfigRecords:
        self[config_id] = ConfigRecords.empty()
        return self[config_id]

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[int, str, str, float | None, Mapping[str, Any] | None]]) -> RunRecords:
        """rows: (config_id, kind, sample_key, value, extra) in storage order."""
        table = cls()
        for config_id, kind, sample_key, value, extra in rows:
            table[config_id].add(read_row(kind, sample_key, value, extra))
        return table
