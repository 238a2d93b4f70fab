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
from tests.http.conftest import serving

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
    yield from serving("--model", "builtin:pydoc-target", "--served-model-name", "pydoc-target")


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


def test_lm_eval_multiple_choice_samples_import_as_items_the_canary_answers_alike(lm_eval_installed, served, tmp_path):
    """The built-in labelled task, written out with `canary tasks builtin`, run by the real lm_eval
    as a multiple_choice task (docs/lm_eval/pydoc_next_word.yaml) with --log_samples, and read back
    with `canary tasks import-lm-eval`: the same items come back, and the canary's labelled scorer
    (the reference engine in-process) answers each one right or wrong exactly as lm-eval's `acc` did."""
    from vocabulary.labelled import builtin_items, parse_items
    from workers.producers.labelled import answer_choices

    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    listed = subprocess.run([sys.executable, "-m", "app.cli", "tasks", "builtin", "pydoc-next-word"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert listed.returncode == 0, listed.stderr
    n = 30
    (tmp_path / "pydoc-next-word.jsonl").write_text("".join(listed.stdout.splitlines(keepends=True)[:n]))
    (tmp_path / "pydoc_next_word.yaml").write_text((ROOT / "docs/lm_eval/pydoc_next_word.yaml").read_text())
    target = resolve_model_path("builtin:pydoc-target")
    # text prompts, which engine-serve tokenizes with the start token as vLLM does for a Llama tokenizer; as token
    # ids (lm-eval's default) they would go without it, as this tokenizer adds none, and short prompts score apart
    model_args = ",".join([
        "model=pydoc-target", f"base_url={served}/v1/completions", "tokenizer_backend=huggingface",
        f"tokenizer={target}", "max_length=258", "num_concurrent=1", "max_retries=1", "tokenized_requests=False"])
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
                        "--include_path", str(tmp_path), "--tasks", "pydoc_next_word", "--log_samples",
                        "--output_path", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, stdin=subprocess.DEVNULL, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (samples,) = list(out.rglob("samples_pydoc_next_word_*.jsonl"))
    items_file = tmp_path / "items.jsonl"
    imported = subprocess.run([sys.executable, "-m", "app.cli", "tasks", "import-lm-eval", str(samples), "-o",
                               str(items_file)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    assert imported.returncode == 0 and f"{n} items from 1 file(s)" in imported.stderr, imported.stderr
    items = parse_items(items_file.read_text().splitlines(), "items.jsonl")
    expected = builtin_items("pydoc-next-word")[:n]
    assert [(i.prompt, i.choices, i.answer) for i in items] == [(e.prompt, e.choices, e.answer) for e in expected]
    assert items[0].key == "pydoc_next_word#0"

    logged = {f"pydoc_next_word#{row['doc_id']}": row for row in map(json.loads, samples.read_text().splitlines())}
    theirs = {key: row["acc"] == 1.0 for key, row in logged.items()}
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec

    engine = ReferenceEngine(str(target), OptimizationSpec(engine="reference", weights="fp32"))
    answered = {record.sample_key: record for record in answer_choices(engine, items, WindowSpec(256, 256))}
    ours = {key: record.correct for key, record in answered.items()}
    # each choice's Σ log p as lm-eval logged it (resps: [[[loglikelihood, is_greedy]] per choice). Its slice of the
    # echoed log-probs starts at its own count of context tokens, one short of the server's (which has the start
    # token), so each of its figures also holds the context's last token: the same for every choice of an item.
    # The choices' differences, what picks the answer, must agree.
    gap = 0.0
    for key, record in answered.items():
        logged_ll = [float(resp[0][0]) for resp in logged[key]["resps"]]
        gap = max(gap, *(abs((a - logged_ll[0]) - (b - record.scores[0])) for a, b in zip(logged_ll, record.scores,
                                                                                         strict=True)))
    print(f"\nlm-eval acc {sum(theirs.values())}/{n}; the canary's labelled scorer {sum(ours.values())}/{n}; "
          f"largest gap between the choices' log-likelihood differences {gap:.2e}")
    assert ours == theirs and gap < 1e-3
