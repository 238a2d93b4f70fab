"""Run by llm-compressor's own environment (.venv-llmc, `make test-llmcompressor`), never by the
project's: quantize a zoo model with llm-compressor's `oneshot` and save it as users get it
(compressed-tensors, `save_compressed=True`), then load each saved checkpoint back the way its
producer does (transformers with compressed-tensors: decompressed to dense weights) and write the
logits it gives on fixed token ids, for the reference engine to be checked against.

    python make_checkpoints.py MODEL_DIR CORPUS_JSONL OUT_DIR

OUT_DIR/<recipe>/ is the checkpoint; OUT_DIR/<recipe>.logits.npy its producer's logits [1, T, V]
on OUT_DIR/ids.npy. Recipes: gptq (GPTQModifier, W4A16: symmetric int4, group 128; this release
makes no group indices: its GPTQ takes activation orders "static" and "weight" only) and awq
(AWQModifier, W4A16_ASYM: asymmetric int4 with zero points, group 128), calibrated on the
corpus's first 32 documents."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.awq import AWQModifier
from llmcompressor.modifiers.quantization import GPTQModifier
from transformers import AutoModelForCausalLM, AutoTokenizer

RECIPES = {
    "gptq": lambda: GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
    "awq": lambda: AWQModifier(targets=["Linear"], scheme="W4A16_ASYM", ignore=["lm_head"]),
}


def cpu_only_workaround() -> None:
    """llm-compressor 0.14's AWQ pins its cached activations in page-locked memory before each
    smoothing search (pipelines/cache.py `pin_memory`), which raises "Cannot access accelerator
    device when none is available" on a machine without one. Pinning only speeds copies to an
    accelerator, so without one it is skipped."""
    if not torch.cuda.is_available():
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def main(model_dir: str, corpus: str, out_dir: str) -> None:
    torch.manual_seed(0)
    cpu_only_workaround()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = [json.loads(line)["text"] for line in Path(corpus).read_text().splitlines()[:32]]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("\n\n".join(texts[:3]), return_tensors="pt").input_ids[:, :96]
    np.save(out / "ids.npy", ids.numpy())
    for name, recipe in RECIPES.items():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        oneshot(model=model, tokenizer=tokenizer, dataset=Dataset.from_dict({"text": texts}), recipe=recipe(),
                max_seq_length=256, num_calibration_samples=len(texts))
        model.save_pretrained(out / name, save_compressed=True)
        tokenizer.save_pretrained(out / name)
        del model
        loaded = AutoModelForCausalLM.from_pretrained(out / name, dtype=torch.float32).eval()
        with torch.no_grad():
            np.save(out / f"{name}.logits.npy", loaded(ids).logits.float().numpy())
        print(name, json.dumps(json.loads((out / name / "config.json").read_text())["quantization_config"]))


if __name__ == "__main__":
    main(*sys.argv[1:])
