"""Canary drills: engine_options.fault on the reference engine, each a seeded fault of known size,
typed and checked here (what each does, exactly, is in engines/reference/faults.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from engines.spec import KV_CACHE, ConfigNotAvailable, did_you_mean


class WeightNoiseFault(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["weight-noise"]
    sigma: float = Field(ge=0, le=10, description="noise std as a multiple of each decoder matrix's std")
    seed: int = 0


class KVCorruptFault(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["kv-corrupt"]
    layers: int = Field(ge=0, le=1024, description="the first `layers` layers' cache writes carry noise")
    sigma: float = Field(0.5, ge=0, le=10, description="noise std as a multiple of the written keys' (values') std")
    seed: int = 0
    from_slot: int = Field(0, ge=0, le=1 << 20, description=(
        "only cache slots from this one on carry noise: a fault that starts deep in the context, which shows in "
        "the late position buckets of ppl_ratio and not in the early ones"))


class TokenCorruptFault(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["token-corrupt"]
    rate: float = Field(ge=0, le=1, description="probability that each emitted token is replaced by another id")
    seed: int = 0


class TTFTDelayFault(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["ttft-delay"]
    delay_ms: float = Field(ge=0, le=60_000, description="sleep before the first token of each generation")


class LogprobShiftFault(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["logprob-shift"]
    nats: float = Field(ge=-50, le=50, description="every prompt log-prob lowered by this much")


Fault = Annotated[WeightNoiseFault | KVCorruptFault | TokenCorruptFault | TTFTDelayFault | LogprobShiftFault,
                  Field(discriminator="kind")]
FAULT_MODELS: dict[str, type[BaseModel]] = {
    "weight-noise": WeightNoiseFault, "kv-corrupt": KVCorruptFault, "token-corrupt": TokenCorruptFault,
    "ttft-delay": TTFTDelayFault, "logprob-shift": LogprobShiftFault,
}
FAULT_KINDS = tuple(FAULT_MODELS)
_FAULT = TypeAdapter(Fault)
# kv-corrupt adds noise to each slot's dequantized value as it is written (kv/base.py DequantizedStore);
# KIVI re-encodes whole groups later and whole-bit TurboQuant stores slots in a rotated domain
KV_CORRUPT_FORMATS = tuple(v for v in KV_CACHE if not v.startswith("kivi-") and v not in ("turbo-2", "turbo-3",
                                                                                            "turbo-4"))


def parse_fault(value: Any, kv_cache: str = "auto") -> Fault:
    """engine_options.fault → its typed drill, or ConfigNotAvailable naming the field at fault."""
    field = "engine_options.fault"

    def refuse(where: str, message: str) -> ConfigNotAvailable:
        return ConfigNotAvailable(where, str(value), "reference", frozenset(), message=f"{where}: {message}")

    if not isinstance(value, dict):
        raise refuse(field, f"expected a mapping such as {{kind: kv-corrupt, layers: 2}}, got {value!r}")
    kind = value.get("kind")
    if kind not in FAULT_KINDS:
        raise refuse(f"{field}.kind", f"unknown fault {kind!r}; {did_you_mean(str(kind), FAULT_KINDS)}")
    try:
        fault = _FAULT.validate_python(value)
    except ValidationError as e:
        error = e.errors()[0]
        where = ".".join(str(part) for part in (field, *error["loc"][1:]))  # loc[0] is the kind
        takes = ", ".join(name for name in FAULT_MODELS[kind].model_fields if name != "kind")
        raise refuse(where, f"{error['msg'][0].lower()}{error['msg'][1:]}; fault '{kind}' takes: {takes}") from None
    if isinstance(fault, KVCorruptFault) and kv_cache not in KV_CORRUPT_FORMATS:
        raise refuse(f"{field}.kind", f"'kv-corrupt' runs on a KV format that encodes each slot on its own as it "
                                      f"is written; kv_cache '{kv_cache}' does not; use one of: "
                                      f"{', '.join(KV_CORRUPT_FORMATS)}")
    return fault
