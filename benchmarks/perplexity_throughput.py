"""Perplexity scoring throughput: the reference engine vs lm-evaluation-harness's `hf` backend on
the same tiny model, the same held-out documents and the same windows (whole documents, each
after the end-of-text token; every document here fits one 1024-token window). Both fp32, batch 8.
Prints one JSON line with tokens/s for each and the relative perplexity difference.

    .venv/bin/pip install lm-eval       # the optional peer (extra: bench)
    .venv/bin/python benchmarks/perplexity_throughput.py
"""

from __future__ import annotations

import json
import math
import time

import torch

from _common import TARGET, heldout

N_DOCS, BATCH = 200, 8


def main() -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from engines.protocol import RollingRequest, WindowSpec
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec

    texts = heldout(N_DOCS)
    ours = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", engine_options={"batch_size": BATCH}))
    reqs = [RollingRequest(str(i), t, WindowSpec(1024, 1024)) for i, t in enumerate(texts)]
    ours.loglikelihood_rolling(reqs[:8])  # warm-up
    t = time.perf_counter()
    res = ours.loglikelihood_rolling(reqs)
    ours_s = time.perf_counter() - t
    tokens = sum(len(r.token_ids) for r in res)
    ours_ll = sum(-r.nll for r in res)

    lm = HFLM(pretrained=TARGET, batch_size=BATCH, device="cpu", dtype="float32")
    inst = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=i) for i, t in enumerate(texts)]
    lm.loglikelihood_rolling(inst[:8], disable_tqdm=True)
    t = time.perf_counter()
    theirs = lm.loglikelihood_rolling(inst, disable_tqdm=True)
    theirs_s = time.perf_counter() - t
    theirs_ll = sum(float(x[0] if isinstance(x, tuple) else x) for x in theirs)

    ppl_ours, ppl_theirs = math.exp(-ours_ll / tokens), math.exp(-theirs_ll / tokens)
    print(json.dumps({
        "benchmark": "perplexity_throughput", "device": "cpu", "threads": torch.get_num_threads(),
        "documents": N_DOCS, "tokens": tokens, "batch_size": BATCH,
        "reference_tokens_per_s": round(tokens / ours_s, 1), "lm_eval_hf_tokens_per_s": round(tokens / theirs_s, 1),
        "speedup": round(theirs_s / ours_s, 2),
        "reference_token_ppl": round(ppl_ours, 6), "lm_eval_token_ppl": round(ppl_theirs, 6),
        "relative_ppl_difference": abs(ppl_ours - ppl_theirs) / ppl_theirs,
    }))


if __name__ == "__main__":
    main()
