"""The tiny model zoo: loadable by transformers, GQA, sizes, shared tokenizer, clean split,
and a deterministic build script (smoke-sized here; the full build is ~10 min)."""

import hashlib
import json

import pytest
from engines.zoo import ARTIFACTS, ModelPathError, resolve_model_path
from engines.zoo.corpus import is_heldout, read_jsonl


def test_target_and_draft_load_with_automodel():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:pydoc-target"))
    draft = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:pydoc-draft"))
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert type(target).__name__ == "LlamaForCausalLM"
    assert 3e6 <= n_target <= 10e6 and n_draft < n_target / 3
    assert target.config.num_key_value_heads < target.config.num_attention_heads  # grouped-query attention
    tok_t = AutoTokenizer.from_pretrained(resolve_model_path("builtin:pydoc-target"))
    tok_d = AutoTokenizer.from_pretrained(resolve_model_path("builtin:pydoc-draft"))
    text = "os.path.join(a, *p)  — Join two or more pathname components."
    assert tok_t(text)["input_ids"] == tok_d(text)["input_ids"]
    assert tok_t.decode(tok_t(text)["input_ids"]) == text  # byte-level BPE round-trips


def test_manifest_matches_artifacts():
    manifest = json.loads((ARTIFACTS / "manifest.json").read_text())
    assert manifest["models"]["pydoc-target"]["parameters"] == 5573888
    assert manifest["heldout_documents"] == len(read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl"))


def test_heldout_split_is_by_source_document():
    docs = read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl")
    assert len(docs) >= 500  # enough for a weekly suite of 500
    assert all(is_heldout(d.doc_id) for d in docs)
    # chunks of one source document land on the same side
    assert is_heldout("topic:x#3") == is_heldout("topic:x") == is_heldout("topic:x#0")


def test_unknown_builtin_and_missing_dir(tmp_path):
    with pytest.raises(ModelPathError, match="unknown builtin model"):
        resolve_model_path("builtin:nope")
    with pytest.raises(ModelPathError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"))


@pytest.mark.integration
def test_build_is_deterministic(tmp_path):
    from engines.zoo.build import build

    digests = []
    for out in (tmp_path / "a", tmp_path / "b"):
        manifest = build(out, steps=2, max_docs=24, log=lambda *_: None)
        digests.append(hashlib.sha256((out / "pydoc-target" / "model.safetensors").read_bytes()).hexdigest())
        assert manifest["train_documents"] == 24
    assert digests[0] == digests[1]


def test_int_weights_on_a_ragged_model_are_refused_at_validation(tmp_path):
    import shutil

    from app.services import check_config_fits_model

    model = tmp_path / "ragged"
    shutil.copytree(resolve_model_path("builtin:pydoc-target"), model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] = 700  # down_proj's input: 700 is not a multiple of 128
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"configs\[2\]\.weights: intermediate_size = 700 is not a multiple"):
        check_config_fits_model({"weights": "rtn-int4"}, str(model), "configs[2]")
    check_config_fits_model({"weights": "fp16"}, str(model), "configs[2]")  # 16-bit weights fit any shape


def test_the_outlier_variant_computes_the_same_function_with_outlier_channels():
    """pydoc-outlier (engines/zoo/outliers.py) is pydoc-target rescaled by powers of two: the same
    logits bit for bit, with salient activation channels and key outlier channels."""
    import torch
    from engines.reference.cache import NoCache
    from engines.reference.model import load_model
    from engines.zoo.outliers import KEY_SCALE, SALIENT_CHANNELS, SALIENT_SCALE, add_outliers
    from safetensors.torch import load_file

    target, outlier = resolve_model_path("builtin:pydoc-target"), resolve_model_path("builtin:pydoc-outlier")
    # the committed artifact is what the derivation gives
    derived = add_outliers(load_file(target / "model.safetensors"), json.loads((target / "config.json").read_text()))
    stored = load_file(outlier / "model.safetensors")
    assert set(derived) == set(stored) and all(torch.equal(derived[k], stored[k]) for k in stored)

    ids = torch.tensor([[0, 88, 581, 1933, 14, 1009, 14, 3584, 8, 65, 12, 280, 9, 221, 845, 1129, 1839, 344]])
    slots = torch.arange(ids.shape[1])
    mask = torch.ones(len(slots), len(slots), dtype=torch.bool).tril()[None, None]
    outs, keys, normed = [], [], []
    for path in (target, outlier):
        model = load_model(str(path), torch.float32, "cpu")
        layer0 = model.model.layers[0]
        hooks = [layer0.self_attn.k_proj.register_forward_hook(lambda m, i, o: keys.append(o.detach())),
                 layer0.input_layernorm.register_forward_hook(lambda m, i, o: normed.append(o.detach()))]
        with torch.inference_mode():
            outs.append(model(ids, slots[None], slots, NoCache(), mask))
        for h in hooks:
            h.remove()
    assert torch.equal(outs[0], outs[1])  # power-of-two scales: every product is exact

    def ratio(x):  # max over channels of max |x| ÷ the channels' median
        ch = x[0].abs().amax(0)
        return (ch.max() / ch.median()).item()

    # the norm's output (what q, k, v see) and the keys carry channels tens of times the median
    assert ratio(normed[1]) > 10 * ratio(normed[0]) and ratio(normed[1]) > 20
    assert ratio(keys[1]) > 5 * ratio(keys[0]) and ratio(keys[1]) > 10
    assert (SALIENT_SCALE, KEY_SCALE, SALIENT_CHANNELS) == (64.0, 32.0, 8)  # the README's figures are for these
