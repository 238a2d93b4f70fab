"""The tiny model zoo (built by ``python -m engines.zoo.build``), addressed as ``builtin:NAME``.

Torch-free: the service resolves and checks model paths through this module.
"""

from __future__ import annotations

import pathlib

ARTIFACTS = pathlib.Path(__file__).parent / "artifacts"
BUILTIN_MODELS = ("pydoc-target", "pydoc-draft", "pydoc-outlier")
BUILTIN_CORPORA = {"pydoc-heldout": ARTIFACTS / "pydoc-heldout.jsonl"}


# the Hugging Face model_type values engines/reference/model.py builds a decoder for
REFERENCE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


class ModelPathError(ValueError):
    pass


MOE_AWQ = ("weights: the reference engine's AWQ search scales dense MLPs, and this model is a mixture of "
           "experts; use rtn-int4 (every expert quantized, the router kept) or engine: vllm with an AWQ checkpoint")


def check_reference_family(model_ref: str, weights: str | None = None) -> None:
    """The reference engine builds only the families it implements: any other model_type in
    config.json is refused before a worker loads it, naming the supported ones, and so is AWQ on
    a mixture of experts (torch-free)."""
    import json

    cfg = json.loads((resolve_model_path(model_ref) / "config.json").read_text())
    model_type = cfg.get("model_type")
    if weights == "awq-int4" and (cfg.get("num_local_experts") or cfg.get("num_experts")):
        raise ModelPathError(MOE_AWQ)
    if model_type not in REFERENCE_FAMILIES:
        raise ModelPathError(f"engine: the reference engine has no decoder for model_type '{model_type}' "
                             f"(config.json); it runs {', '.join(REFERENCE_FAMILIES)}. Use engine: vllm or "
                             "engine: transformers for this model")


def resolve_model_path(ref: str) -> pathlib.Path:
    """'builtin:pydoc-target' or a local HF directory → an existing directory with config.json."""
    if ref.startswith("builtin:"):
        name = ref.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            raise ModelPathError(f"unknown builtin model '{name}'; choose one of: {', '.join(BUILTIN_MODELS)}")
        path = ARTIFACTS / name
        if not (path / "config.json").is_file():
            raise ModelPathError(f"builtin model '{name}' is not built; run: python -m engines.zoo.build")
        return path
    path = pathlib.Path(ref).expanduser()
    if not path.is_dir():
        raise ModelPathError(f"model directory '{ref}' does not exist; "
                             "give a local HF directory or builtin:pydoc-target")
    if not (path / "config.json").is_file():
        raise ModelPathError(f"model directory '{ref}' has no config.json; it must be a Hugging Face model directory")
    return path


def resolve_corpus_path(ref: str) -> pathlib.Path:
    if ref.startswith("builtin:"):
        name = ref.removeprefix("builtin:")
        if name not in BUILTIN_CORPORA:
            raise ModelPathError(f"unknown builtin corpus '{name}'; choose one of: {', '.join(BUILTIN_CORPORA)}")
        return BUILTIN_CORPORA[name]
    return pathlib.Path(ref).expanduser()


def check_draft_tokenizer(target_ref: str, draft_ref: str) -> None:
    """A draft model must share the target's vocabulary token for token (torch-free check)."""
    import json

    target, draft = resolve_model_path(target_ref), resolve_model_path(draft_ref)
    a, b = target / "tokenizer.json", draft / "tokenizer.json"
    if not (a.is_file() and b.is_file()):
        raise ModelPathError("speculative.draft_model: both models need a tokenizer.json "
                             "to check they share a tokenizer")
    va = json.loads(a.read_text())["model"]["vocab"]
    vb = json.loads(b.read_text())["model"]["vocab"]
    if va != vb:
        raise ModelPathError(f"speculative.draft_model: '{draft_ref}' has a different tokenizer from the target "
                             f"({len(vb)} vs {len(va)} tokens); a draft must share the target's vocabulary")


def check_group_divisible(model_ref: str, group: int = 128) -> None:
    """Group-wise weight quantization needs every linear layer's input width to be a multiple
    of the group (torch-free: read from config.json)."""
    import json

    cfg = json.loads((resolve_model_path(model_ref) / "config.json").read_text())
    heads = cfg.get("num_attention_heads", 1)
    widths = {
        "hidden_size": cfg.get("hidden_size", 0),
        "intermediate_size": cfg.get("intermediate_size", 0),
        "num_attention_heads × head_dim": heads * (cfg.get("head_dim") or cfg.get("hidden_size", 0) // heads),
    }
    for name, width in widths.items():
        if width % group:
            raise ModelPathError(f"weights: {name} = {width} is not a multiple of the quantization group {group}; "
                                 "this model cannot take group-wise int weights")
