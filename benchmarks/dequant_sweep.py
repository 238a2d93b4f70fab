"""Tile sweep of the W4A16 prefill's dequantize kernel (engines/kernels/_w4a16_triton.py
dequant_kernel) at the 8B shapes, on CUDA: GPU ms per call (CUDA events around 20 calls after
one warm-up call), the bandwidth of its bytes (packed words read, fp16 weight written), and
whether its output equals the torch unpacking exactly. Prints the fastest rows and writes every
row as JSON to the path given.

    python3 benchmarks/dequant_sweep.py OUT.json

It picked the tile engines/kernels/w4a16.py launches on CUDA (benchmarks/results/gpu/h200-run7).
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = ((4096, 14336), (14336, 4096))  # K × N: gate-up's half and down
TILES = [(bk, bn, w) for bk, bn, w in itertools.product((1, 2, 4, 8, 16, 32), (64, 128, 256, 512, 1024), (2, 4, 8))
         if bk * bn <= 16384]


def main(argv: list[str]) -> int:
    import torch
    from engines.kernels import _w4a16_triton as k
    from engines.kernels.w4a16 import triton_cdiv
    from engines.quant import dequantize_awq_gemm, pack_awq_gemm, quantize_groupwise

    if len(argv) != 1:
        print("usage: python3 benchmarks/dequant_sweep.py OUT.json", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: the sweep times GPU kernels"}))
        return 0
    rows = []
    for K, N in SHAPES:
        w = torch.randn(N, K, device="cuda") / K**0.5
        q, s, z = quantize_groupwise(w, 4)
        qw, qz, sc = (t.contiguous() for t in pack_awq_gemm(q, z, s))
        want = dequantize_awq_gemm(qw, qz, sc.float()).T.half()
        out = torch.empty(K, N, dtype=torch.float16, device="cuda")
        for bk, bn, warps in TILES:
            grid = (triton_cdiv(K, bk), triton_cdiv(N, bn))

            call = functools.partial(k.dequant_kernel[grid], qw, qz, sc, out, N, K, GROUP=128, BLOCK_K=bk, BLOCK_N=bn,
                                     num_warps=warps)
            row: dict = {"K": K, "N": N, "block_k": bk, "block_n": bn, "warps": warps}
            try:
                call()
                torch.cuda.synchronize()
                row["equal"] = torch.equal(out, want)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(20):
                    call()
                b.record()
                torch.cuda.synchronize()
                ms = a.elapsed_time(b) / 20
                row.update(ms=round(ms, 4), GBps=round((K * N * 2 + K * N / 2) / ms / 1e6, 1))
            except Exception as e:  # noqa: BLE001 - a tile this GPU cannot run is a row, not the end
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
    rows.sort(key=lambda r: r.get("ms", float("inf")))
    Path(argv[0]).write_text(json.dumps(rows, indent=0) + "\n")
    for r in rows[:10]:
        print(json.dumps(r))
    return 0 if all(r.get("equal", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
