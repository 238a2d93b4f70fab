"""The engine protocol: three batch methods over frozen request/result dataclasses
(the shape of lm-eval-harness's LM interface). Every backend implements it; evals and workers
depend only on this file.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it samples greedily (SamplingParams._SAMPLING_EPS)


@dataclass(frozen=True)
class WindowSpec:
    """Strided perplexity windows (HF "Perplexity of fixed-length models").

    Each window holds at most ``max_length`` tokens and advances by ``stride``; only the tokens
    not scored by an earlier window are scored, each with up to max_length − 1 tokens of context.
    The last window reaches back to a full window of context, as lm-eval's rolling windows do.
    stride == max_length gives lm-eval's disjoint windows (loglikelihood_rolling). Compared configs must use
    the same WindowSpec, or their perplexities are not comparable.
    """

    max_length: int = 256
    stride: int = 256

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ValueError(f"window max_length must be ≥ 2, got {self.max_length}")
        if not 1 <= self.stride <= self.max_length:
            raise ValueError(f"window stride must be in [1, max_length={self.max_length}], got {self.stride}")


def strided_windows(n_tokens: int, spec: WindowSpec) -> list[tuple[int, int, int]]:
    """Windows over seq = [start] + tokens (length n_tokens + 1); targets are seq[1:].

    Returns (begin, end, n_scored): feed seq[begin:end] (≤ max_length tokens); its last n_scored
    next-token predictions score targets seq[end − n_scored + 1 : end + 1]. Every target is
    scored exactly once; a target's context is everything in its window before it.
    """
    out, prev_end, begin = [], 0, 0
    while prev_end < n_tokens:
        end = min(begin + spec.max_length, n_tokens)
        if end > prev_end:
            # a short last window starts earlier, so that its targets have a full window of context
            # (lm-eval's get_rolling_token_windows); earlier windows start where the stride puts them
            out.append((max(0, end - spec.max_length), end, end - prev_end))
            prev_end = end
        begin += spec.stride
    return out


def token_texts(tokenizer: Any, ids: Sequence[int]) -> tuple[str, ...]:
    """Each token's own text (a byte-level token that ends inside a UTF-8 character decodes to a
    replacement character, as a server's echo names it)."""
    if not len(ids):
        return ()
    return tuple(tokenizer.batch_decode([[int(i)] for i in ids], clean_up_tokenization_spaces=False))


def count_words(text: str) -> int:
    r"""Words for word perplexity, as lm-eval counts them: len(re.split(r"\s+", text)) (leading or
    trailing whitespace counts one empty word, as there)."""
    return len(re.split(r"\s+", text))


@dataclass(frozen=True)
class RollingRequest:
    doc_id: str
    text: str
    window: WindowSpec = WindowSpec()
    # also each token's text and the greedy token's text at each position (RollingResult.token_texts,
    # greedy_texts): an answer read by the baseline model (workers/generation.py), not a corpus document
    texts: bool = False


@dataclass(frozen=True)
class RollingResult:
    """Log-probabilities of every token of one document, each scored exactly once."""

    doc_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # natural log p(token_i | context), one per token
    greedy_ids: tuple[int, ...]  # argmax token at each scored position (top-1 agreement)
    n_bytes: int  # UTF-8 bytes of the text (byte perplexity)
    n_words: int  # words (word perplexity): count_words, lm-eval's definition
    # each token's [start, end) characters in the document (domain-term NLL, vocabulary/terms.py); empty
    # where the engine cannot place its tokens in the text (an HTTP server's tokenizer)
    char_spans: tuple[tuple[int, int], ...] = ()
    # log p of the argmax token at each scored position (its top-1 log-prob); empty where the engine
    # does not give it
    greedy_logprobs: tuple[float, ...] = ()
    # where the request asked for texts: each token's text and the argmax token's text at each position
    token_texts: tuple[str, ...] = ()
    greedy_texts: tuple[str, ...] = ()

    @property
    def nll(self) -> float:
        return -sum(self.logprobs)


def tokenize_with_spans(tokenizer: Any, text: str) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """A document's token ids (no special tokens) and each token's [start, end) characters; no spans
    where the tokenizer cannot give offsets (a slow tokenizer). A document longer than the model's
    context is scored in windows, so the tokenizer's warning about it is not printed (verbose)."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    except NotImplementedError:  # slow (Python) tokenizers have no offsets
        return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]), ()
    return list(encoded["input_ids"]), tuple((int(a), int(b)) for a, b in encoded["offset_mapping"])


@dataclass(frozen=True)
class PromptScores:
    """What an OpenAI echo needs of one pass over a prompt's token ids (BOS first): log p of each
    token after the first, the top alternatives at each position (top[t]: the most likely tokens
    after ids[:t + 1], so the last entry is for the token after the prompt), and the greedy next
    token with its log-prob."""

    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    next_token: int
    next_logprob: float


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: str
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    top_p: float = 1.0  # nucleus sampling (engines/sampling.py); 1 = off
    top_k: int = 0  # the k most likely tokens only; 0 = all
    # log-probs of the generated tokens (the model's distribution, before temperature and filters),
    # each with this many most likely alternatives; None: not wanted
    logprobs: int | None = None
    # OpenAI's presence_penalty, frequency_penalty and logit_bias ((token id, bias), …): engines/sampling.py
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the prompt as token ids (an OpenAI `prompt` given as ids, as vLLM takes it), used as given: no
    # start token is added; `prompt` then holds their text, for logs. None: engines tokenize `prompt`.
    prompt_ids: tuple[int, ...] | None = None

    @property
    def adjusted(self) -> bool:
        """Whether the logits are changed before picking (a greedy pick is then no plain argmax)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass(frozen=True)
class SpeculativeStats:
    """Speculative-decoding counters with vLLM's definitions (docs/reference.md §3)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:  # accepted draft tokens / draft tokens
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:  # 1 + accepted / drafts (incl. bonus)
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def per_position_rate(self) -> tuple[float, ...]:  # accepted at draft position i / drafts
        return tuple(a / self.num_drafts for a in self.accepted_per_position) if self.num_drafts else ()

    def __add__(self, other: SpeculativeStats) -> SpeculativeStats:
        """Counters of two spans of work (requests, batches): every total adds, position by position."""
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + (0,) * (n - len(self.accepted_per_position))
        theirs = other.accepted_per_position + (0,) * (n - len(other.accepted_per_position))
        return SpeculativeStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                         self.num_accepted_tokens + other.num_accepted_tokens,
                         tuple(a + b for a, b in zip(mine, theirs, strict=True)))


@dataclass(frozen=True)
class ServerTiming:
    """One request's timings by the server's own clock (vLLM's per-request `metrics`, with
    --enable-per-request-metrics; engine-serve the same): TTFT from when the request was scheduled
    (its queue wait apart), the queue wait, and the mean gap between output tokens. The client's
    TTFT adds the network and the queue to the first of these."""

    ttft_ms: float | None = None
    queue_ms: float | None = None
    mean_itl_ms: float | None = None


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    ttft_ms: float  # request start → first new token available
    itl_ms: tuple[float, ...]  # time between consecutive deliveries of new tokens (one per decode step)
    total_ms: float
    spec: SpeculativeStats | None = None
    completion_tokens: int | None = None  # when token_ids are not known (an HTTP server's stream)
    # per generated token, when the request asked: (log p(token), ((alternative id, log p), …))
    token_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = ()
    # why the output ended, in OpenAI's words: "stop" (an end-of-sequence token or a stop string),
    # "length" (max_tokens reached); None where the engine does not say
    finish_reason: str | None = None
    # the server's own clock for this request, where it reports one (vLLM --enable-per-request-metrics)
    server_timing: ServerTiming | None = None

    @property
    def n_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.n_tokens / (self.total_ms / 1000) if self.total_ms > 0 else 0.0


@dataclass(frozen=True)
class EngineDescription:
    engine: str
    model: str
    weights: str
    kv_cache: str
    speculative: str
    device: str
    compute_dtype: str
    parameters: int
    weight_bytes: int  # bytes the weights take in their stored format (quantized incl. scales)
    kv_bytes_per_token: int  # all layers, keys + values
    versions: dict[str, str] = field(default_factory=dict)
    # measured, not computed: what this engine holds in memory (it may keep a dequantized copy)
    resident_weight_bytes: int | None = None
    peak_kv_cache_bytes: int | None = None  # largest set of KV buffers allocated so far
    peak_device_bytes: int | None = None  # torch.cuda.max_memory_allocated, on CUDA
    # peak fraction (0–1) of the allocated KV cache in use: tokens held / token slots allocated;
    # None where the engine cannot know it (a remote server reports it in ServerStats instead)
    kv_cache_usage: float | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerStats:
    """What a serving process reported about itself while the last generate() call ran, read from
    its Prometheus /metrics (vLLM's names): counter deltas and gauge peaks. Any other traffic on
    that server is counted too. None where the server does not report a figure."""

    metrics_url: str | None = None  # where they were read, without credentials
    spec: SpeculativeStats | None = None  # vllm:spec_decode_* counter deltas over the call
    max_kv_cache_usage: float | None = None  # vllm:kv_cache_usage_perc (0–1), highest sample
    max_num_requests_waiting: float | None = None  # vllm:num_requests_waiting, highest sample
    max_num_requests_running: float | None = None  # vllm:num_requests_running, highest sample


@runtime_checkable
class Engine(Protocol):
    def loglikelihood_rolling(self, requests: Sequence[RollingRequest]) -> list[RollingResult]: ...

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]: ...

    def describe(self) -> EngineDescription: ...

    def server_stats(self) -> ServerStats | None:
        """The server's own figures over the last generate() call; None for an in-process engine."""
        ...

    def reset_peaks(self) -> None:
        """Start a new measurement window: the peaks describe() reports (KV cache bytes and usage,
        device memory) count from here. A cached engine serves many config-runs; each reports its own."""
        ...


# -- optional capabilities: an engine has one when it has its methods (isinstance checks them) --------------
@runtime_checkable
class ScoresDecode(Protocol):
    """The rolling pass's windows teacher-forced one token per decode step through the KV cache
    (decode_nll_ratio); `scores_decode` says whether that can differ from the rolling pass (a
    lossy KV cache), else the producer skips it."""

    @property
    def scores_decode(self) -> bool: ...

    def loglikelihood_decode(self, requests: Sequence[RollingRequest]) -> list[RollingResult]: ...


@dataclass(frozen=True)
class ChoiceRequest:
    """A multiple-choice item for loglikelihood_choices: the choices' texts follow the prompt's."""

    item_id: str
    prompt: str
    choices: tuple[str, ...]
    window: WindowSpec = WindowSpec()


@runtime_checkable
class ScoresChoices(Protocol):
    """Each choice's Σ log p after its prompt, the prompt's tokens computed once for all its choices
    (in-process engines): the same tokens and contexts as the rolling pass over prompt + choice
    (vocabulary/labelled.py continuation_loglikelihood), about a quarter of its tokens at four
    choices. None for an item it cannot score so (the caller scores prompt + choice rolling)."""

    def loglikelihood_choices(self, requests: Sequence[ChoiceRequest]) -> list[tuple[float, ...] | None]: ...


@runtime_checkable
class GivesDistributions(Protocol):
    """Each scored token's whole next-token distribution (in-process engines: kld_mean against the
    baseline engine's own)."""

    def next_token_logprobs(self, requests: Sequence[RollingRequest]) -> list[tuple[RollingResult, Any]]: ...


@runtime_checkable
class GivesTopK(Protocol):
    """Each scored token's top-k next tokens and their log-probs, as a server returns them (at most 20)."""

    def next_token_topk(self, requests: Sequence[RollingRequest], k: int) -> list[tuple[RollingResult, list, list]]: ...


@dataclass(frozen=True)
class LayerStates:
    """One document's first window as a forward pass saw it, layer by layer (GivesLayerStates):
    T tokens (the start token first), L layers. Arrays are numpy float32.

    hidden [L + 1, T, dim]: the residual stream before layer 0 (the embeddings) and after each layer;
    attention [L, T, dim]: each layer's attention output (after o_proj);
    keys, values [L, T, Hkv·D]: what each layer's KV cache holds for the window's tokens after the
    pass, as a later token reads them back, in the keys' own domain (a lossless cache: the keys
    themselves). A format that reads a prefill's own tokens in full precision (KIVI) holds codes
    all the same: its keys drift while the pass's attention does not."""

    token_ids: tuple[int, ...]
    hidden: Any
    attention: Any
    keys: Any
    values: Any


@runtime_checkable
class GivesLayerStates(Protocol):
    """A document's per-layer states (in-process engines: where a candidate's drift from the
    baseline starts, workers/producers/layer_drift.py)."""

    def layer_states(self, request: RollingRequest) -> LayerStates: ...


def scores_decode(engine: object) -> bool:
    """Whether `engine` scores decode-regime log-likelihoods that can differ from its rolling pass."""
    return isinstance(engine, ScoresDecode) and engine.scores_decode


def gives_distributions(engine: object) -> bool:
    """Whether `engine` gives next-token distributions, whole (in-process) or as a top-k table (a server)."""
    return isinstance(engine, (GivesDistributions, GivesTopK))
