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
RELATIVE = 1e-3  # the issue's bound: max |Δ logit| ÷ max |logit|


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

    from safetensors import safe_open

    qcfg = json.loads((made / recipe / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "pack-quantized"
    assert qcfg["config_groups"]["group_0"]["weights"]["symmetric"] is symmetric
    with safe_open(str(made / recipe / "model.safetensors"), "np") as f:  # zero points where asymmetric
        assert any(k.endswith(".weight_zero_point") for k in f.keys()) is not symmetric
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


def canary(tmp_path, *args: str):
    import sys

    env = {**os.environ, "CANARY_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}", "CANARY_EXECUTION": "inline"}
    env.pop("CANARY_BROKER_URL", None)
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def test_canary_run_takes_each_checkpoint_as_a_config_s_weights(made, tmp_path):
    """`canary run` with the fp32 model as the baseline and llm-compressor's two checkpoints as
    configs of their own (`checkpoint:`, the weights axis their quantization_config holds), through
    a pipe; a weights axis that contradicts the checkpoint is refused in one line, nothing stored."""
    import json

    import yaml

    lines = resolve_corpus_path("builtin:pydoc-heldout").read_text().splitlines()[:12]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines))
    configs = [{"name": "fp32", "baseline": True, "engine": "reference", "weights": "fp32"},
               {"name": "gptq", "engine": "reference", "weights": "gptq-int4", "checkpoint": str(made / "gptq")},
               {"name": "awq", "engine": "reference", "weights": "awq-int4", "checkpoint": str(made / "awq")}]
    suite = {"name": "s", "corpus": str(tmp_path / "docs.jsonl"), "samples": 12, "seed": 0,
             "scorers": ["perplexity", "generation"], "generation": {"prompts": 4, "max_new_tokens": 8}}

    def write(cfgs) -> str:
        path = tmp_path / "canary.yaml"
        path.write_text(yaml.safe_dump({"project": "ckpt", "model": {"name": "pydoc-target",
                                        "path": "builtin:pydoc-target"}, "configs": cfgs, "suites": [suite]}))
        return str(path)

    wrong = canary(tmp_path, "run", "-f", write([*configs[:1], {**configs[1], "weights": "rtn-int4"}]))
    assert wrong.returncode == 2 and len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
    assert "configs[1].weights: 'rtn-int4' contradicts the checkpoint's quantization_config (compressed-tensors " \
           "pack-quantized, 4-bit, GPTQ); use weights: gptq-int4" in wrong.stderr
    if (tmp_path / "c.db").exists():  # nothing stored: no project, no run
        import sqlite3

        with sqlite3.connect(tmp_path / "c.db") as db:
            assert db.execute("select count(*) from runs").fetchone()[0] == 0

    r = canary(tmp_path, "run", "-f", write(configs), "--json")
    assert r.returncode in (0, 1), r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert all(c["status"] == "succeeded" for c in out["configs"]), [(c["config"], c["error"]) for c in out["configs"]]
    ratio = {c["config"]: c["estimate"] for c in out["comparisons"] if c["metric"] == "ppl_ratio"}
    print(f"\nppl ratio against the fp32 model, 12 documents: GPTQ W4A16 {ratio['gptq']:.4f}, "
          f"AWQ W4A16_ASYM {ratio['awq']:.4f}")
    assert ratio["gptq"] != 1.0 and ratio["awq"] != 1.0 and 0.95 < min(ratio.values()) < max(ratio.values()) < 1.5


VLLM_PYTHON = os.environ.get("CANARY_VLLM_PYTHON") or str(Path(ROOT) / ".venv-vllm" / "bin" / "python")

# vLLM's CPU build loads one of its kernel libraries by the CPU's ISA (vllm/platforms/cpu.py
# import_kernels); the one for AVX2-only CPUs has no int4 weight-only GEMM, so a W4A16 checkpoint
# fails at the engine's start ("'_C' object has no attribute 'cpu_gemm_wna16'")
WNA16_PROBE = """
import torch
from vllm.platforms.cpu import CpuPlatform
CpuPlatform.import_kernels()
print(hasattr(torch.ops._C, "cpu_gemm_wna16"), torch.cpu._is_avx512_supported())
"""


def vllm_wna16() -> tuple[bool, str]:
    """(whether this machine's vLLM CPU build has its W4A16 kernel, what the probe printed)."""
    import subprocess

    r = subprocess.run([VLLM_PYTHON, "-c", WNA16_PROBE], capture_output=True, text=True, timeout=300)
    found, avx512 = (r.stdout.split()[-2:] + ["?", "?"])[:2] if r.returncode == 0 else ("?", "?")
    return found == "True", f"cpu_gemm_wna16 {found}, AVX-512 {avx512}" + (f"; probe failed: {r.stderr[-500:]}"
                                                                              if r.returncode else "")


@pytest.mark.parametrize("recipe,weights", [("gptq", "gptq-int4"), ("awq", "awq-int4")])
def test_vllm_serves_each_checkpoint_as_the_reference_engine_reads_it(made, tmp_path, recipe, weights):
    """The same checkpoint served by the real vLLM (its CPU build; its int4 kernel,
    CPUWNA16LinearKernel, computes in bf16 or fp16 only, so bf16 here) and read by the reference
    engine (dequantized to fp16 weights, computed in fp32): the same token ids, and perplexity
    within 1 % (bf16's rounding; measured −0.058 % on GPTQ and −0.011 % on AWQ, whose checkpoint
    carries zero points: W4A16_ASYM)."""
    import json
    import math

    from engines.openai import OpenAIEngine
    from engines.protocol import RollingRequest, WindowSpec
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec

    from tests.loopback import free_port, wait_http

    if not os.path.exists(VLLM_PYTHON):
        pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: `make test-llmcompressor` creates it with test-vllm's")
    found, probed = vllm_wna16()
    if not found and "AVX-512 False" in probed:  # the hardware, not a missing install: nothing to run here
        pytest.skip(f"SKIPPED LOUDLY: vLLM's CPU build has no W4A16 kernel on a CPU without AVX-512 ({probed}); "
                    f"run this test on an AVX-512 machine")
    assert found, f"vLLM's CPU build lacks its W4A16 kernel on an AVX-512 CPU: {probed}"
    port, log = free_port(), str(tmp_path / "vllm.log")
    proc = subprocess.Popen([VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(made / recipe),
                             "--served-model-name", recipe, "--max-model-len", "1024", "--host", "127.0.0.1",
                             "--port", str(port)], cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
                            start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc, log, timeout=600)
        assert "CompressedTensorsWNA16" in Path(log).read_text()  # vLLM's own int4 kernel, not a dequantized copy
        lines = resolve_corpus_path("builtin:pydoc-heldout").read_text().splitlines()[:6]
        docs = [RollingRequest(f"d{i}", json.loads(line)["text"], WindowSpec(256, 256)) for i, line in enumerate(lines)]
        served = OptimizationSpec(engine="openai", weights=weights, engine_options={
            "base_url": f"http://127.0.0.1:{port}/v1", "served_model": recipe, "start_token_id": 0})
        remote = OpenAIEngine("builtin:pydoc-target", served).loglikelihood_rolling(docs)
    finally:
        proc.terminate()
        proc.wait(60)
    local = ReferenceEngine(str(made / recipe), OptimizationSpec(engine="reference", weights=weights,
                                                                 checkpoint=str(made / recipe))).loglikelihood_rolling(docs)
    assert [r.token_ids for r in remote] == [r.token_ids for r in local]
    n = sum(len(r.logprobs) for r in local)
    ppl = [math.exp(-sum(sum(r.logprobs) for r in side) / n) for side in (remote, local)]
    worst = max(abs(a - b) for r, loc in zip(remote, local, strict=True) for a, b in zip(r.logprobs, loc.logprobs,
                                                                                       strict=True))
    print(f"\n{recipe.upper()} checkpoint, {n} tokens: perplexity through vLLM (bf16) {ppl[0]:.4f}, reference engine "
          f"{ppl[1]:.4f} ({ppl[0] / ppl[1] - 1:+.3%}); largest |log-prob difference| {worst:.3f}")
    assert abs(ppl[0] / ppl[1] - 1) < 0.01
