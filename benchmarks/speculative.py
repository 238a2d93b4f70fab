"""Speculative decoding: the realised speedup over plain decoding next to the theory built from
the measured per-position acceptance (docs/reference.md §3), greedy, batch 1, reference engine, CPU.

Theory. A verification pass with a draft yields E = 1 + Σᵢ aᵢ tokens, where aᵢ is the share of
drafts whose first i tokens were all accepted (`accepted_per_position`), and costs 1 + d·c
target-step units (d draft tokens, c = the draft model's step cost over the target's, measured;
c = 0 for n-gram lookup). A pass without a draft (n-gram found no match) yields 1 token at cost 1.
Plain decoding yields 1 token per unit. So

    theory = (drafts·E + no-draft passes) / (drafts·(1 + d̄·c) + no-draft passes)

with passes counted from the engine's per-step delivery stamps. Plain and speculative decoding
alternate over --repeats rounds; the speedup is plain time / speculative time per round. Exits 1
when a speculative config's greedy tokens differ from plain decoding's. One JSON line.

    .venv/bin/python benchmarks/speculative.py --threads 1
"""

from __future__ import annotations

import json
import sys
from functools import reduce

from _common import TARGET, alternate, host, parser, prompts, ratio, setup

SPECS = ({"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 2},
         {"method": "draft", "draft_model": "builtin:pydoc-draft", "k": 4},
         {"method": "ngram", "k": 4, "prompt_lookup_max": 3})


def engine(spec: dict):
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec

    return ReferenceEngine(TARGET, OptimizationSpec.model_validate({"engine": "reference", "weights": "fp32", "speculative": spec}))


def step_cost(path: str) -> float:
    """Seconds per single-token decode step of a model, measured on one 64-token generation."""
    from engines.protocol import GenerationRequest
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec

    e = ReferenceEngine(path, OptimizationSpec(engine="reference", weights="fp32"))
    e.generate([GenerationRequest("w", "import os", 8)])
    g = e.generate([GenerationRequest("c", "os.path", 64)])[0]
    return sum(g.itl_ms) / len(g.itl_ms) / 1000


def theory(outs, c: float) -> dict:
    """The expected speedup from the measured counters (see the module docstring)."""
    from engines.protocol import SpeculativeStats

    stats = reduce(lambda a, b: a + b, (g.spec or SpeculativeStats() for g in outs), SpeculativeStats())
    passes = sum(len(g.itl_ms) for g in outs)  # one delivery per verification (or plain) step
    no_draft = max(passes - stats.num_drafts, 0)
    e = 1 + sum(stats.per_position_rate)
    d = stats.num_draft_tokens / stats.num_drafts if stats.num_drafts else 0.0
    expected = (stats.num_drafts * e + no_draft) / (stats.num_drafts * (1 + d * c) + no_draft) if passes else 1.0
    return {"drafts": stats.num_drafts, "passes_without_draft": no_draft, "per_position_acceptance":
            [round(x, 3) for x in stats.per_position_rate], "tokens_per_draft_pass": round(e, 3),
            "acceptance_rate": round(stats.acceptance_rate or 0.0, 3), "theory_speedup": round(expected, 3)}


def pass_costs(e, reqs, plain_outs) -> dict:
    """Where the time of a speculative pass goes on this device: the mean wall time of a pass with
    a draft (a target pass over the draft + 1 tokens, plus the draft's own steps) and of a pass
    without one, each over the mean plain decode step (from the plain runs' inter-token gaps).
    The theory above charges 1 + d·c and 1; a GPU verifies d + 1 tokens for about the price of
    one, a CPU does not."""
    import statistics

    kinds: list[bool] = []
    with_draft, without = [], []
    for r in reqs:
        kinds.clear()
        [g] = e.generate([r], on_tokens=lambda _rid, _tokens, step: kinds.append(step is not None))
        for gap, drafted in zip(g.itl_ms, kinds[1:], strict=False):  # the first callback is the first token
            (with_draft if drafted else without).append(gap)
    step = statistics.fmean(x for g in plain_outs for x in g.itl_ms)
    return {"plain_step_ms": round(step, 3),
            "pass_with_draft_cost": round(statistics.fmean(with_draft) / step, 3) if with_draft else None,
            "pass_without_draft_cost": round(statistics.fmean(without) / step, 3) if without else None}


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--prompts", type=int, default=8, help="prompts (default 8)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    args = p.parse_args()
    setup(args)
    from engines.protocol import GenerationRequest
    from engines.zoo import resolve_model_path

    reqs = [GenerationRequest(str(i), t, args.new_tokens) for i, t in enumerate(prompts(args.prompts))]
    plain = engine({"method": "off"})

    def run(e):
        return [e.generate([r])[0] for r in reqs]  # batch 1, one prompt per call

    run(plain)
    c = step_cost(str(resolve_model_path("builtin:pydoc-draft"))) / step_cost(TARGET)
    rows, same = [], True
    for spec in SPECS:
        e = engine(spec)
        run(e)  # warm-up
        t = alternate({"speculative": lambda e=e: run(e), "plain": lambda: run(plain)}, args.repeats)
        outs, base = t["speculative"].result, t["plain"].result
        identical = [g.token_ids for g in outs] == [g.token_ids for g in base]
        same &= identical
        th = theory(outs, c if spec["method"] == "draft" else 0.0)
        realised = ratio(t["speculative"], t["plain"])
        rows.append({"method": spec["method"], "k": spec["k"], "identical_tokens": identical, **th, "realised_speedup": realised,
                     "realised_over_theory": round(realised["wall"]["median"] / th["theory_speedup"], 3),
                     **pass_costs(e, reqs, base)})
    print(json.dumps({"benchmark": "speculative", "device": "cpu", **host(), "prompts": args.prompts,
                      "new_tokens": args.new_tokens, "repeats": args.repeats, "order": "alternating",
                      "draft_cost_ratio_c": round(c, 3), "configs": rows}))
    if not same:
        print("greedy speculative output differs from plain decoding: the speeds compare unequal work", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
