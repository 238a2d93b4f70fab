"""Checkpoints made by llm-compressor itself, read by the reference engine.

The zoo's target model is quantized by llm-compressor's own `oneshot` (GPTQ W4A16, symmetric;
AWQ W4A16_ASYM, with zero points), calibrated on the zoo corpus and saved compressed
(compressed-tensors `pack-quantized`), in llm-compressor's environment (.venv-llmc: it pins an older
transformers than the project's). That environment also loads each checkpoint back as its
producer does (transformers + compressed-tensors) and writes the logits it gives; the reference
engine must give the same from the same files. Nothing of the layout is written by hand here.

Run apart (`make test-llmcompressor`, which creates .venv-llmc): the default `make test` does not
collect this folder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from engines.reference.model import load_model
from engines.zoo import resolve_corpus_path, resolve_model_path

from tests.conftest import ROOT
from tests.unit.test_reference_layouts import _forward

LLMC_PYTHON = os.environ.get("CANARY_LLMC_PYTHON") or str(Path(ROOT) / ".venv-llmc" / "bin" / "python")
if not os.path.exists(LLMC_PYTHON):
    msg = f"no llm-compressor environment at {LLMC_PYTHON}: `make test-llmcompressor` creates it"
    if os.environ.get("CI"):
        pytest.fail(f"CI=true: {msg}", pytrace=False)
    pytest.skip(f"SKIPPED LOUDLY: {msg}", allow_module_level=True)

TARGET = resolve_model_path("builtin:pydoc-target")
RELATIVE = 1e-3  # the bound: max |Δ logit| ÷ max |logit|


@pytest.fixture(scope="session")
def made(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llmc")
    r = subprocess.run([LLMC_PYTHON, str(Path(__file__).with_name("make_checkpoints.py")), str(TARGET),
                        str(resolve_corpus_path("builtin:pydoc-heldout")), str(out)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "TQDM_DISABLE": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return out


@pytest.mark.parametrize("recipe,symmetric", [("gptq", True), ("awq", False)])
def test_the_reference_engine_reads_llm_compressor_checkpoints_as_their_producer_does(made, recipe, symmetric):
    import json

    qcfg = json.loads((made / recipe / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "pack-quantized"
    assert qcfg["config_groups"]["group_0"]["weights"]["symmetric"] is symmetric
    import torch

    ids = torch.from_numpy(np.load(made / "ids.npy"))
    theirs = np.load(made / f"{recipe}.logits.npy")
    ours = _forward(load_model(made / recipe), ids).numpy()
    dense = _forward(load_model(TARGET), ids).numpy()
    worst = float(np.abs(ours - theirs).max())
    moved = float(np.abs(dense - theirs).max())
    print(f"\n{recipe}: max |Δ logit| reference engine vs llm-compressor's own dequantization {worst:.2e} "
          f"(relative {worst / np.abs(theirs).max():.2e}); the fp32 model's differ from them by {moved:.3f}")
    assert worst <= RELATIVE * np.abs(theirs).max()
    assert moved > 100 * worst  # the checkpoint holds quantized weights: a loader that ignored them would fail
