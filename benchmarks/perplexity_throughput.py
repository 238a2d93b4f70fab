"""Perplexity scoring throughput: the reference engine vs lm-evaluation-harness's `hf` backend on
the same tiny model, the same held-out documents and the same windows (whole documents, each
after the end-of-text token; every document here fits one 1024-token window). Both fp32, same
batch size. The two are timed in alternating order over --repeats rounds; tokens/s by wall time
and by process CPU time, median and min-max, with the thread count and load average. Exits 1
when the two perplexities differ by more than 1e-4 relative. Prints one JSON line.

    .venv/bin/pip install lm-eval       # the optional peer (extra: bench)
    .venv/bin/python benchmarks/perplexity_throughput.py --docs 50 --threads 1
"""

from __future__ import annotations

import json
import math
import sys

from _common import TARGET, alternate, heldout, host, parser, rate, ratio, setup

TOLERANCE = 1e-4


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--docs", type=int, default=200, help="held-out documents scored per call (default 200)")
    p.add_argument("--batch", type=int, default=8, help="batch size of both (default 8)")
    args = p.parse_args()
    setup(args)
    from engines.protocol import RollingRequest, WindowSpec
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    texts = heldout(args.docs)
    ours = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", engine_options={"batch_size": args.batch}))
    reqs = [RollingRequest(str(i), t, WindowSpec(1024, 1024)) for i, t in enumerate(texts)]
    lm = HFLM(pretrained=TARGET, batch_size=args.batch, device="cpu", dtype="float32")
    inst = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=i) for i, t in enumerate(texts)]
    ours.loglikelihood_rolling(reqs[:8])  # warm-up, both
    lm.loglikelihood_rolling(inst[:8], disable_tqdm=True)
    t = alternate({"reference": lambda: ours.loglikelihood_rolling(reqs),
                   "lm_eval_hf": lambda: lm.loglikelihood_rolling(inst, disable_tqdm=True)}, args.repeats)
    res = t["reference"].result
    tokens = sum(len(r.token_ids) for r in res)
    ppl_ours = math.exp(sum(r.nll for r in res) / tokens)
    ppl_theirs = math.exp(-sum(float(x[0] if isinstance(x, tuple) else x) for x in t["lm_eval_hf"].result) / tokens)
    diff = abs(ppl_ours - ppl_theirs) / ppl_theirs
    print(json.dumps({
        "benchmark": "perplexity_throughput", "device": "cpu", **host(), "documents": args.docs, "tokens": tokens,
        "batch_size": args.batch, "repeats": args.repeats, "order": "alternating",
        "reference_tokens_per_s": rate(tokens, t["reference"]), "lm_eval_hf_tokens_per_s": rate(tokens, t["lm_eval_hf"]),
        "speedup": ratio(t["reference"], t["lm_eval_hf"]),
        "reference_token_ppl": round(ppl_ours, 6), "lm_eval_token_ppl": round(ppl_theirs, 6),
        "relative_ppl_difference": diff, "equal": diff <= TOLERANCE,
    }))
    if diff > TOLERANCE:
        print(f"perplexities differ by {diff:.2e} relative (> {TOLERANCE:g}): the figures above compare unequal work",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
