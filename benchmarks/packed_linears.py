"""The tiny target model's linear layers at a decode step's batch, through the plain weights
(F.linear: MKL's GEMM, which repacks each weight on every call) against the same weights packed
once for oneDNN (engines/reference/packed.py, what engine-serve's batched steps use).

One call = every linear of the model (its 24 layer products and the lm_head, as a decode step
runs them, in layer order, so the weights stream through the caches as they do in a step) on
[B, in] activations, for B in --rows (default 1, 8, 32 and a 288-token mixed step). The two sides
alternate over --repeats rounds; reported per B: milliseconds per call (median, min–max) for each
side, the plain side's time over the packed one's per round, and the largest difference between
the two sides' outputs relative to the largest output (the packed side sums in another order).

    .venv/bin/python benchmarks/packed_linears.py [--repeats 5] [--threads 1] [--rows 1,8,32,288]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import TARGET, alternate, host, parser, setup, spread

CALLS = 20  # calls per timed round


def main() -> None:
    p = parser(__doc__, repeats=5)
    p.add_argument("--rows", default="1,8,32,288", help="the activations' rows per call (default 1,8,32,288)")
    args = p.parse_args()
    if not args.threads:
        args.threads = 1  # engine-serve's default on a 2-core machine: every core but one
    setup(args)
    import torch
    import torch.nn.functional as F
    from engines.reference.packed import PackedLinears
    from engines.registry import load_engine
    from engines.spec import OptimizationSpec

    engine = load_engine(TARGET, OptimizationSpec(engine="reference"))
    packed = PackedLinears(engine.model)
    linears = [m for m, _ in packed.modules]
    if not linears:
        raise SystemExit("nothing packed: this torch build has no oneDNN")
    out: dict = {}
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}

            def plain(xs: dict = xs) -> list[torch.Tensor]:
                for _ in range(CALLS):
                    ys = [F.linear(xs[m.in_features], m.weight, m.bias) for m in linears]
                return ys

            def oned(xs: dict = xs) -> list[torch.Tensor]:
                with packed.active():
                    for _ in range(CALLS):
                        ys = [m(xs[m.in_features]) for m in linears]
                return ys

            t = alternate({"plain": plain, "packed": oned}, args.repeats)
            a, b = t["plain"].result, t["packed"].result
            rel = max(((x - y).abs().max() / x.abs().max()).item() for x, y in zip(a, b, strict=True))
            out[str(rows)] = {
                "plain_ms": spread(t["plain"].wall, scale=1000 / CALLS, digits=3),
                "packed_ms": spread(t["packed"].wall, scale=1000 / CALLS, digits=3),
                "plain_over_packed": spread([x / y for x, y in zip(t["plain"].wall, t["packed"].wall, strict=True)],
                                            digits=2),
                "max_relative_difference": float(f"{rel:.2e}"),
                "equal": (rows == 1 and rel == 0.0) or (rows > 1 and rel < 1e-5),
            }
    print(json.dumps({"benchmark": "packed_linears", "linears": len(linears), "calls_per_round": CALLS,
                      "repeats": args.repeats, "rows": out, **host()}))
    raise SystemExit(0 if all(r["equal"] for r in out.values()) else 1)


if __name__ == "__main__":
    main()
