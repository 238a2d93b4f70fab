"""GGUF configs against a real llama.cpp: the built-in model exported to GGUF (the `gguf`
package), quantized to Q8_0 and Q4_K_M by llama.cpp's own quantizer, each served by
`python -m llama_cpp.server` (llama-cpp-python), and scored by `engine: openai` configs.

Run apart (`make test-interop`, which builds llama.cpp once into a wheel cache): the default
`make test` does not collect this folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import yaml
from engines.openai import EndpointError, OpenAIEngine
from engines.protocol import GenerationRequest, RollingRequest, WindowSpec
from engines.reference.engine import ReferenceEngine
from engines.spec import OptimizationSpec
from engines.zoo import resolve_corpus_path

from tests.conftest import ROOT
from tests.interop.conftest import TARGET, require
from tests.loopback import free_port, wait_http

try:
    import llama_cpp  # noqa: F401
except ImportError:
    require(False, "llama-cpp-python is not installed")

SERVED = "builtin:pydoc-target"  # the model id the servers answer to: the canary config's model.path


@pytest.fixture(scope="module")
def servers(ggufs, tmp_path_factory):
    """One llama_cpp.server per file, each serving model id SERVED, 1024 tokens of context."""
    logs = tmp_path_factory.mktemp("llama-logs")
    procs, urls = [], {}
    try:
        for name, path in ggufs.items():
            port = free_port()
            log = str(logs / f"{name}.log")
            proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--model_alias",
                                     SERVED, "--n_ctx", "1024", "--n_threads", "1", "--logits_all", "true",
                                     "--host", "127.0.0.1", "--port", str(port)],
                                    cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
            procs.append(proc)
            wait_http(f"http://127.0.0.1:{port}/v1/models", proc, log, timeout=120)
            urls[name] = f"http://127.0.0.1:{port}"
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


def spec(base: str, weights: str) -> OptimizationSpec:
    return OptimizationSpec(engine="openai", weights=weights, engine_options={"base_url": base + "/v1"})


DOCS = [RollingRequest("join", "os.path.join(a, *p)\n\nJoin two or more pathname components, inserting '/' as needed.",
                       WindowSpec(1024, 1024)),
        RollingRequest("dumps", "json.dumps(obj)\n\nSerialize obj to a JSON formatted str.", WindowSpec(1024, 1024))]


def test_llama_cpp_f32_scores_the_exported_model_as_the_reference_engine_does(servers):
    """Same weights, same tokenizer: llama.cpp's F32 GGUF gives the reference engine's token ids
    and per-token log-probs (the export's rotary re-ordering and tokenizer are right), from the
    second token on: llama-cpp-python's echo gives no log-prob for a prompt's first token."""
    remote = OpenAIEngine(SERVED, spec(servers["f32"], "fp32")).loglikelihood_rolling(DOCS)
    local = ReferenceEngine(str(TARGET), OptimizationSpec(engine="reference", weights="fp32")).loglikelihood_rolling(DOCS)
    for r, loc in zip(remote, local, strict=True):
        assert r.token_ids == loc.token_ids[1:]
        assert len(r.logprobs) == len(r.token_ids)
        worst = max(abs(a - b) for a, b in zip(r.logprobs, loc.logprobs[1:], strict=True))
        print(f"\n{r.doc_id}: {len(r.token_ids)} tokens, largest |log-prob difference| llama.cpp F32 vs reference {worst:.2e}")
        assert worst < 1e-3


def test_a_document_longer_than_one_window_is_refused_naming_the_fix(servers):
    doc = RollingRequest("long", "os.path.join(a, *p) joins pathname components. " * 8, WindowSpec(16, 16))
    with pytest.raises(EndpointError, match=r"raise the suite's perplexity.window"):
        OpenAIEngine(SERVED, spec(servers["f32"], "fp32")).loglikelihood_rolling([doc])


def test_streamed_generation_gives_ttft_and_text(servers):
    [g] = OpenAIEngine(SERVED, spec(servers["q8_0"], "gguf-q8_0")).generate(
        [GenerationRequest("g", "import os\n\nos.path.", 8)])
    assert (g.ttft_ms > 0 and g.completion_tokens is None) or g.completion_tokens > 0
    assert g.text


def test_gguf_configs_in_a_canary_run(servers, tmp_path):
    """`canary run -f` with the F32 GGUF as the baseline and Q8_0 / Q4_K_M as candidates, all on
    llama.cpp. Q8_0 is within 0.5 % of F32; Q4_K_M moves further (on this tiny model RTN int4
    costs about 0.1 %, in either direction: the bound is loose, the figure is printed). The suite
    asks for next-token distributions, which this server cannot give: each config-run says so."""
    lines = resolve_corpus_path("builtin:pydoc-heldout").read_text().splitlines()[:12]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines))
    (tmp_path / "canary.yaml").write_text(yaml.safe_dump({
        "project": "gguf", "model": {"name": "pydoc-target", "path": "builtin:pydoc-target"},
        "configs": [{"name": "f32", "baseline": True, "engine": "openai", "weights": "fp32",
                     "engine_options": {"base_url": servers["f32"] + "/v1"}},
                    {"name": "q8_0", "engine": "openai", "weights": "gguf-q8_0",
                     "engine_options": {"base_url": servers["q8_0"] + "/v1"}},
                    {"name": "q4_k_m", "engine": "openai", "weights": "gguf-q4_k_m",
                     "engine_options": {"base_url": servers["q4_k_m"] + "/v1"}}],
        "suites": [{"name": "s", "corpus": str(tmp_path / "docs.jsonl"), "samples": 12, "seed": 0,
                    "scorers": ["perplexity", "generation"], "perplexity": {"window": 1024, "distribution_samples": 2},
                    "generation": {"prompts": 4, "prompt_words": 8, "max_new_tokens": 8}}]}))
    env = {**os.environ, "CANARY_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}", "CANARY_EXECUTION": "inline",
           "CANARY_URL_ALLOWLIST": "127.0.0.1:*"}
    env.pop("CANARY_BROKER_URL", None)
    r = subprocess.run([sys.executable, "-m", "app.cli", "run", "-f", str(tmp_path / "canary.yaml"), "--json"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert all(c["status"] == "succeeded" for c in out["configs"]), [(c["config"], c["error"]) for c in out["configs"]]
    ratio = {c["config"]: c for c in out["comparisons"] if c["metric"] == "ppl_ratio"}
    q8, q4 = ratio["q8_0"]["estimate"], ratio["q4_k_m"]["estimate"]
    print(f"\nllama.cpp perplexity ratio vs F32 GGUF (12 documents): Q8_0 {q8:.5f}, Q4_K_M {q4:.5f}")
    assert 0.995 < q8 < 1.005 and 0.97 < q4 < 1.1 and q4 != q8, (q8, q4)
    assert ratio["q4_k_m"]["n"] == 12
    figures = out["figures"]
    # llama-cpp-python's server takes text prompts and names top tokens by text: no next-token
    # distributions, said on each config-run, which runs on without them
    assert not [c for c in out["comparisons"] if c["metric"] == "kld_mean"]
    for name in ("f32", "q8_0", "q4_k_m"):
        assert any(n.startswith("no next-token distributions (kld_mean)") for n in figures[name]["notes"]), figures[name]
    assert figures["q4_k_m"]["ttft_ms_p50"] > 0 and figures["q8_0"]["ttft_ms_p50"] > 0
    assert httpx.get(servers["f32"] + "/v1/models").json()["data"][0]["id"] == SERVED
