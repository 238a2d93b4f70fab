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


def _vocab(model_ref: str) -> dict | None:
    """A model directory's tokenizer.json vocabulary, None where it has no tokenizer.json."""
    import json

    path = resolve_model_path(model_ref) / "tokenizer.json"
    return json.loads(path.read_text())["model"]["vocab"] if path.is_file() else None


def check_draft_tokenizer(target_ref: str, draft_ref: str) -> None:
    """A draft model must share the target's vocabulary token for token (torch-free check)."""
    va, vb = _vocab(target_ref), _vocab(draft_ref)
    if va is None or vb is None:
        raise ModelPathError("speculative.draft_model: both models need a tokenizer.json "
                             "to check they share a tokenizer")
    if va != vb:
        raise ModelPathError(f"speculative.draft_model: '{draft_ref}' has a different tokenizer from the target "
                             f"({len(vb)} vs {len(va)} tokens); a draft must share the target's vocabulary")


CT_FORMATS = ("pack-quantized", "naive-quantized")  # compressed-tensors formats the reference engine reads back


def compressed_tensors_problem(qcfg: dict) -> str | None:
    """Why the reference engine cannot read a compressed-tensors quantization_config back exactly
    (engines/quant/compressed_tensors.py), or None: weight-only int in pack- or naive-quantized,
    strategy tensor, channel or group, no activation or KV quantization, no online transform, no
    sparsity. Torch-free: the door and the loader both ask it."""
    fmt = qcfg.get("format")
    if fmt not in CT_FORMATS:
        return f"compressed-tensors format '{fmt}' (the reference engine reads {' and '.join(CT_FORMATS)})"
    for key, what in (("transform_config", "an online transform (rotations)"), ("sparsity_config", "sparsity"),
                      ("kv_cache_scheme", "a quantized KV cache")):
        if qcfg.get(key):
            return f"{what} in its {key}, which the reference engine does not apply"
    groups = qcfg.get("config_groups") or {}
    if not groups:
        return "no config_groups"
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if group.get("input_activations") or group.get("output_activations"):
            return f"config group '{name}' quantizes activations (the reference engine runs weight-only W4A16, W8A16)"
        if weights.get("type", "int") != "int" or group.get("format", fmt) not in CT_FORMATS:
            return (f"config group '{name}' holds {weights.get('type')} weights in '{group.get('format', fmt)}' "
                    f"(the reference engine reads int weights)")
        if weights.get("strategy") not in ("tensor", "channel", "group"):
            return (f"config group '{name}' has strategy '{weights.get('strategy')}' (the reference engine reads "
                    f"tensor, channel and group)")
        if not isinstance(weights.get("num_bits"), int) or not 1 <= weights["num_bits"] <= 8:
            return f"config group '{name}' has {weights.get('num_bits')}-bit weights"
    return None


def checkpoint_weights(model_ref: str) -> tuple[str | None, str]:
    """The weights axis a checkpoint's quantization_config (config.json) says it holds, and those
    words for a message: (None, "no quantization_config") for dense weights (torch-free).
    llm-compressor writes no method into the config, only into recipe.yaml beside it: a GPTQ
    recipe is gptq-int4, an AWQ one awq-int4, a plain quantization (round to nearest) rtn-int4."""
    import json

    path = resolve_model_path(model_ref)
    qcfg = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    method = qcfg.get("quant_method")
    if not qcfg:
        return None, "no quantization_config (dense weights)"
    if method == "awq":
        gemm = qcfg.get("bits") == 4 and str(qcfg.get("version", "gemm")).lower() == "gemm"
        return ("awq-int4" if gemm else None), f"AutoAWQ {qcfg.get('bits')}-bit {qcfg.get('version', 'gemm')}"
    if method != "compressed-tensors":
        return None, f"quant_method '{method}'"
    problem = compressed_tensors_problem(qcfg)
    if problem:
        return None, problem
    groups = list((qcfg.get("config_groups") or {}).values())
    bits = {(g.get("weights") or {}).get("num_bits") for g in groups}
    recipe = (path / "recipe.yaml").read_text() if (path / "recipe.yaml").is_file() else ""
    how = "GPTQ" if "GPTQModifier" in recipe else "AWQ" if "AWQModifier" in recipe else "round to nearest"
    words = f"compressed-tensors {qcfg.get('format')}, {'/'.join(str(b) for b in sorted(bits, key=str))}-bit, {how}"
    if len(bits) != 1:
        return None, words
    b = int(next(iter(bits)) or 0)
    axis = {4: {"GPTQ": "gptq-int4", "AWQ": "awq-int4"}.get(how, "rtn-int4"), 8: "int8", 3: "rtn-int3",
            2: "rtn-int2"}.get(b)
    return axis, words


def check_checkpoint(model_ref: str, checkpoint_ref: str, weights: str | None) -> None:
    """A config's own checkpoint: the project model's tokenizer, and a weights axis that says what
    its quantization_config holds (torch-free)."""
    import json

    model, ckpt = resolve_model_path(model_ref), resolve_model_path(checkpoint_ref)
    mine_vocab, theirs_vocab = _vocab(model_ref), _vocab(checkpoint_ref)
    if theirs_vocab is None or (mine_vocab is not None and mine_vocab != theirs_vocab):
        raise ModelPathError(f"checkpoint: '{checkpoint_ref}' does not hold the model's tokenizer (tokenizer.json); "
                             "a config's checkpoint must be the project's model, quantized")
    shape = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim")
    mine, theirs = (json.loads((d / "config.json").read_text()) for d in (model, ckpt))
    differ = [k for k in shape if mine.get(k) != theirs.get(k)]
    if differ:
        raise ModelPathError(f"checkpoint: '{checkpoint_ref}' is another model ({differ[0]} {theirs.get(differ[0])} "
                             f"against the model's {mine.get(differ[0])}); a config's checkpoint must be the "
                             "project's model, quantized")
    axis, words = checkpoint_weights(checkpoint_ref)
    if axis is None and words.startswith("no quantization_config"):
        if weights not in ("fp32", "fp16", "bf16"):
            raise ModelPathError(f"weights: '{weights}' contradicts the checkpoint's {words}; use fp32, fp16 or bf16, "
                                 "or drop checkpoint: and let the engine quantize")
        return
    if axis is None:
        raise ModelPathError(f"checkpoint: the reference engine reads weight-only int checkpoints, and this one is "
                             f"{words}; use engine: vllm (served, engine: openai) for it")
    if weights != axis:
        raise ModelPathError(f"weights: '{weights}' contradicts the checkpoint's quantization_config ({words}); "
                             f"use weights: {axis}")


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
