"""The optimization-config vocabulary: the three axes, the engine that runs them, and which
engine implements which values today. This is the one place a config's shape is defined; the
service (app/) validates requests against it, so this module must stay free of torch.

A config is a point on three axes (docs/design.md §Domain model):
  weights      fp32 | fp16 | bf16 | int8 | rtn-int4 | rtn-int3 | rtn-int2 | awq-int4 |
               gptq-int4 (only from a `checkpoint` that GPTQ made) |
               gguf-q8_0 | gguf-q4_k_m (llama.cpp's types, served by a llama.cpp server)
  kv_cache     auto | fp16 | bf16 | fp32 | fp8 | int8 | int4 | int2 | kivi-4 | kivi-2 |
               turbo-2 | turbo-2.5 | turbo-3 | turbo-3.5 | turbo-4 | turbo-ip-3
  speculative  off | draft (draft model + k) | ngram (prompt lookup + k) | eagle
plus the engine (transformers | reference | vllm | openai) and free-form engine options.

One reference-engine option is no optimization: `engine_options.fault`, a canary drill (a seeded
fault of known size, engines/reference/faults.py) whose shape is defined here with the rest.
"""

from __future__ import annotations

from difflib import get_close_matches
from typing import Annotated, Any, Literal, NamedTuple, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

WEIGHTS = ("fp32", "fp16", "bf16", "int8", "rtn-int4", "rtn-int3", "rtn-int2", "awq-int4", "gptq-int4", "gguf-q8_0",
           "gguf-q4_k_m")
KV_CACHE = (
    "auto", "fp16", "bf16", "fp32", "fp8", "int8", "int4", "int2", "kivi-4", "kivi-2",
    "turbo-2", "turbo-2.5", "turbo-3", "turbo-3.5", "turbo-4", "turbo-ip-3",
)  # fmt: skip
SPECULATIVE_METHODS = ("off", "draft", "ngram", "eagle")
ENGINES = ("transformers", "reference", "vllm", "openai")

# Bits stored per weight element, including the fp16 scale and zero of each group of 128
# (docs/reference.md §1: group-wise asymmetric quantization, 2 × 16 bits per 128 weights).
GROUP_SIZE = 128
BITS_PER_WEIGHT = {
    "fp32": 32.0,
    "fp16": 16.0,
    "bf16": 16.0,
    "int8": 8 + 32 / GROUP_SIZE,
    "rtn-int4": 4 + 32 / GROUP_SIZE,
    "rtn-int3": 3 + 32 / GROUP_SIZE,
    "rtn-int2": 2 + 32 / GROUP_SIZE,
    "awq-int4": 4 + 32 / GROUP_SIZE,
    "gptq-int4": 4 + 16 / GROUP_SIZE,  # llm-compressor's W4A16: symmetric, a scale per group and no zero
    # llama.cpp blocks: Q8_0 is 32 int8 + one fp16 scale; Q4_K is 256 4-bit weights in 144 bytes
    # (Q4_K_M keeps some tensors at Q6_K, 6.5625 bits, so its files come out near 4.8 bits)
    "gguf-q8_0": 8 + 16 / 32,
    "gguf-q4_k_m": 144 * 8 / 256,
}

# What each engine can run today. Values outside these sets are valid vocabulary but are
# refused with "not available in this engine" until the engine implements them.
AVAILABLE: dict[str, dict[str, frozenset[str]]] = {
    "transformers": {
        "weights": frozenset({"fp32", "fp16", "bf16", "int8", "rtn-int4", "rtn-int3", "rtn-int2"}),
        "kv_cache": frozenset({"auto"}),
        "speculative": frozenset({"off"}),
    },
    "reference": {
        "weights": frozenset({"fp32", "fp16", "bf16", "int8", "rtn-int4", "rtn-int3", "rtn-int2", "awq-int4",
                              "gptq-int4"}),
        "kv_cache": frozenset(KV_CACHE),  # every name: engines/reference/kv.kv_format builds each
        "speculative": frozenset({"off", "draft", "ngram"}),
    },
    # vLLM: what engines/vllm.py maps onto LLM(quantization=, kv_cache_dtype=, speculative_config=)
    "vllm": {
        "weights": frozenset({"fp32", "fp16", "bf16", "awq-int4"}),
        "kv_cache": frozenset({"auto", "fp16", "bf16", "fp8", "turbo-3", "turbo-3.5", "turbo-4"}),
        "speculative": frozenset({"off", "draft", "ngram", "eagle"}),
    },
    # a deployed server: the axes are labels of what it runs (the server decides)
    "openai": {"weights": frozenset(WEIGHTS), "kv_cache": frozenset(KV_CACHE),
               "speculative": frozenset(SPECULATIVE_METHODS)},
}
class EngineOption(NamedTuple):
    """One engine option: its type, what it does, and its default, the one place that default lives
    (`OptimizationSpec.option` reads it). A default of None: unset, the engine decides from its
    context as the description says."""

    kind: type
    description: str
    default: Any = None
    choices: tuple[str, ...] = ()  # the only values it takes, where it is a choice of names


# engine_options each engine understands
ENGINE_OPTIONS: dict[str, dict[str, EngineOption]] = {
    "transformers": {
        "device": EngineOption(str, "torch device, e.g. 'cpu' or 'cuda:0' (default: cuda when present)"),
        "batch_size": EngineOption(int, "perplexity windows per forward pass (default 8)", 8),
    },
    "reference": {
        "device": EngineOption(str, "torch device, e.g. 'cpu' or 'cuda:0' (default: cuda when present)"),
        "batch_size": EngineOption(int, "perplexity windows per forward pass (default 8; under a lossy KV "
                                        "cache, rows as wide as the widest, short windows sharing a row where "
                                        "the format allows)", 8),
        "concurrency": EngineOption(int, "generation requests decoded together as one batch (default 1)", 1),
        "calibration_samples": EngineOption(int, "AWQ calibration windows (default 128)", 128),
        "calibration_tokens": EngineOption(int, "tokens per AWQ calibration window (default min(512, context))"),
        "cuda_graphs": EngineOption(bool, "replay each decode step as a CUDA graph (default: true on CUDA)"),
        "int4_gemv": EngineOption(str, "the kernel of a single row through int4 weights on CUDA: 'auto' (torch's "
                                       "tinygemm where it runs, else the Triton GEMV; default), 'tinygemm' or "
                                       "'triton' (describe() notes which ran)", "auto", ("auto", "tinygemm", "triton")),
        "fault": EngineOption(dict, "a canary drill, never a deployment setting: a seeded fault of known size that "
                                    "proves the canary catches it, e.g. {'kind': 'kv-corrupt', 'layers': 2}; kinds: "
                                    "weight-noise, kv-corrupt, token-corrupt, ttft-delay, logprob-shift "
                                    "(engines/reference/faults.py)"),
    },
    "openai": {
        "base_url": EngineOption(str, "the server's OpenAI base URL, e.g. http://vllm.internal:8000/v1 (required)"),
        "metrics_url": EngineOption(str, "its Prometheus endpoint (default: base_url without /v1, plus /metrics)"),
        "api_key_env": EngineOption(str, "name of the environment variable holding the API key (never the key "
                                         "itself)"),
        "concurrency": EngineOption(int, "requests in flight at once (default 1)", 1),
        "timeout_s": EngineOption(int, "per-request timeout in seconds (default 60)", 60),
        "served_model": EngineOption(str, "the model id the server answers to (vLLM's --served-model-name; default: "
                                          "the config's model path)"),
        "start_token_id": EngineOption(int, "the token every prompt starts with, as the in-process engines prepend it "
                                            "(the model's BOS, else its EOS), for a server whose tokenizer adds none: "
                                            "overrides what /tokenizer_info (vLLM: --enable-tokenizer-info-endpoint) "
                                            "or the config's local model's own tokenizer would name"),
        "dedicated_server": EngineOption(
            bool, "true: the server serves only the canary while it runs, so its spec-decode counter deltas are the "
                  "run's acceptance (default false: they are reported in figures.server, flagged when other traffic "
                  "moved them, and not judged). Not needed where the server reports each request's own figures "
                  "(vLLM's --per-request-spec-decode-metrics summary): those are judged either way", False),
    },
    "vllm": {
        "tensor_parallel_size": EngineOption(int, "GPUs per model (default 1)"),
        "gpu_memory_utilization": EngineOption(float, "fraction of GPU memory vLLM may take (default 0.9)"),
        "max_model_len": EngineOption(int, "context length to allocate for (default: the model's)"),
        "concurrency": EngineOption(int, "requests submitted together (default: all of a batch)"),
    },
}
NOT_YET = {
    "reference": "the reference engine harness (AWQ, compressed KV, speculative decoding)",
}


class ConfigNotAvailable(ValueError):
    """A config value (or engine option) that the chosen engine does not implement."""

    def __init__(self, field: str, value: str, engine: str, available: frozenset[str], message: str | None = None):
        self.field = field
        if message:
            msg = message
        elif field == "engine":
            msg = (
                f"engine: '{engine}' is not available in this release (it arrives with "
                f"{NOT_YET.get(engine, 'a later release')}); use engine 'transformers'"
            )
        else:
            msg = (
                f"{field}: '{value}' is not available in engine '{engine}'; "
                f"available there: {', '.join(sorted(available))}"
            )
        super().__init__(msg)


def did_you_mean(value: str, choices: tuple[str, ...]) -> str:
    close = get_close_matches(value, choices, n=1)
    tail = f"did you mean '{close[0]}'? " if close else ""
    return f"{tail}choose one of: {', '.join(choices)}"


class SpecOff(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["off"] = "off"


class SpecDraft(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["draft"]
    draft_model: str = Field(description="path of an HF directory sharing the target's tokenizer, or builtin:NAME")
    k: int = Field(4, ge=1, le=16, description="draft tokens proposed per target pass")


class SpecNgram(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["ngram"]
    k: int = Field(4, ge=1, le=16)
    prompt_lookup_max: int = Field(3, ge=1, le=16)
    prompt_lookup_min: int = Field(1, ge=1, le=16)


class SpecEagle(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal["eagle"]
    draft_model: str
    k: int = Field(4, ge=1, le=16)


Speculative = Annotated[SpecOff | SpecDraft | SpecNgram | SpecEagle, Field(discriminator="method")]


class OptimizationSpec(BaseModel):
    """One optimization config: what the engine must run. Stored as JSON on the config row."""

    model_config = ConfigDict(extra="forbid")
    engine: str = "transformers"
    weights: str = "fp16"
    kv_cache: str = "auto"
    speculative: Speculative = Field(default_factory=SpecOff)
    engine_options: dict[str, Any] = Field(
        default_factory=dict, description="engine-specific options, e.g. {'device': 'cpu', 'batch_size': 8}"
    )
    lossless: bool | None = Field(
        None, exclude_if=lambda v: v is None,
        description="true: this config computes what the baseline computes, so its greedy outputs must equal the "
                    "baseline's (gated on lossless_exact_match); false: never; unset: decided from the axes "
                    "(same weights and KV cache as the baseline, whatever the engine or speculative decoding)")
    checkpoint: str | None = Field(
        None, exclude_if=lambda v: v is None,
        description="a directory holding this config's own weights of the project's model, quantized by the tool the "
                    "team deploys with (llm-compressor's compressed-tensors, AutoAWQ): loaded instead of model.path, "
                    "with the same tokenizer; its quantization_config decides the weights axis (engine reference)")
    step_back: bool | None = Field(
        None, exclude_if=lambda v: v is None,
        description="false: when this config stacks optimizations on two or more axes and breaches a quality "
                    "threshold, do not run its single-optimization ablations (the step-back advice); unset or true: "
                    "run them")

    @field_validator("step_back", mode="before")
    @classmethod
    def _step_back(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"expected true or false, got {v!r}; false keeps a stacked config that breaches from "
                             "running its single-optimization ablations, true (the default) runs them")
        return v

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        if v not in ENGINES:
            raise ValueError(f"unknown engine '{v}'; {did_you_mean(v, ENGINES)}")
        return v

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: str) -> str:
        if v not in WEIGHTS:
            raise ValueError(f"unknown weights '{v}'; {did_you_mean(v, WEIGHTS)}")
        return v

    @field_validator("kv_cache")
    @classmethod
    def _kv(cls, v: str) -> str:
        if v not in KV_CACHE:
            raise ValueError(f"unknown kv_cache '{v}'; {did_you_mean(v, KV_CACHE)}")
        return v

    def option(self, name: str) -> Any:
        """engine_options[name] as the config gave it, else this engine's default for it
        (ENGINE_OPTIONS); None for an option this engine does not have. A name no engine has is a
        KeyError (a misspelt read, not a config problem)."""
        if name in self.engine_options:
            return self.engine_options[name]
        if not any(name in options for options in ENGINE_OPTIONS.values()):
            raise KeyError(f"no engine has an option '{name}'")
        known = ENGINE_OPTIONS.get(self.engine, {}).get(name)
        return known.default if known is not None else None

    def check_available(self) -> None:
        """Raise ConfigNotAvailable naming the first axis the engine cannot run."""
        table = AVAILABLE[self.engine]
        if not table["weights"]:
            raise ConfigNotAvailable("engine", self.engine, self.engine, frozenset())
        if self.engine == "openai":
            url = str(self.option("base_url") or "")
            if not url.startswith(("http://", "https://")):
                raise ConfigNotAvailable("engine_options.base_url", url, self.engine, frozenset(), message=(
                    "engine_options.base_url: engine 'openai' needs the server's http(s) base URL, e.g. "
                    f"http://vllm.internal:8000/v1; got {url!r}"))
        options = ENGINE_OPTIONS.get(self.engine, {})
        for key, value in self.engine_options.items():
            if key not in options:
                known = ", ".join(sorted(options)) or "none"
                raise ConfigNotAvailable(f"engine_options.{key}", str(value), self.engine, frozenset(),
                                         message=f"engine_options.{key}: unknown option for engine "
                                                 f"'{self.engine}'; options: {known}")
            kind = options[key].kind
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ConfigNotAvailable(f"engine_options.{key}", str(value), self.engine, frozenset(),
                                         message=f"engine_options.{key}: expected {kind.__name__}, got {value!r}")
            if key == "fault":
                from engines.drills import parse_fault

                parse_fault(value, self.kv_cache)
            if options[key].choices and value not in options[key].choices:
                raise ConfigNotAvailable(f"engine_options.{key}", str(value), self.engine,
                                         frozenset(options[key].choices),
                                         message=f"engine_options.{key}: '{value}' is not one of "
                                                 f"{', '.join(options[key].choices)}")
            if key in ("batch_size", "concurrency", "calibration_samples", "calibration_tokens", "timeout_s",
                       "tensor_parallel_size", "max_model_len") and cast(int, value) < 1:  # an int: checked above
                raise ConfigNotAvailable(f"engine_options.{key}", str(value), self.engine, frozenset(),
                                         message=f"engine_options.{key}: must be ≥ 1, got {value}")
        if self.checkpoint is not None and self.engine != "reference":
            raise ConfigNotAvailable("checkpoint", self.checkpoint, self.engine, frozenset(), message=(
                f"checkpoint: engine '{self.engine}' does not load a config's own checkpoint; use engine: reference, "
                "or serve the checkpoint (vLLM) and point engine: openai at it"))
        if self.weights == "gptq-int4" and self.engine != "openai" and self.checkpoint is None:
            raise ConfigNotAvailable("weights", self.weights, self.engine, frozenset(), message=(
                "weights: gptq-int4 comes from a checkpoint that GPTQ made (llm-compressor's oneshot with "
                "GPTQModifier); name its directory in checkpoint:, or use rtn-int4 or awq-int4, which the reference "
                "engine quantizes itself"))
        for field, value in (
            ("weights", self.weights),
            ("kv_cache", self.kv_cache),
            ("speculative", self.speculative.method),
        ):
            if value not in table[field]:
                raise ConfigNotAvailable(field, value, self.engine, table[field])

    @property
    def bits_per_weight(self) -> float:
        return BITS_PER_WEIGHT[self.weights]

    def label(self) -> str:
        sp = self.speculative
        spec: str = sp.method
        if not isinstance(sp, SpecOff):
            spec = f"{spec}-k{sp.k}"
        return f"{self.engine}:{self.weights}/kv={self.kv_cache}/spec={spec}"


FLOAT_WEIGHTS = ("fp32", "fp16", "bf16")


def _kv_format(spec: OptimizationSpec) -> str:
    """The KV cache as stored: 'auto' keeps a float model's own dtype."""
    if spec.kv_cache == "auto" and spec.weights in FLOAT_WEIGHTS:
        return spec.weights
    return spec.kv_cache


def lossless_against(candidate: OptimizationSpec, baseline: OptimizationSpec) -> bool:
    """Whether the candidate should produce the baseline's greedy outputs token for token: it says
    so (`lossless`), or it keeps the baseline's weights and KV cache and changes only how they are
    served (the engine, its options, speculative decoding with greedy verification). A change of
    float precision (fp32 against an fp16 baseline) is not lossless by this rule: near-ties may
    flip; a team that holds it exact says `lossless: true`. Another checkpoint is other weights."""
    if candidate.lossless is not None:
        return candidate.lossless
    return (candidate.weights == baseline.weights and candidate.checkpoint == baseline.checkpoint
            and _kv_format(candidate) == _kv_format(baseline))


# The axes a stacked config can step back on, in the order the advice lists them.
AXES = ("weights", "kv_cache", "speculative")


def changed_axes(candidate: OptimizationSpec, baseline: OptimizationSpec) -> list[str]:
    """The axes on which the candidate differs from the baseline: its weights, its KV cache as
    stored (`auto` on a float model is that model's dtype), its speculative decoding. Two or more
    make it a *stacked* config (docs/scorers.md, "step back one layer")."""
    out = []
    if candidate.weights != baseline.weights or candidate.checkpoint != baseline.checkpoint:  # a checkpoint is weights
        out.append("weights")
    if candidate.kv_cache != baseline.kv_cache and _kv_format(candidate) != _kv_format(baseline):
        out.append("kv_cache")
    if candidate.speculative != baseline.speculative:
        out.append("speculative")
    return out


def axis_value(spec: OptimizationSpec, axis: str) -> str:
    """An axis's value in words: `awq-int4`, `turbo-2.5`, `draft-k4`."""
    if axis != "speculative":
        return str(getattr(spec, axis))
    sp = spec.speculative
    return sp.method if isinstance(sp, SpecOff) else f"{sp.method}-k{sp.k}"


def single_axis_ablation(candidate: OptimizationSpec, baseline: OptimizationSpec, axis: str) -> OptimizationSpec:
    """The baseline with only `axis` taken from the candidate, on the candidate's engine and engine
    options: one layer of a stacked config alone. Whether it is lossless is decided from its axes
    again, and it never steps back itself. A config's own checkpoint is its weights: it goes with
    the weights axis."""
    if axis not in AXES:
        raise ValueError(f"axis: '{axis}' is not an optimization axis; choose one of: {', '.join(AXES)}")
    weights = {"checkpoint": candidate.checkpoint} if axis == "weights" else {}
    return baseline.model_copy(update={"engine": candidate.engine, "engine_options": dict(candidate.engine_options),
                                       axis: getattr(candidate, axis), "lossless": None, "step_back": None,
                                       **weights})
