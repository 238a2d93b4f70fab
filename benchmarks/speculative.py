"""Speculative decoding speedup at the measured acceptance rate, next to the expectation
E[tokens per target pass] = (1 − α^(k+1)) / (1 − α) and speedup ≈ that / (k·c + 1), c = draft
cost / target cost (REFERENCE.md §3). Greedy, batch 1, reference engine, CPU. One JSON line.

    .venv/bin/python benchmarks/speculative.py
"""

from __future__ import annotations

import json
import time

import torch

from _common import TARGET, prompts

N_PROMPTS, NEW_TOKENS = 8, 64


def run(spec: dict):
    from engines.protocol import GenerationRequest
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec

    e = ReferenceEngine(TARGET, OptimizationSpec.model_validate({"engine": "reference", "weights": "fp32", "speculative": spec}))
    reqs = [GenerationRequest(str(i), p, NEW_TOKENS) for i, p in enumerate(prompts(N_PROMPTS))]
    e.generate(reqs[:1])
    t = time.perf_counter()
    out = e.generate(reqs)
    return e, out, time.perf_counter() - t


def step_cost(model_engine, draft: bool) -> float:
    """Seconds per single-token decode step of the target (or its draft), measured."""
    from engines.protocol import GenerationRequest

    e = model_engine
    if draft:
        from engines.reference.engine import ReferenceEngine
        from engines.spec import OptimizationSpec
        from engines.zoo import resolve_model_path

        e = ReferenceEngine(str(resolve_model_path("builtin:pydoc-draft")), OptimizationSpec(engine="reference", weights="fp32"))
    g = e.generate([GenerationRequest("c", "os.path", 64)])[0]
    return sum(g.itl_ms) / len(g.itl_ms) / 1000


def main() -> None:
    base, base_out, base_s = run({"method": "off"})
    tokens = sum(len(g.token_ids) for g in base_out)
    c = step_cost(base, draft=True) / step_cost(base, draft=False)
    rows = []
    for spec in ({"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 2},
                 {"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 4},
                 {"method": "ngram", "k": 4, "prompt_lookup_max": 3}):
        _, out, secs = run(spec)
        assert [g.token_ids for g in out] == [g.token_ids for g in base_out], "greedy speculative output must equal plain"
        drafts = sum(g.spec.num_drafts for g in out)
        dtok = sum(g.spec.num_draft_tokens for g in out)
        acc = sum(g.spec.num_accepted_tokens for g in out)
        alpha = acc / dtok if dtok else 0.0
        k = spec["k"]
        expected_tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
        cost = c if spec["method"] == "draft" else 0.0  # prompt lookup costs ~nothing next to a forward pass
        rows.append({
            "method": spec["method"], "k": k, "acceptance_rate": round(alpha, 3),
            "mean_acceptance_length": round(1 + acc / drafts, 3) if drafts else None,
            "expected_tokens_per_pass": round(expected_tokens, 3),
            "expected_speedup": round(expected_tokens / (k * cost + 1), 3),
            "measured_speedup": round(base_s / secs, 3),
        })
    print(json.dumps({"benchmark": "speculative", "device": "cpu", "threads": torch.get_num_threads(),
                      "prompts": N_PROMPTS, "new_tokens": NEW_TOKENS, "plain_tokens_per_s": round(tokens / base_s, 1),
                      "draft_cost_ratio_c": round(c, 3), "configs": rows}))


if __name__ == "__main__":
    main()
