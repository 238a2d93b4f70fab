"""Device launches of one decode step of an 8B-shaped Llama, counted on the meta device (no GPU):
the fused step (engines/kernels/fused.py) beside the unfused one (CANARY_FUSED_STEP=off: the
same attention and quantize-on-write kernels, every other operator unfused, as the round-3 GPU
review profiled the step), per layer and per step.

    python benchmarks/step_launches.py                      # the table, every captured format
    python benchmarks/step_launches.py --kv fp16 --json     # one format, as JSON

Counts are exact (engines/kernels/launches.py: one per aten operator that does device work and
per Triton kernel), so there are no repeats to take: the two sides are counted in the same run,
and the fused side's logits are checked against the unfused side's elsewhere
(tests/kernels/test_fused_step.py, on the Triton interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FORMATS = ("fp16", "fp8", "kivi-2", "kivi-4", "turbo-2", "turbo-3", "turbo-4")


def llama_8b(layers: int):
    from engines.reference.model import ModelArgs

    return ModelArgs(model_type="llama", vocab_size=128256, dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8,
                     head_dim=128, intermediate_size=14336, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192,
                     tie_embeddings=False, attention_bias=False, rope_scaling={"rope_type": "default"})


def count(kv: str, batch: int, context: int, fused: bool) -> dict:
    from engines.reference.step_plan import plan_decode_step

    old = os.environ.get("CANARY_FUSED_STEP")
    os.environ["CANARY_FUSED_STEP"] = "on" if fused else "off"
    try:
        plan = plan_decode_step(llama_8b(2), kv, batch, context)
    finally:
        if old is None:
            os.environ.pop("CANARY_FUSED_STEP")
        else:
            os.environ["CANARY_FUSED_STEP"] = old
    return {"per_layer": plan.per_layer, "per_step_32_layers": plan.per_layer * 32 + plan.once,
            "once": plan.once, "layer_ops": plan.layer_ops}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    if any(b < 1 for b in args.batch) or args.context < 1:
        ap.error("--batch and --context must be at least 1")
    rows = [{"kv_cache": kv, "batch": b, "fused": count(kv, b, args.context, True),
             "unfused": count(kv, b, args.context, False)} for kv in args.kv for b in args.batch]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"launches per decode step, 8B-shaped Llama, {args.context} cached tokens (meta device)")
    print(f"{'kv_cache':9} {'batch':>5} {'fused/layer':>11} {'unfused/layer':>13} {'fused/step':>10} {'unfused/step':>12}")
    for r in rows:
        f, u = r["fused"], r["unfused"]
        print(f"{r['kv_cache']:9} {r['batch']:5d} {f['per_layer']:11.1f} {u['per_layer']:13.1f} "
              f"{f['per_step_32_layers']:10.0f} {u['per_step_32_layers']:12.0f}")
    worst = max(rows, key=lambda r: r["fused"]["per_layer"])
    print(f"fused layer ({worst['kv_cache']}, batch {worst['batch']}): "
          + ", ".join(f"{k} {v:g}" for k, v in worst["fused"]["layer_ops"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
