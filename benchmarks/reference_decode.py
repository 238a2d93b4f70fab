"""Reference engine CPU decode vs transformers' `generate` on the same tiny model and prompts:
greedy, batch 1, 64 new tokens per prompt. Prints one JSON line.

    .venv/bin/python benchmarks/reference_decode.py
"""

from __future__ import annotations

import json
import time

import torch

from _common import TARGET, median, prompts

N_PROMPTS, NEW_TOKENS = 8, 64


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engines.protocol import GenerationRequest
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec

    torch.manual_seed(0)
    texts = prompts(N_PROMPTS)
    tok = AutoTokenizer.from_pretrained(TARGET)
    hf = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    ref = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32"))
    reqs = [GenerationRequest(str(i), t, NEW_TOKENS) for i, t in enumerate(texts)]
    ref.generate(reqs[:1])  # warm-up
    t = time.perf_counter()
    out = ref.generate(reqs)
    ref_s = time.perf_counter() - t
    ref_tokens = sum(len(g.token_ids) for g in out)

    hf_ttft, hf_tokens, hf_s = [], 0, 0.0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([[tok.eos_token_id] + tok(text, add_special_tokens=False)["input_ids"]])
            t = time.perf_counter()
            hf.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=tok.eos_token_id)
            hf_ttft.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            g = hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
            hf_s += time.perf_counter() - t
            hf_tokens += g.shape[1] - ids.shape[1]
    ref_tps, hf_tps = ref_tokens / ref_s, hf_tokens / hf_s
    print(json.dumps({
        "benchmark": "reference_decode", "device": "cpu", "threads": torch.get_num_threads(),
        "prompts": N_PROMPTS, "new_tokens": NEW_TOKENS,
        "reference_tokens_per_s": round(ref_tps, 1), "transformers_generate_tokens_per_s": round(hf_tps, 1),
        "speedup": round(ref_tps / hf_tps, 2),
        "reference_ttft_ms_p50": round(median([g.ttft_ms for g in out]), 2),
        "transformers_ttft_ms_p50": round(median(hf_ttft), 2),
        "reference_tokens": ref_tokens, "transformers_tokens": hf_tokens,
    }))


if __name__ == "__main__":
    main()
