"""A config's own checkpoint (`checkpoint:`): its weights axis read from the quantization_config
and refused where the config says otherwise, worked out on hand-written config.json files (the
layout of real ones is checked in tests/llm_compressor, on checkpoints llm-compressor made)."""

import json
import shutil

import pytest
from engines.spec import ConfigNotAvailable, OptimizationSpec, single_axis_ablation
from engines.zoo import checkpoint_weights, resolve_model_path

TARGET = resolve_model_path("builtin:pydoc-target")


def group(bits: int, **extra) -> dict:
    return {"targets": ["Linear"], "weights": {"num_bits": bits, "type": "int", "strategy": "group",
                                               "group_size": 128, "symmetric": True}, **extra}


def checkpoint(tmp_path, qcfg: dict | None, recipe: str = "", name: str = "ckpt"):
    out = tmp_path / name
    shutil.copytree(TARGET, out)
    cfg = json.loads((out / "config.json").read_text())
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(cfg))
    if recipe:
        (out / "recipe.yaml").write_text(recipe)
    return out


def ct(*groups) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {f"group_{i}": g for i, g in enumerate(groups)}}


@pytest.mark.parametrize("qcfg,recipe,axis", [
    (ct(group(4)), "default_stage:\n  GPTQModifier:\n    scheme: W4A16\n", "gptq-int4"),
    (ct(group(4)), "default_stage:\n  AWQModifier:\n    scheme: W4A16_ASYM\n", "awq-int4"),
    (ct(group(4)), "", "rtn-int4"),  # QuantizationModifier alone: round to nearest
    (ct(group(8)), "", "int8"),
    (ct(group(8, input_activations={"num_bits": 8})), "", None),  # W8A8: activations too
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "", "awq-int4"),
    (None, "", None),
])
def test_the_weights_axis_a_checkpoint_holds(tmp_path, qcfg, recipe, axis):
    assert checkpoint_weights(str(checkpoint(tmp_path, qcfg, recipe)))[0] == axis


def test_a_checkpoint_is_refused_at_the_door_where_the_config_says_otherwise(tmp_path):
    from app.services import check_config_fits_model

    gptq = checkpoint(tmp_path, ct(group(4)), "GPTQModifier: {}\n", "gptq")
    spec = {"engine": "reference", "weights": "gptq-int4", "checkpoint": str(gptq)}
    check_config_fits_model(spec, "builtin:pydoc-target", "configs[1]")  # what it holds: accepted
    with pytest.raises(ValueError, match=r"^configs\[1\]\.weights: 'rtn-int4' contradicts the checkpoint's "
                                         r"quantization_config \(compressed-tensors pack-quantized, 4-bit, GPTQ\); "
                                         r"use weights: gptq-int4$"):
        check_config_fits_model({**spec, "weights": "rtn-int4"}, "builtin:pydoc-target", "configs[1]")
    w8a8 = checkpoint(tmp_path, ct(group(8, input_activations={"num_bits": 8})), "", "w8a8")
    with pytest.raises(ValueError, match=r"configs\[1\]\.checkpoint: the reference engine reads weight-only int"):
        check_config_fits_model({**spec, "checkpoint": str(w8a8)}, "builtin:pydoc-target", "configs[1]")
    nvfp4 = checkpoint(tmp_path, {**ct(group(4)), "format": "nvfp4-pack-quantized"}, "", "nvfp4")
    with pytest.raises(ValueError, match=r"configs\[1\]\.checkpoint: the reference engine reads weight-only int"):
        check_config_fits_model({**spec, "weights": "rtn-int4", "checkpoint": str(nvfp4)}, "builtin:pydoc-target",
                                "configs[1]")
    bigger = checkpoint(tmp_path, ct(group(4)), "GPTQModifier: {}\n", "bigger")
    cfg = json.loads((bigger / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 1}))
    with pytest.raises(ValueError, match=r"configs\[1\]\.checkpoint: '.*bigger' is another model "
                                         r"\(num_hidden_layers \d+ against the model's \d+\)"):
        check_config_fits_model({**spec, "checkpoint": str(bigger)}, "builtin:pydoc-target", "configs[1]")
    other = checkpoint(tmp_path, ct(group(4)), "GPTQModifier: {}\n", "other")
    vocab = json.loads((other / "tokenizer.json").read_text())
    vocab["model"]["vocab"] = {f"x{k}": v for k, v in vocab["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match=r"configs\[1\]\.checkpoint: '.*other' does not hold the model's tokenizer"):
        check_config_fits_model({**spec, "checkpoint": str(other)}, "builtin:pydoc-target", "configs[1]")
    # named as the config named it, never by the real path a symlink led to
    (tmp_path / "link").symlink_to(other)
    with pytest.raises(ValueError, match=r"checkpoint: '.*link' does not hold") as e:
        check_config_fits_model({**spec, "checkpoint": str(tmp_path / "link")}, "builtin:pydoc-target", "configs[1]")
    assert "other" not in str(e.value)
    with pytest.raises(ValueError, match=r"configs\[1\]\.checkpoint: .*nowhere. is not a usable path to a model directory"):
        check_config_fits_model({**spec, "checkpoint": str(tmp_path / "nowhere")}, "builtin:pydoc-target",
                                "configs[1]")


def test_gptq_weights_need_a_checkpoint_and_only_the_reference_engine_loads_one():
    with pytest.raises(ConfigNotAvailable, match="weights: gptq-int4 comes from a checkpoint that GPTQ made"):
        OptimizationSpec(engine="reference", weights="gptq-int4").check_available()
    with pytest.raises(ConfigNotAvailable, match="checkpoint: engine 'vllm' does not load a config's own checkpoint"):
        OptimizationSpec(engine="vllm", weights="awq-int4", checkpoint="/m").check_available()
    OptimizationSpec(engine="reference", weights="gptq-int4", checkpoint="/m").check_available()
    assert "checkpoint" not in OptimizationSpec(engine="reference").model_dump()  # old configs' JSON unchanged


def test_a_checkpoint_goes_with_the_weights_axis_when_a_stacked_config_steps_back():
    base = OptimizationSpec(engine="reference", weights="fp32")
    stacked = OptimizationSpec(engine="reference", weights="gptq-int4", checkpoint="/ckpt", kv_cache="int4")
    assert single_axis_ablation(stacked, base, "weights").checkpoint == "/ckpt"
    assert single_axis_ablation(stacked, base, "kv_cache").checkpoint is None
    # another checkpoint is other weights, whatever its label says: never held to the baseline's outputs
    from engines.spec import changed_axes, lossless_against

    dense = OptimizationSpec(engine="reference", weights="fp32", checkpoint="/finetuned")
    assert not lossless_against(dense, base) and changed_axes(dense, base) == ["weights"]
