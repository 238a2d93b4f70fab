"""lm-evaluation-harness, the real `lm_eval` CLI with its `local-completions` model, scores the
shipped task (docs/lm_eval/pydoc_heldout.yaml, loglikelihood_rolling) through `canary engine-serve`,
and its word and byte perplexity equal the canary's own figures (the reference engine's rolling
log-likelihoods, evals/perplexity.py) to 1e-6 relative — on documents that fit one window, on
documents that span several (lm-eval gives the last window a full context; so does the canary),
and on documents that start with whitespace (lm-eval counts words with re.split(r"\\s+")).

lm-eval's API models keep one position for the generated token and one for context, so
`max_length=M` scores windows of M − 2 tokens: the canary's window W matches max_length W + 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from engines.protocol import RollingRequest, WindowSpec
from engines.zoo import ARTIFACTS, resolve_model_path
from evals.perplexity import DocNLL, corpus_perplexity

from tests.conftest import ROOT
from tests.http.conftest import start_engine_serve

WINDOW = 48


@pytest.fixture(scope="module")
def lm_eval_installed():
    try:
        import lm_eval  # noqa: F401
        import tenacity  # noqa: F401  (lm-eval's API models need it: the `api` extra)
    except ImportError:
        msg = "lm-eval[api] is not installed (pip install -e '.[dev]')"
        if os.environ.get("CI"):
            pytest.fail(f"CI=true: {msg}", pytrace=False)
        pytest.skip(f"SKIPPED LOUDLY: {msg}")


@pytest.fixture(scope="module")
def served():
    proc, base = start_engine_serve("--model", "builtin:pydoc-target", "--served-model-name", "pydoc-target")
    yield base
    proc.terminate()
    proc.wait(10)


def test_lm_eval_local_completions_matches_the_canarys_perplexity(lm_eval_installed, served, tmp_path):
    from transformers import AutoTokenizer

    target = resolve_model_path("builtin:pydoc-target")
    tok = AutoTokenizer.from_pretrained(target)
    docs = [json.loads(line) for line in (ARTIFACTS / "pydoc-heldout.jsonl").read_text().splitlines()]
    n_tokens = {d["doc_id"]: len(tok(d["text"], add_special_tokens=False)["input_ids"]) for d in docs}
    one_window = [d for d in docs if n_tokens[d["doc_id"]] <= WINDOW][:2]
    several = [d for d in docs if n_tokens[d["doc_id"]] > 3 * WINDOW][:3]
    spaced = [d for d in docs if d["text"] != d["text"].lstrip()][:2]  # re.split counts a leading empty word
    picked = one_window + several + spaced
    assert len(picked) == 7
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in picked))
    shipped = (ROOT / "docs/lm_eval/pydoc_heldout.yaml").read_text()
    assert "engines/zoo/artifacts/pydoc-heldout.jsonl" in shipped
    (tmp_path / "pydoc_heldout.yaml").write_text(shipped.replace("engines/zoo/artifacts/pydoc-heldout.jsonl", str(data)))

    model_args = ",".join([
        "model=pydoc-target", f"base_url={served}/v1/completions", "tokenizer_backend=huggingface",
        f"tokenizer={target}", f"max_length={WINDOW + 2}", "num_concurrent=1", "max_retries=1"])
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
                        "--include_path", str(tmp_path), "--tasks", "pydoc_heldout", "--output_path", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, stdin=subprocess.DEVNULL,
                       env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (results,) = list(out.rglob("results_*.json"))
    theirs = json.loads(results.read_text())["results"]["pydoc_heldout"]

    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec

    engine = ReferenceEngine(str(target), OptimizationSpec(engine="reference", weights="fp32"))
    rolled = engine.loglikelihood_rolling([RollingRequest(d["doc_id"], d["text"], WindowSpec(WINDOW, WINDOW))
                                           for d in picked])
    ours = corpus_perplexity([DocNLL.from_result(x) for x in rolled])
    print(f"\nlm-eval word/byte ppl {theirs['word_perplexity,none']:.10g} / {theirs['byte_perplexity,none']:.10g}; "
          f"canary {ours.word_ppl:.10g} / {ours.byte_ppl:.10g}")
    assert ours.word_ppl == pytest.approx(theirs["word_perplexity,none"], rel=1e-6)
    assert ours.byte_ppl == pytest.approx(theirs["byte_perplexity,none"], rel=1e-6)
    assert ours.bits_per_byte == pytest.approx(theirs["bits_per_byte,none"], rel=1e-6)
