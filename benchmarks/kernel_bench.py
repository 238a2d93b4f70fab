"""GPU kernel and decode figures, each checked and timed against its peer in the same run.

    python benchmarks/kernel_bench.py [--repeats 5] [--prompt 1024] [--new-tokens 64] [--layers 32]
                                 [--long-context 32768] [--no-hf-static] [--skip ...]
    python benchmarks/kernel_bench.py --device cpu --smoke    # tiny shapes on CPU (Triton interpreter)
    make gpu-report                                      # kernel tests on CUDA + this, a JSON file per section

Run from the repository root (the script puts the root on sys.path itself; no install needed,
and nothing here needs pydantic except the tiny-model section, which says so when it is missing).
On a host without CUDA and without `--device cpu` it prints why it is skipped and exits 0.

Prints ONE JSON object. Every timed figure is measured `--repeats` times (each repeat: the median
of its iterations, CUDA events on CUDA, perf_counter on CPU; the peers of one figure alternate
order between repeats) and reported as {"median", "min", "max", "repeats"} in ms (tok/s for decode).
Bandwidth fractions and bounds divide by the READ bandwidth measured in the same run (decode reads
weights and KV and writes a few KB). Kernel figures are timed with a cold L2: each peer rotates
through copies of its own inputs that together span ≥ 4 × the L2 (benchmarks/_yardstick.py; the
row's "cold_l2" says how many). Each figure carries its target beside it ("target",
"meets_target"; the targets are the round-3 GPU review's (§4.4), docs/benchmarks.md "GPU report";
meets_target is null in --smoke, whose shapes say nothing about the targets).

  - yardstick: a Triton read stream over 2 GiB (the divisor), a 1 GiB device-to-device copy
    timed eagerly, and on CUDA the same copy replayed from a CUDA graph (the divisor before,
    ~35 % low on an H200: kept to show the gap).
  - w4a16: W4A16 GEMV (engines.kernels.w4a16) at batch 1 and batch 16 (and prefills of
    64 to 1024 rows, tiled GEMM vs dequantize + matmul) for K×N 4096×4096,
    4096×14336, 14336×4096 vs torch fp16 matmul (F.linear) on the same shapes; the kernel's
    output is checked against w4a16_reference first.
  - decode_attention: TurboQuant-3, KIVI-2 (128-token fp16 window) and fp8 decode attention at
    8K / 32K / 128K context at batch 1 and 32K at batch 16 (32 query heads over 8 KV heads,
    head_dim 128: Llama-3-8B) vs two peers on an fp16 KV cache of the same shape, torch SDPA and
    the engine's own fp16 grouped kernel; each kernel is checked against its reference first.
  - decode_8b: an 8B-shaped Llama (random weights, --layers layers), --prompt-token prompt, batch
    1, greedy, through the engine's decode loop (engines.reference.decode.Decoder), per config
    (weights × KV cache): TTFT (prefill + first token) and decode tok/s; the fp16 bandwidth bound
    (bytes read per token / read bandwidth); at --long-context, fp16 vs turbo-3 and kivi-2. The
    peer is transformers' own `generate` on the SAME weights (a LlamaForCausalLM of the same
    config holding our model's tensors), eager with its default dynamic cache and with
    cache_implementation="static"; greedy tokens and prefill top-1 of ours vs theirs are compared
    (fp16 numerics may part them after some tokens: the first divergence is reported).
  - tiny_model: the built-in model (builtin:pydoc-target) through ReferenceEngine, fp16 and
    rtn-int4 weights, on CUDA and on CPU in the same run: TTFT and decode tok/s.

Exit status: 1 when a kernel's output differs from its torch reference beyond the stated
tolerance (the JSON is printed first), else 0. Agreement with transformers is reported, not
enforced (random fp16 weights leave near-ties that rounding can flip).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # as benchmarks/_common.py: the scripts run from a checkout, uninstalled

sys.path.insert(0, str(ROOT / "benchmarks"))  # its siblings, however it is loaded (runpy, importlib)
from _yardstick import clones, cold_sets, copy_bandwidth, graph_copy_bandwidth, l2_bytes, read_bandwidth  # noqa: E402

CONFIGS_1K = (("fp16", "fp16"), ("fp16", "fp8"), ("fp16", "kivi-2"), ("fp16", "turbo-3"),
              ("rtn-int4", "fp16"), ("rtn-int4", "turbo-3"))
CONFIGS_LONG = (("fp16", "fp16"), ("fp16", "fp8"), ("fp16", "turbo-3"), ("fp16", "kivi-2"))
SECTIONS = ("w4a16", "attention", "decode", "tiny")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks/kernel_bench.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring (top of this file) for every figure and target.")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --smoke: correctness on the Triton interpreter)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 1 repeat: proves the script and its checks, measures nothing")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per timed figure (default 5; 1 with --smoke)")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations per repeat of a kernel figure")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens of the 8B-shaped decode")
    ap.add_argument("--new-tokens", type=int, default=None, help="decode steps per 8B-shaped run (default 64; 4 with --smoke)")
    ap.add_argument("--layers", type=int, default=32, help="layers of the 8B-shaped model")
    ap.add_argument("--long-context", type=int, default=32768, help="context of the long decode runs (0: skip them)")
    ap.add_argument("--long-kv", nargs="*", default=[], help="KV formats of the long-context runs (default: all of CONFIGS_LONG)")
    ap.add_argument("--prefill-rows", type=int, nargs="*", default=None,
                    help=f"rows of the W4A16 prefill figures (default {' '.join(map(str, PREFILL_ROWS))})")
    ap.add_argument("--configs", nargs="*", default=[],
                    help="the 1K decode configs to run, as weights/kv (e.g. fp16/fp16 rtn-int4/fp16; none: only the long-context "
                         "rows; default: all of CONFIGS_1K)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers generate peer")
    ap.add_argument("--no-hf-static", action="store_true", help="skip transformers generate with cache_implementation='static'")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="decode steps profiled after each 8B-shaped config's runs (torch.profiler: GPU time by kernel)")
    ap.add_argument("--attention-sweep", type=int, nargs="*", default=[],
                    help="contexts at which each decode-attention kernel is also timed at every launch shape (tuning_sweep)")
    ap.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="sections to leave out")
    ap.add_argument("--l2-bytes", type=int, default=None,
                    help="the L2 size that cold-L2 timings rotate input copies against (default: the device's; 1 MiB on CPU)")
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 5
    if args.new_tokens is None:
        args.new_tokens = 4 if args.smoke else 64
    if args.smoke:
        args.iters = 1
    known = ["/".join(c) for c in CONFIGS_1K] + ["none"]
    bad = [c for c in args.configs if c not in known]
    if bad:
        ap.error(f"--configs: {', '.join(bad)} not among {' '.join(known)}")
    if any(m < 1 for m in args.prefill_rows or ()):
        ap.error("--prefill-rows: every count must be at least 1")
    return args


def progress(msg: str) -> None:
    """A progress line on stderr, flushed: a device call that is cut off still shows how far it got."""
    print(f"[kernels {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- timing -----------------------------------------------------------------------------------------
class Clock:
    """Per-call milliseconds. On CUDA a kernel's figure is GPU time: `iters` calls captured in one
    CUDA graph and replayed, timed by events around the replay, so host dispatch (Python, the
    Triton launcher, the autotuner's lookup) is not in it; host dispatch is measured apart
    (`host_calls`). Where capture fails the figure falls back to events around each eager call
    and `self.fallbacks` says so. Elsewhere: perf_counter."""

    def __init__(self, device: str, warmup: int = 2):
        import torch

        self.torch = torch
        self.cuda = device.startswith("cuda")
        self.warmup = warmup
        self.fallbacks: list[str] = []

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def time_calls(self, fn, iters: int) -> float:
        """GPU ms per call of fn (after the clock's warm-up calls, which also autotune). fn may be
        a list of calls on different copies of the same inputs (_yardstick.cold_sets): the timed
        calls rotate through them, so that with enough copies each call reads its bytes from
        memory, not from the L2 the call before it filled."""
        fns = fn if isinstance(fn, list) else [fn]
        for _ in range(self.warmup):
            for f in fns:
                f()
        self.sync()
        if self.cuda:
            try:
                return self._graph_ms(fns, iters)
            except Exception as e:  # noqa: BLE001 - a call that cannot be captured is timed eagerly
                self.fallbacks.append(f"{getattr(fns[0], '__name__', fns[0])}: {type(e).__name__}: {e}"[:200])
                self.sync()
            return self._event_ms(fns, iters)
        return self.host_calls(fns, iters, sync=False)

    def _graph_ms(self, fns: list, iters: int) -> float:
        torch = self.torch
        iters = -(-max(iters, len(fns)) // len(fns)) * len(fns)  # whole rounds: no copy read twice in a row's L2
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in fns:
                f()  # warm on the capture stream
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(iters):
                fns[i % len(fns)]()
        graph.replay()  # first replay uploads the graph
        self.sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        self.sync()
        del graph
        return start.elapsed_time(end) / iters

    def _event_ms(self, fns: list, iters: int) -> float:
        ev = [(self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for i, (s, e) in enumerate(ev):
            s.record()
            fns[i % len(fns)]()
            e.record()
        self.sync()
        return statistics.median(s.elapsed_time(e) for s, e in ev)

    def host_calls(self, fn, iters: int, sync: bool = True) -> float:
        """Median host ms of one call of fn (eager; on CUDA the launch cost the host pays, since
        the GPU is not waited for inside the loop); a list of calls rotates."""
        fns = fn if isinstance(fn, list) else [fn]
        times = []
        for i in range(iters):
            t = time.perf_counter()
            fns[i % len(fns)]()
            times.append((time.perf_counter() - t) * 1000)
        if sync:
            self.sync()
        return statistics.median(times)


def spread(xs: list[float], nd: int = 4) -> dict:
    return {"median": round(statistics.median(xs), nd), "min": round(min(xs), nd), "max": round(max(xs), nd), "repeats": len(xs)}


def measure(clock: Clock, fns: dict, iters: int, repeats: int) -> dict[str, dict]:
    """Each fn timed `repeats` times (median of `iters` calls each), the order rotating between
    repeats so that no peer always runs first → {name: spread of the per-repeat medians}."""
    names = list(fns)
    got: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names):] + names[: r % len(names)]:
            got[n].append(clock.time_calls(fns[n], iters))
    out = {n: spread(v) for n, v in got.items()}
    if clock.cuda:  # host dispatch apart from the GPU time above
        for n in names:
            out[n]["host_dispatch_ms"] = round(clock.host_calls(fns[n], iters), 4)
    return out


def check(got, want, rtol: float, atol: float) -> dict:
    """Kernel output vs its torch reference: max abs error and whether it is within
    atol + rtol · max|reference| (one tolerance per tensor)."""
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    tol = atol + rtol * scale
    return {"max_abs_error": float(f"{err:.3g}"), "reference_max_abs": float(f"{scale:.3g}"),
            "tolerance": float(f"{tol:.3g}"), "equal": bool(err <= tol)}


def verdict(value, ok: bool, target: str, smoke: bool) -> dict:
    return {"value": value, "target": target, "meets_target": None if smoke else bool(ok)}


# -- W4A16 ------------------------------------------------------------------------------------------
def w4a16_section(clock: Clock, device: str, args, peak_gbps: float, shapes=None, prefill_rows=None) -> tuple[list, list]:
    """W4A16 at batch 1 and 16 (and prefill rows) on each K × N of `shapes`; prefill_rows=() runs none."""
    import torch
    import torch.nn.functional as F
    from engines.kernels.w4a16 import w4a16_reference, w4a16_triton
    from engines.quant import pack_awq_gemm, quantize_groupwise

    shapes = shapes or (((128, 64),) if args.smoke else ((4096, 4096), (4096, 14336), (14336, 4096)))
    batches = (1, 16)
    rows, checks = [], []
    g = torch.Generator(device="cpu").manual_seed(0)
    for K, N in shapes:
        w = (torch.randn(N, K, generator=g) / K**0.5).to(device)
        q, s, z = quantize_groupwise(w, 4)
        qw, qz, sc = pack_awq_gemm(q, z, s)
        w16 = w.half()  # [N, K], as nn.Linear holds it
        del w, q, s, z
        for M in batches:
            x = torch.randn(M, K, generator=g).to(device=device, dtype=torch.float16)
            name = f"w4a16 {K}x{N} batch {M}"
            got, want = w4a16_triton(x, qw, qz, sc), w4a16_reference(x, qw, qz, sc)
            c = {"check": name, **check(got, want, rtol=1e-2, atol=1e-3)}
            checks.append(c)
            # cold L2: each peer rotates through copies of its own inputs (_yardstick.cold_sets)
            moved = qw.nbytes + qz.nbytes + sc.nbytes + x.nbytes + M * N * 2
            moved16 = w16.nbytes + x.nbytes + M * N * 2
            sets4 = clones((x, qw, qz, sc), cold_sets(moved, args.l2_bytes))
            sets16 = clones((x, w16), cold_sets(moved16, args.l2_bytes))
            # w4a16 takes the tensor-core GEMV on CUDA (gemv="auto"); the CUDA-core GEMV before it is a peer
            fns = {"w4a16": [lambda a=a: w4a16_triton(*a) for a in sets4],
                   "w4a16_simt": [lambda a=a: w4a16_triton(*a, gemv="simt") for a in sets4],
                   "fp16": [lambda a=a: F.linear(*a) for a in sets16]}
            tiny = tinygemm_peer(w16, x, args.l2_bytes) if device.startswith("cuda") and not args.smoke else None
            if tiny and "fns" in tiny:
                fns["tinygemm"] = tiny.pop("fns")
            t = measure(clock, fns, args.iters, args.repeats)
            bw = moved / (t["w4a16"]["median"] / 1000) / 1e9 / peak_gbps
            bw16 = moved16 / (t["fp16"]["median"] / 1000) / 1e9 / peak_gbps
            speedup = t["fp16"]["median"] / t["w4a16"]["median"]
            simt = w4a16_triton(x, qw, qz, sc, gemv="simt")
            checks.append({"check": f"{name} (simt GEMV)", **check(simt, want, rtol=1e-2, atol=1e-3)})
            row = {"K": K, "N": N, "batch": M, "equal_to_reference": c["equal"], "w4a16_ms": t["w4a16"], "torch_fp16_ms": t["fp16"],
                   "w4a16_simt_ms": t["w4a16_simt"],
                   "speedup_vs_simt_gemv": round(t["w4a16_simt"]["median"] / t["w4a16"]["median"], 2),
                   "w4a16_bytes": moved, "torch_fp16_bytes": moved16, "torch_fp16_bandwidth_fraction": round(bw16, 3),
                   "cold_l2": {"l2_bytes": args.l2_bytes, "w4a16_sets": len(sets4), "fp16_sets": len(sets16)}}
            if tiny is not None:
                row["tinygemm_int4"] = {**tiny, **({"ms": t["tinygemm"],
                                                     "w4a16_speedup": round(t["tinygemm"]["median"] / t["w4a16"]["median"], 2)}
                                                    if "tinygemm" in t else {})}
            if M == 1:
                row["w4a16_bandwidth_fraction"] = verdict(round(bw, 3), bw >= 0.5, ">= 0.5 of read bandwidth", args.smoke)
                row["speedup_vs_fp16"] = verdict(round(speedup, 2), speedup >= 2.0, ">= 2x torch fp16 matmul (cold L2)", args.smoke)
            else:
                row["w4a16_bandwidth_fraction"] = round(bw, 3)
                row["speedup_vs_fp16"] = verdict(round(speedup, 2), speedup >= 1.5, ">= 1.5x torch fp16 matmul (cold L2)", args.smoke)
            rows.append(row)
            del sets4, sets16
        rows_m = prefill_rows if prefill_rows is not None else (32,) if args.smoke else (args.prefill_rows or PREFILL_ROWS)
        for M in rows_m:
            rows.append(w4a16_prefill_row(clock, args, qw, qz, sc, w16, M, g, device, checks))
        _free(device)
    return rows, checks


PREFILL_ROWS = (24, 64, 256, 1024)  # prompt rows through one int4 linear (the dequantize path from 17)


def w4a16_prefill_row(clock: Clock, args, qw, qz, sc, w16, M: int, g, device: str, checks: list) -> dict:
    """A prefill of M rows through one int4 layer both ways the kernel can take it: the tiled
    Triton GEMM, and dequantize-once then torch's matmul (the 'auto' path from DEQUANT_MIN_M
    rows), beside fp16's matmul on the same shape; each output checked against the reference."""
    import torch
    import torch.nn.functional as F
    from engines.kernels.w4a16 import DEQUANT_MIN_M, GEMV_MAX_M, w4a16_reference, w4a16_triton

    K, N = w16.shape[1], w16.shape[0]
    x = torch.randn(M, K, generator=g).to(device=device, dtype=torch.float16)
    want = w4a16_reference(x, qw, qz, sc)
    fns = {}
    for path in ("tiled", "dequant"):
        c = {"check": f"w4a16 {K}x{N} prefill {M} rows, {path}",
             **check(w4a16_triton(x, qw, qz, sc, prefill=path), want, rtol=1e-2, atol=1e-3)}
        checks.append(c)
        fns[path] = lambda x=x, path=path: w4a16_triton(x, qw, qz, sc, prefill=path)
    fns["fp16"] = lambda x=x: F.linear(x, w16)
    t = measure(clock, fns, args.iters, args.repeats)
    best = min(("tiled", "dequant"), key=lambda p: t[p]["median"])
    return {"K": K, "N": N, "batch": M, "prefill": True, "tiled_ms": t["tiled"], "dequant_matmul_ms": t["dequant"],
            "torch_fp16_ms": t["fp16"], "faster_path": best, "auto_path": "gemv" if M <= GEMV_MAX_M else "dequant" if M >= DEQUANT_MIN_M else "tiled",
            "dequant_speedup_vs_tiled": round(t["tiled"]["median"] / t["dequant"]["median"], 2),
            "best_vs_fp16": round(t["fp16"]["median"] / t[best]["median"], 2)}


def tinygemm_peer(w16, x, l2_bytes: int) -> dict:
    """torch's own int4 GEMM (tinygemm, aten._weight_int4pack_mm) on the same fp16 weights,
    quantized its way (asymmetric, groups of 128, (q − 8)·scale + zero, bf16 activations), as a
    speed peer. Its output is checked against x · its own dequantized weights. → {"fns": calls
    on cold copies of its weights (cold_sets), "equal_to_its_dequantized": …} or {"error": …}
    where this torch build lacks it."""
    import torch

    try:
        N, K, G = w16.shape[0], w16.shape[1], 128
        w = w16.float().reshape(N, K // G, G)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo).clamp(min=1e-6) / 15)
        zero = lo + scale * 8
        q = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(N, K)
        packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
        sz = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        xb = x.to(torch.bfloat16)

        def fn():
            return torch.ops.aten._weight_int4pack_mm(xb, packed, G, sz)

        deq = ((q.reshape(N, K // G, G).float() - 8) * sz.transpose(0, 1)[..., 0:1].float()
               + sz.transpose(0, 1)[..., 1:2].float()).reshape(N, K)
        c = check(fn(), xb.float() @ deq.T, rtol=2e-2, atol=1e-2)
        sets = clones((xb, packed, sz), cold_sets(packed.nbytes + sz.nbytes + xb.nbytes, l2_bytes))
        fns = [lambda a=a: torch.ops.aten._weight_int4pack_mm(a[0], a[1], G, a[2]) for a in sets]
        return {"fns": fns, "sets": len(sets), "equal_to_its_dequantized": c["equal"], "max_abs_error": c["max_abs_error"]}
    except Exception as e:  # noqa: BLE001 - the peer is missing on this build: said in the row
        return {"error": f"{type(e).__name__}: {e}"[:300]}


# -- decode attention -------------------------------------------------------------------------------
# (context, batch) → each compressed format's target speedup over SDPA on fp16 KV, cold L2
# (the round-3 GPU review, §4.4: the bytes model's ceiling and the instruction floor; 8K: none slower)
ATTN_TARGETS = {(8192, 1): {"turbo3": 1.0, "kivi2": 1.0, "fp8": 1.0},
                (32768, 1): {"turbo3": 1.3, "kivi2": 1.5, "fp8": 1.6},
                (131072, 1): {"turbo3": 1.5, "kivi2": 1.8, "fp8": 1.6},
                (32768, 16): {"turbo3": 2.0, "kivi2": 1.5, "fp8": 1.6}}
ATTN_POINTS = ((8192, 1), (32768, 1), (131072, 1), (32768, 16))  # (context, batch)


def attention_section(clock: Clock, device: str, args, peak_gbps: float, points=None) -> tuple[list, list]:
    points = points or (((64, 1), (64, 2)) if args.smoke else ATTN_POINTS)
    rows, checks = [], []
    for S, B in points:
        row, c = attention_point(clock, device, args, S, peak_gbps, batch=B)
        rows.append(row)
        checks += c
        _free(device)
    return rows, checks


def attention_point(clock: Clock, device: str, args, S: int, peak_gbps: float, batch: int = 1):
    """Decode attention at context S for `batch` sequences: SDPA on fp16 KV and the engine's own
    fp16 grouped kernel (the path an fp16 cache's decode step takes) as the two peers, and the
    fp8, TurboQuant-3 and KIVI-2 kernels, each checked against its torch reference first. Each is
    timed over copies of its own inputs (cold_sets: together ≥ 4 × L2), so no call reads bytes
    the call before it left in L2."""
    import torch
    import torch.nn.functional as F
    from engines.kernels import fp8_kv, kivi_kv, turbo_kv
    from engines.kernels.decode import float_decode_attention

    B = batch
    H, Hkv, D = (2, 1, 32) if args.smoke else (32, 8, 128)
    g = torch.Generator(device="cpu").manual_seed(S + B)
    q = torch.randn(B, H, D, generator=g).to(device=device, dtype=torch.float16)
    k16 = torch.randn(B, Hkv, S, D, generator=g).to(device=device, dtype=torch.float16)
    v16 = torch.randn(B, Hkv, S, D, generator=g).to(device=device, dtype=torch.float16)
    lengths = torch.full((B,), S, device=device)
    inputs, kernels, refs, nbytes = {}, {}, {}, {}

    inputs["sdpa_fp16"] = (q, k16, v16)
    kernels["sdpa_fp16"] = lambda q, k, v, **kw: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    inputs["grouped_fp16"] = (q, k16, v16, lengths)
    kernels["grouped_fp16"] = lambda q, k, v, n, **kw: float_decode_attention(q, k, v, n, **kw)
    refs["grouped_fp16"] = lambda: F.scaled_dot_product_attention(q[:, :, None], k16, v16, enable_gqa=True)[:, :, 0]
    nbytes["sdpa_fp16"] = nbytes["grouped_fp16"] = k16.nbytes + v16.nbytes

    # TurboQuant 3-bit: a nibble per channel (8 to a word, read by byte permutes) + a norm per vector
    kc, kn = turbo_kv.quantize_on_write(k16.reshape(-1, D), 3)
    vc, vn = turbo_kv.quantize_on_write(v16.reshape(-1, D), 3)
    kc, vc = kc.reshape(B, Hkv, S, -1), vc.reshape(B, Hkv, S, -1)
    kn, vn = kn.reshape(B, Hkv, S), vn.reshape(B, Hkv, S)
    inputs["turbo3"] = (q, kc, kn, vc, vn, lengths)
    kernels["turbo3"] = lambda *a, **kw: turbo_kv.decode_attention(*a, 3, **kw)
    refs["turbo3"] = lambda: turbo_kv.decode_attention_reference(q, kc, kn, vc, vn, lengths, 3)
    nbytes["turbo3"] = kc.nbytes + vc.nbytes + kn.nbytes + vn.nbytes

    # KIVI 2-bit: everything but the last 128 tokens compressed (the fp16 window read in full precision)
    kq = [t.reshape(B, Hkv, -1, t.shape[-1]) for t in kivi_kv.quantize_keys(k16.reshape(-1, D), 2)]
    vq = [t.reshape(B, Hkv, -1, t.shape[-1]) for t in kivi_kv.quantize_values(v16.reshape(-1, D), 2)]
    window = min(128, S // 2)
    nk = torch.full((B,), S - window, device=device)
    inputs["kivi2"] = (q, k16, v16, *kq, *vq, lengths, nk, nk)
    kernels["kivi2"] = lambda *a, **kw: kivi_kv.decode_attention(*a, 2, **kw)
    refs["kivi2"] = lambda: kivi_kv.decode_attention_reference(q, k16, v16, *kq, *vq, lengths, nk, nk, 2)
    nbytes["kivi2"] = sum(t.nbytes for t in kq + vq) * (S - window) // S + 2 * B * Hkv * window * D * 2

    k8, v8 = fp8_kv.quantize_on_write(k16), fp8_kv.quantize_on_write(v16)
    inputs["fp8"] = (q, k8, v8, lengths)
    kernels["fp8"] = lambda *a, **kw: fp8_kv.decode_attention(*a, **kw)
    refs["fp8"] = lambda: fp8_kv.decode_attention_reference(q, k8, v8, lengths)
    nbytes["fp8"] = k8.nbytes + v8.nbytes

    checks = []
    for name in refs:  # correctness on the same inputs, before any timing
        c = {"check": f"{name} decode attention S={S} B={B}", **check(kernels[name](*inputs[name]), refs[name](), rtol=1e-2, atol=1e-3)}
        checks.append(c)
        _free(device)
    sets = {}
    for name, args_ in inputs.items():
        # every tensor of a set is copied, KIVI's fp16 cache too (its kernel reads only the
        # window's 128 slots of it, which nbytes counts)
        n = cold_sets(nbytes[name], args.l2_bytes)
        sets[name] = clones(args_, n) if n > 1 else [args_]
    fns = {name: [lambda a=a, k=kernels[name]: k(*a) for a in sets[name]] for name in kernels}
    t = measure(clock, fns, args.iters, args.repeats)
    sweep = tuning_sweep(clock, {n: (lambda n=n, **kw: kernels[n](*inputs[n], **kw)) for n in ("turbo3", "kivi2", "fp8")},
                         refs, S, B * Hkv, args) if S in args.attention_sweep and B == 1 else None

    def fraction(name):
        return round(nbytes[name] / (t[name]["median"] / 1000) / 1e9 / peak_gbps, 3)

    targets = ATTN_TARGETS.get((S, B), {})
    row = {"context": S, "batch": B, "heads": H, "kv_heads": Hkv, "head_dim": D,
           "cold_l2": {"l2_bytes": args.l2_bytes, "sets": {n: len(v) for n, v in sets.items()}},
           "sdpa_fp16_ms": t["sdpa_fp16"], "sdpa_fp16_bytes": nbytes["sdpa_fp16"], "sdpa_fp16_bandwidth_fraction": fraction("sdpa_fp16"),
           "grouped_fp16": {"equal_to_reference": checks[0]["equal"], "ms": t["grouped_fp16"], "bandwidth_fraction": fraction("grouped_fp16"),
                            "speedup_vs_sdpa_fp16": round(t["sdpa_fp16"]["median"] / t["grouped_fp16"]["median"], 2)}}
    for name, c in zip(refs, checks, strict=True):
        if name == "grouped_fp16":
            continue
        sp = t["sdpa_fp16"]["median"] / t[name]["median"]
        sp_grouped = t["grouped_fp16"]["median"] / t[name]["median"]
        want = targets.get(name)
        row[name] = {"equal_to_reference": c["equal"], "ms": t[name], "bytes": nbytes[name], "bandwidth_fraction": fraction(name),
                     "speedup_vs_grouped_fp16": round(sp_grouped, 2),
                     "speedup_vs_sdpa_fp16": (verdict(round(sp, 2), sp >= want, f">= {want:g}x SDPA on fp16 KV (cold L2)", args.smoke)
                                              if want else round(sp, 2))}
        if sweep:
            row[name]["tuning_sweep"] = sweep[name]
    return row, checks


SWEEP_TILES = ((32, 4, 1), (32, 4, 2), (64, 4, 1), (64, 4, 2), (64, 8, 1), (64, 8, 2), (128, 4, 2), (128, 8, 2))
SWEEP_PROGRAMS_PER_SM = (1, 2, 4)


def tuning_sweep(clock: Clock, kernels: dict, refs: dict, S: int, rows: int, args) -> dict:
    """Each format's kernel at every (BLOCK_S, warps, stages) of SWEEP_TILES and split-K chunk
    count (about 1, 2 or 4 programs per SM over `rows` = B·Hkv), one timing each (GPU ms per call,
    --iters graph-replayed calls): the launch shape to choose. A shape that fails to compile or
    launch (shared memory, registers) is a row with its error; each row says whether its output
    equals the reference."""
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count if clock.cuda else 4
    out: dict = {}
    for name, kernel in kernels.items():
        found = []
        want = refs[name]()
        for block_s, warps, stages in SWEEP_TILES:
            for per_sm in SWEEP_PROGRAMS_PER_SM:
                kw = dict(block_s=block_s, num_warps=warps, num_stages=stages,
                          chunks=max(1, min(-(-S // block_s), -(-per_sm * sms // rows))))
                row: dict = {**kw, "programs_per_sm": per_sm}
                try:
                    row["equal"] = check(kernel(**kw), want, rtol=1e-2, atol=1e-3)["equal"]
                    row["ms"] = round(clock.time_calls(lambda kw=kw, k=kernel: k(**kw), args.iters), 4)
                except Exception as e:  # noqa: BLE001 - a shape that cannot run is a finding
                    row["error"] = f"{type(e).__name__}: {e}"[:160]
                    clock.sync()
                found.append(row)
        ok = [r for r in found if r.get("equal") and "ms" in r]
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        out[name] = {"best": best, "rows": found}
        progress(f"sweep {name} S={S}: best {best}")
    return out


# -- end-to-end decode of an 8B-shaped model ----------------------------------------------------------
def llama8b_args(layers: int, max_seq_len: int, smoke: bool):
    from engines.reference.model import ModelArgs

    if smoke:
        return ModelArgs(model_type="llama", vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
                         intermediate_size=512, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=max(8192, max_seq_len),
                         tie_embeddings=False, attention_bias=False, rope_scaling={"rope_type": "default"})
    return ModelArgs(model_type="llama", vocab_size=128256, dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8, head_dim=128,
                     intermediate_size=14336, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=max(8192, max_seq_len),
                     tie_embeddings=False, attention_bias=False, rope_scaling={"rope_type": "default"})


def init_weights(model, device: str) -> None:
    """Deterministic random weights: linears and embeddings N(0, 0.02), norms 1."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


def hf_llama(a, device: str):
    """transformers' LlamaForCausalLM of the same shape as ModelArgs `a`, fp16 on `device`."""
    import torch
    from engines.reference.model import rope_inv_freq
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.intermediate_size,
                      num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                      head_dim=a.head_dim, rms_norm_eps=a.norm_eps, max_position_embeddings=a.max_seq_len,
                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0,
                      rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta})
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)  # build in fp16: an fp32 8B model would not fit beside ours
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    ours = rope_inv_freq(a).to(device)
    theirs = hf.model.rotary_emb.inv_freq.float()
    if not torch.allclose(ours, theirs, rtol=1e-5):  # e.g. a transformers that ignored rope_parameters
        raise RuntimeError(f"transformers' RoPE frequencies differ from ours (theta {a.rope_theta}): check LlamaConfig")
    return hf.eval()


def build_models(a, device: str, with_hf: bool):
    """Our Transformer (unfused, fp16) and, when transformers is there, a LlamaForCausalLM holding
    the SAME tensors (our module names are HF's): one copy of the weights in memory."""
    import torch
    from engines.reference.model import Transformer, rope_inv_freq

    hf = None
    if with_hf:
        hf = hf_llama(a, device)
        init_weights(hf, device)
        with torch.device("meta"):
            model = Transformer(a)
        model.load_state_dict(hf.state_dict(), strict=True, assign=True)
    else:
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float16)
        try:
            with torch.device(device):
                model = Transformer(a)
        finally:
            torch.set_default_dtype(old)
        init_weights(model, device)
    model.inv_freq = rope_inv_freq(a).to(device)
    return model.eval(), hf


def decode_run(clock: Clock, model, kv: str, ids, new: int, device: str, repeats: int, profile: int = 0,
               warmup_ids=None) -> dict:
    """Greedy batch-1 decode through the Decoder: run 0 warms up (autotuning, graph capture,
    compilation) and is not counted; warmup_ids (a long context's row: the short prompt) gives
    run 0 another prompt, so that a 128K row pays its prefill once per counted run only, and its
    tokens are then left out of the comparison between runs. Each counted run is a fresh Decoder, whose
    prepare() (warm-up steps and graph capture: what a decode loop reused per bucket saves) is timed
    apart as prepare_ms: TTFT = prefill + the
    first token's argmax (one sync to read it), then one untimed step, then new − 2 timed steps
    with no host sync inside. The Decoder captures its graph in prepare(), before the clock.
    profile > 0 (CUDA): after the last run, `profile` more steps under torch.profiler, and the row
    gets the kernels that took the most GPU time per step (step_profile)."""
    import torch
    from engines.reference.decode import Decoder
    from engines.reference.kv import kv_format

    P = ids.shape[1]
    ttft, tps, step_ms, tokens, graphs, graphs_reason, prefill_logits = [], [], [], [], None, None, None
    prepare_ms: list[float] = []  # a fresh Decoder's prepare(): its warm-up and capture (the engine pays it per bucket)
    extra = profile if clock.cuda else 0
    step_profile = None
    for r in range(repeats + 1):
        run_ids = warmup_ids if r == 0 and warmup_ids is not None else ids
        dec = Decoder(model, kv_format(kv, torch.float16), 1, P + new + extra, torch.device(device), torch.float16)
        clock.sync()
        tp = time.perf_counter()
        dec.prepare()  # graph capture (where it applies) before the clock, as the engine does
        clock.sync()
        prepare_ms.append((time.perf_counter() - tp) * 1000)
        out = torch.empty(new, dtype=torch.long, device=device)
        clock.sync()
        t0 = time.perf_counter()
        logits = dec.prefill(run_ids)
        tok = logits.argmax(-1)
        out[0:1].copy_(tok)
        clock.sync()
        t1 = time.perf_counter()
        if prefill_logits is None and run_ids is ids:
            prefill_logits = logits[0].float().clone()
        tok = dec.step(tok).argmax(-1)
        out[1:2].copy_(tok)
        clock.sync()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(new - 1)] if clock.cuda else []
        if events:
            events[0].record()
        t2 = time.perf_counter()
        for i in range(2, new):
            tok = dec.step(tok).argmax(-1)
            out[i : i + 1].copy_(tok)
            if events:
                events[i - 1].record()
        clock.sync()
        t3 = time.perf_counter()
        graphs = bool(getattr(dec, "graphs_active", False))
        graphs_reason = getattr(dec, "graphs_reason", None)
        if extra and r == repeats:
            try:
                step_profile = profile_steps(dec, tok, extra)
            except Exception as e:  # noqa: BLE001 - a profiler failure costs the profile, not the row
                step_profile = {"error": f"{type(e).__name__}: {e}"[:300]}
        if run_ids is ids:
            tokens.append(out.tolist())
        del dec, out, logits
        if r:
            ttft.append((t1 - t0) * 1000)
            tps.append((new - 2) / (t3 - t2))
            step_ms.append(statistics.median(a.elapsed_time(b) for a, b in itertools.pairwise(events)) if events
                           else (t3 - t2) * 1000 / (new - 2))
    _free(device)
    return {"kv_cache": kv, "context": P, "new_tokens": new, "decode_loop": "engines.reference.decode.Decoder",
            "cuda_graphs": graphs, "cuda_graphs_reason": graphs_reason,
            "ttft_ms": spread(ttft, 2), "decode_tok_s": spread(tps, 1), "prepare_ms": spread(prepare_ms[1:], 1), "step_ms_median_per_run": spread(step_ms, 3),
            "tokens_same_every_run": all(t == tokens[0] for t in tokens), "_tokens": tokens[0], "_prefill_logits": prefill_logits,
            **({"step_profile": step_profile} if step_profile else {})}


NEW_LENGTH_OFFSETS = (1, 5, -3)  # prompt lengths never run before in the process, around the repeated one


def ttft_new_lengths(clock: Clock, model, kv: str, ids, device: str, repeated_ms: float) -> dict:
    """TTFT of prompt lengths this process has not prefilled before (P+1, P+5, P−3), each the first
    call at its length (an autotuner keyed on the exact length would time its configurations here,
    inside TTFT), against the median TTFT of the repeated length P → the times and the worst
    ratio. The added tokens come from a fixed generator."""
    import torch
    from engines.reference.decode import Decoder
    from engines.reference.kv import kv_format

    P = ids.shape[1]
    more = torch.randint(0, model.model.embed_tokens.weight.shape[0], (1, max(NEW_LENGTH_OFFSETS)),
                         generator=torch.Generator(device="cpu").manual_seed(7)).to(ids.device)
    full = torch.cat([ids, more], dim=1)
    got = {}
    for off in NEW_LENGTH_OFFSETS:
        L = P + off
        dec = Decoder(model, kv_format(kv, torch.float16), 1, L + 2, torch.device(device), torch.float16)
        dec.prepare()
        clock.sync()
        t0 = time.perf_counter()
        tok = dec.prefill(full[:, :L]).argmax(-1)
        tok.item()
        got[str(L)] = round((time.perf_counter() - t0) * 1000, 2)
        del dec, tok
    worst = max(got.values()) / repeated_ms
    return {"lengths_ms": got, "repeated_length_ms": repeated_ms, "worst_ratio": round(worst, 3)}


def profile_steps(dec, tok, n: int, top: int = 12) -> dict:
    """n decode steps under torch.profiler (CUDA activity, kernels inside a graph replay included):
    GPU µs per step in all, and the `top` kernels by GPU time per step with their launches per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            tok = dec.step(tok).argmax(-1)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    return {"steps": n, "gpu_us_per_step": round(total / n, 1), "kernels": len(events),
            "launches_per_step_all": round(sum(e.count for e in events) / n, 1),
            "top": [{"name": e.key[:90], "us_per_step": round(e.self_device_time_total / n, 1),
                     "launches_per_step": round(e.count / n, 1)} for e in events[:top]]}


def hf_peer(clock: Clock, hf, ids, new: int, device: str, repeats: int, static: bool) -> dict:
    """transformers' generate on the same weights: TTFT = generate(max_new_tokens=1); decode tok/s
    = (new − 1) / (time of generate(new) − median TTFT). Run 0 of each mode warms up."""
    import torch

    modes: dict[str, dict] = {"eager_dynamic_cache": {}}
    if static:
        modes["static_cache_no_compile"] = {"cache_implementation": "static", "disable_compile": True}
        modes["static_cache_auto_compile"] = {"cache_implementation": "static"}  # transformers compiles the forward on CUDA
    out = {}
    with torch.inference_mode():
        try:
            logits = hf(ids, logits_to_keep=1).logits[0, -1].float()
        except TypeError:
            logits = hf(ids).logits[0, -1].float()
        out["_prefill_logits"] = logits
        for name, kw in modes.items():
            def gen(n, kw=kw):
                return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
            try:
                gen(1)  # warm-up of both lengths (a static cache of another length may recompile)
                gen(new)
                ttft, total = [], []
                for _ in range(repeats):
                    clock.sync()
                    t = time.perf_counter()
                    gen(1)
                    clock.sync()
                    ttft.append((time.perf_counter() - t) * 1000)
                    t = time.perf_counter()
                    seq = gen(new)
                    clock.sync()
                    total.append((time.perf_counter() - t) * 1000)
                t1 = statistics.median(ttft)
                tps = [(new - 1) / ((x - t1) / 1000) for x in total]
                out[name] = {"ttft_ms": spread(ttft, 2), "decode_tok_s": spread(tps, 1), "_tokens": seq[0, ids.shape[1]:].tolist()}
                if name == "static_cache_auto_compile":
                    out[name]["torch_compile"] = hf.device.type == "cuda"  # transformers compiles on CUDA only
            except Exception as e:  # noqa: BLE001 - a mode this transformers/torch cannot run is reported, not fatal
                out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            _free(device)
    return out


def agreement(ours: list[int], theirs: list[int], our_logits, their_logits) -> dict:
    first = next((i for i, (x, y) in enumerate(zip(ours, theirs, strict=False)) if x != y), None)
    return {"tokens_identical": ours == theirs, "first_divergence": first, "compared_tokens": min(len(ours), len(theirs)),
            "prefill_top1_equal": bool(our_logits.argmax().item() == their_logits.argmax().item()),
            "prefill_logits_max_abs_diff": float(f"{(our_logits - their_logits).abs().max().item():.3g}")}


def quantize_int4(model, device: str) -> str:
    """rtn-int4 the engine's way on CUDA: each fused linear packed (AutoAWQ GEMM layout) and
    multiplied by the W4A16 kernels (torch reference where kernels do not run), a single row
    by the engine's default int4_gemv ('auto': torch's tinygemm where it runs). → the engine's
    note of which kernel serves a single row."""
    import torch
    from engines.kernels.w4a16 import W4A16Linear
    from engines.quant import quantize_groupwise
    from engines.reference.weights import batch1_note

    with torch.no_grad():
        for layer in model.model.layers:
            for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                 (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                q, s, z = quantize_groupwise(getattr(parent, name).weight.float(), 4)
                setattr(parent, name, W4A16Linear.from_parts([(q, z, s)], None, device, "auto"))
                del q, s, z
    _free(device)
    return batch1_note(model)


def int4_batch1_triton(model) -> list:
    """Turn the tinygemm single-row path off (the Triton GEMV serves it), for the peer row;
    → the layers to give it back to."""
    from engines.kernels.w4a16 import W4A16Linear

    layers = [(m, m.tiny) for m in model.modules() if isinstance(m, W4A16Linear) and m.tiny is not None]
    for m, _ in layers:
        m.tiny = None
    return layers


def kv_target(kv: str, context: int, batch: int = 1) -> float:
    """A KV format's decode tok/s against fp16 KV at the same context (the round-3 GPU review, §4.4,
    under the bytes model's ceiling): an overhead budget at 1K, a gain where the KV is a large share
    of the bytes a step reads."""
    if batch >= 16:
        return 1.25 if kv == "fp8" else 1.5
    if context <= 4096:
        return 0.97
    if context < 131072:
        return 1.0
    return 1.15 if kv == "fp8" else 1.3


def decode_section(clock: Clock, device: str, args, peak_gbps: float, errors: dict[str, str]) -> dict:
    """The 8B-shaped decode rows; a config that raises records its error in its row and in
    `errors` (the run then exits 1), and the others still run."""
    import torch

    new = args.new_tokens
    prompt = 16 if args.smoke else args.prompt
    long_ctx = (32 if args.long_context else 0) if args.smoke else args.long_context
    a = llama8b_args(args.layers, max(prompt, long_ctx) + new, args.smoke)
    with_hf = not args.no_hf
    if with_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            with_hf = False
    torch.manual_seed(0)
    model, hf = build_models(a, device, with_hf)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, a.vocab_size, (1, prompt), generator=g).to(device)
    res: dict = {"ttft_definition": "ours: prefill + the first token's argmax, read on the host (the Decoder is built "
                                    "before); transformers: a whole generate(max_new_tokens=1) call on token ids",
                 "model": {"layers": a.n_layers, "dim": a.dim, "heads": a.n_heads, "kv_heads": a.n_kv_heads, "head_dim": a.head_dim,
                           "intermediate": a.intermediate_size, "vocab": a.vocab_size, "weights": "random N(0, 0.02), norms 1"},
                 "batch": 1, "configs": []}
    # bytes one decode step reads at fp16: every weight but the embedding table (one row of it), plus the fp16 KV
    weight_bytes = sum(p.nbytes for n, p in model.named_parameters() if "embed_tokens" not in n)
    hf_res = None
    if hf is not None:
        hf_res = hf_peer(clock, hf, ids, new, device, args.repeats, static=not args.no_hf_static)
        del hf
        _free(device)
    runs: list[tuple[str, dict]] = []

    def run_config(w: str, kv: str, prompt_ids) -> None:
        """One config's row; an error (an OOM, say) costs that row only: it records the error."""
        P = prompt_ids.shape[1]
        progress(f"decode {w} weights, {kv} KV, context {P}: start")
        t = time.perf_counter()
        try:
            r = decode_run(clock, model, kv, prompt_ids, new, device, args.repeats, args.profile_steps,
                           warmup_ids=ids if P > prompt else None)
            if P == prompt and kv == "fp16":
                r["ttft_new_length"] = ttft_new_lengths(clock, model, kv, prompt_ids, device, r["ttft_ms"]["median"])
        except Exception as e:  # noqa: BLE001 - reported in the row and in the run's errors; the next config runs
            import traceback

            traceback.print_exc(file=sys.stderr)
            r = {"kv_cache": kv, "context": P, "error": f"{type(e).__name__}: {e}"[:500]}
            errors[f"decode_8b {w}/{kv}/{P}"] = r["error"]
        _free(device)
        runs.append((w, r))
        got = r.get("error") or f"{r['decode_tok_s']['median']} tok/s, TTFT {r['ttft_ms']['median']} ms"
        progress(f"decode {w} weights, {kv} KV, context {P}: {got} ({time.perf_counter() - t:.0f} s)")

    configs_1k = [c for c in CONFIGS_1K if not args.configs or "/".join(c) in args.configs]
    with torch.inference_mode():
        model.fuse()
        _free(device)
        for w, kv in configs_1k:
            if w == "fp16":
                run_config(w, kv, ids)
        if long_ctx:
            ids_long = torch.randint(0, a.vocab_size, (1, long_ctx), generator=g).to(device)
            for w, kv in CONFIGS_LONG:
                if not args.long_kv or kv in args.long_kv:
                    run_config(w, kv, ids_long)
            del ids_long
        int4 = None
        try:
            if any(w == "rtn-int4" for w, _ in configs_1k):
                res["int4_gemv"] = quantize_int4(model, device)
        except Exception as e:  # noqa: BLE001 - the int4 rows record it
            int4 = f"quantize_int4: {type(e).__name__}: {e}"[:500]
            errors["decode_8b rtn-int4"] = int4
        for w, kv in configs_1k:
            if w == "rtn-int4":
                if int4:
                    runs.append((w, {"kv_cache": kv, "context": prompt, "error": int4}))
                else:
                    run_config(w, kv, ids)
        if not int4 and ("rtn-int4", "fp16") in configs_1k and int4_batch1_triton(model):  # tinygemm served one row: the own GEMV beside it
            run_config("rtn-int4 (Triton GEMV)", "fp16", ids)
    smoke = args.smoke

    def find(w, kv, ctx):
        return next((r for ww, r in runs if ww == w and r["kv_cache"] == kv and r["context"] == ctx and "error" not in r),
                    None)

    fp16 = find("fp16", "fp16", prompt)
    fp16_long = find("fp16", "fp16", long_ctx)
    for w, r in runs:
        row = {"weights": w, **{k: v for k, v in r.items() if not k.startswith("_")}}
        if "error" in r:
            res["configs"].append(row)
            continue
        tps = r["decode_tok_s"]["median"]
        kv_bytes = 2 * a.n_layers * a.n_kv_heads * a.head_dim * 2 * (r["context"] + new // 2)
        if w == "fp16" and r["kv_cache"] == "fp16":
            bound = peak_gbps * 1e9 / (weight_bytes + kv_bytes)
            row["bandwidth_bound"] = {"bytes_per_token": weight_bytes + kv_bytes, "weight_bytes": weight_bytes,
                                      "tok_s": round(bound, 1), "fraction": round(tps / bound, 3)}
            if r["context"] == prompt:
                row["target"] = verdict(round(tps / bound, 3), tps >= 0.7 * bound, ">= 0.70 of the read-bandwidth bound", smoke)
        elif w == "rtn-int4" and r["kv_cache"] == "fp16" and fp16:
            x = tps / fp16["decode_tok_s"]["median"]
            row["target"] = verdict(round(x, 2), x >= 1.6, ">= 1.6x fp16 tok/s (stretch 2.0x)", smoke)
            new_len, fp16_len = r.get("ttft_new_length"), fp16.get("ttft_new_length")
            if new_len and fp16_len:  # the first call at a new shape costs fp16 too: judged against it
                new_len["target"] = verdict(new_len["worst_ratio"], new_len["worst_ratio"] <= fp16_len["worst_ratio"] + 0.10,
                                            "a new prompt length's TTFT penalty within fp16's own + 0.10 (same run)", smoke)
        elif w == "fp16" and r["kv_cache"] in ("turbo-3", "kivi-2", "fp8"):
            base = fp16 if r["context"] == prompt else fp16_long
            want = kv_target(r["kv_cache"], r["context"])
            if base:
                x = tps / base["decode_tok_s"]["median"]
                row["target"] = verdict(round(x, 2), x >= want, f">= {want:g}x fp16 KV tok/s at the same context", smoke)
        res["configs"].append(row)
    if hf_res is not None:
        peer = {k: v for k, v in hf_res.items() if not k.startswith("_")}
        for mode in peer.values():
            if "_tokens" in mode and fp16 is None:
                mode.pop("_tokens")
            elif "_tokens" in mode:
                mode["agreement_with_ours_fp16"] = agreement(fp16["_tokens"], mode.pop("_tokens"), fp16["_prefill_logits"],
                                                             hf_res["_prefill_logits"])
                mode["ours_fp16_speedup"] = round(fp16["decode_tok_s"]["median"] / mode["decode_tok_s"]["median"], 2)
        res["transformers_generate"] = {"version": __import__("transformers").__version__, "context": prompt, "new_tokens": new, **peer}
    else:
        res["transformers_generate"] = {"skipped": "--no-hf" if args.no_hf else "transformers is not installed"}
    return res


# -- the tiny built-in model through the engine --------------------------------------------------------
def tiny_section(clock: Clock, args, devices: list[str]) -> dict:
    try:
        from engines.protocol import GenerationRequest
        from engines.reference.engine import ReferenceEngine
        from engines.spec import OptimizationSpec
    except ImportError as e:
        return {"skipped": f"{e}: ReferenceEngine needs engines.spec, which needs pydantic (docs/benchmarks.md 'GPU report': carry "
                           "its wheels)"}
    from _common import TARGET, prompts

    n_prompts, new = (2, 8) if args.smoke else (4, 64)
    reqs = [GenerationRequest(str(i), t, new) for i, t in enumerate(prompts(n_prompts))]
    out = {"model": "builtin:pydoc-target", "prompts": n_prompts, "max_new_tokens": new, "concurrency": 1, "weights": {}}
    for w in ("fp16", "rtn-int4"):
        engines = {d: ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights=w, engine_options={"device": d}))
                   for d in devices}
        for e in engines.values():
            e.generate(reqs[:1])  # warm-up
        ttft: dict[str, list] = {d: [] for d in devices}
        tps: dict[str, list] = {d: [] for d in devices}
        for r in range(args.repeats):
            for d in devices[r % len(devices):] + devices[: r % len(devices)]:
                res = engines[d].generate(reqs)
                ttft[d].append(statistics.median(g.ttft_ms for g in res))
                steps = sum(len(g.token_ids) - 1 for g in res)
                tps[d].append(steps / (sum(g.total_ms - g.ttft_ms for g in res) / 1000))
        row = {d: {"ttft_ms_p50": spread(ttft[d], 2), "decode_tok_s": spread(tps[d], 1)} for d in devices}
        if "cuda" in devices:
            c, p = row["cuda"], row.get("cpu")
            c["ttft_target"] = verdict(c["ttft_ms_p50"]["median"], c["ttft_ms_p50"]["median"] < 20, "< 20 ms", args.smoke)
            if p:
                x = c["decode_tok_s"]["median"] / p["decode_tok_s"]["median"]
                c["speed_vs_cpu"] = verdict(round(x, 2), x >= 1.0, ">= 1x the CPU's tok/s (same run)", args.smoke)
        out["weights"][w] = row
        del engines
        _free(devices[0])
    out["loops"] = {d: loop_peers(args, d, reqs) for d in devices}
    return out


def loop_peers(args, device: str, reqs) -> dict:
    """fp16, each request its own generate() call (as a canary run's batches come): the decode
    loops reused per batch bucket (capture paid once per bucket) against one built per call, wall
    ms per request; and greedy ngram speculative decoding with the static verify pass (captured
    on CUDA) against verify passes as wide as their drafts, decode tok/s. Alternating per repeat;
    tokens compared."""
    from engines.reference.engine import ReferenceEngine
    from engines.spec import OptimizationSpec

    from _common import TARGET

    def build(speculative: dict, flag: str, on: bool):
        e = ReferenceEngine(TARGET, OptimizationSpec.model_validate(
            {"engine": "reference", "weights": "fp16", "speculative": speculative, "engine_options": {"device": device}}))
        setattr(e, flag, on)
        e.generate(reqs[:1])  # warm-up
        return e

    out = {}
    for name, speculative, flag in (("decode_loops", {"method": "off"}, "reuse_decoders"),
                                    ("speculative_verify", {"method": "ngram", "k": 4}, "static_verify")):
        engines = {"on": build(speculative, flag, True), "off": build(speculative, flag, False)}
        ms: dict[str, list] = {k: [] for k in engines}
        tps: dict[str, list] = {k: [] for k in engines}
        tokens: dict[str, list] = {}
        for r in range(args.repeats):
            for k in (("on", "off") if r % 2 == 0 else ("off", "on")):
                t0 = time.perf_counter()
                res = [engines[k].generate([q])[0] for q in reqs]
                ms[k].append((time.perf_counter() - t0) * 1000 / len(reqs))
                decode_s = sum(g.total_ms - g.ttft_ms for g in res) / 1000
                tps[k].append(sum(len(g.token_ids) - 1 for g in res) / decode_s if decode_s > 0 else 0.0)
                tokens[k] = [g.token_ids for g in res]
        out[name] = {k: {flag: k == "on", "wall_ms_per_request": spread(ms[k], 1), "decode_tok_s": spread(tps[k], 1),
                         "notes": [n for n in engines[k].describe().notes if "graph" in n or "loops" in n]}
                     for k in engines}
        out[name]["same_tokens"] = tokens["on"] == tokens["off"]
        del engines
        _free(device)
    return out


# -- main -------------------------------------------------------------------------------------------------
def _free(device: str) -> None:
    """Give freed GPU memory back between sections (an 8B model and a 128K cache share the card)."""
    if str(device).startswith("cuda"):
        import torch

        gc.collect()
        torch.cuda.empty_cache()


def yardstick(device: str, args) -> dict:
    """The figures every fraction divides by (_yardstick): the read stream (the divisor), the
    eager copy, and on CUDA the graph-replayed copy that served before (2.7 against 4.26 TB/s on
    an H200), kept to show the gap."""
    out = {"read_bandwidth": read_bandwidth(device, args.repeats, args.smoke),
           "copy_bandwidth": copy_bandwidth(device, args.repeats, args.smoke),
           "divisor": "read_bandwidth: decode reads weights and KV and writes a few KB"}
    if str(device).startswith("cuda"):
        out["graph_copy_bandwidth"] = graph_copy_bandwidth(device, args.repeats, args.smoke)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        if not args.smoke:
            print("benchmarks/kernel_bench.py: --device cpu runs the tiny --smoke shapes only (the Triton interpreter is "
                  "far too slow for the real ones)", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
    if args.new_tokens < 3:
        print("benchmarks/kernel_bench.py: --new-tokens must be at least 3", file=sys.stderr)
        return 2
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"benchmark": "kernels", "skipped": "no CUDA device on this host; run it on a GPU machine "
                                                             "(or --device cpu --smoke for the CPU smoke run)"}))
        return 0
    device = args.device
    clock = Clock(device, warmup=0 if args.smoke else 2)
    versions = {"torch": torch.__version__}
    for mod in ("triton", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    report: dict = {"benchmark": "kernels", "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
                    "smoke": args.smoke, "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1", "versions": versions,
                    "repeats": args.repeats, "iters_per_repeat": args.iters, "threads": torch.get_num_threads(),
                    "load_average": [round(x, 2) for x in os.getloadavg()]}
    if args.smoke:
        report["note"] = "smoke: tiny shapes, correctness only; timings say nothing about the targets (meets_target null)"
    checks: list[dict] = []
    errors: dict[str, str] = {}
    t_start = time.perf_counter()
    report["yardstick"] = yardstick(device, args)
    peak = report["yardstick"]["read_bandwidth"]["GBps"]["median"]
    args.l2_bytes = l2_bytes(device, args.l2_bytes)
    report["l2_bytes"] = args.l2_bytes

    def section(name, fn):
        t = time.perf_counter()
        progress(f"section {name}: start")
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - reported in the JSON; the run fails at the end
            import traceback

            errors[name] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc(file=sys.stderr)
            return None
        finally:
            report.setdefault("section_wall_s", {})[name] = round(time.perf_counter() - t, 1)
            progress(f"section {name}: done in {time.perf_counter() - t:.0f} s")

    if "w4a16" not in args.skip:
        got = section("w4a16", lambda: w4a16_section(clock, device, args, peak))
        if got:
            report["w4a16"], c = got
            checks += c
    if "attention" not in args.skip:
        got = section("decode_attention", lambda: attention_section(clock, device, args, peak))
        if got:
            report["decode_attention"], c = got
            checks += c
    if "decode" not in args.skip:
        report["decode_8b"] = section("decode_8b", lambda: decode_section(clock, device, args, peak, errors))
    if "tiny" not in args.skip:
        devices = ["cuda", "cpu"] if device.startswith("cuda") else ["cpu"]
        report["tiny_model"] = section("tiny_model", lambda: tiny_section(clock, args, devices))
    report["timing"] = ("CUDA: GPU ms per call from one CUDA-graph replay of iters calls (events around the replay); "
                        "host_dispatch_ms beside each figure is the eager host cost of one call" if clock.cuda
                        else "perf_counter around each call")
    report["timing_fallbacks"] = clock.fallbacks  # calls that could not be captured, timed by events around eager calls
    report["checks"] = checks
    report["all_checks_equal"] = all(c["equal"] for c in checks)
    report["errors"] = errors
    report["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(report))
    return 0 if report["all_checks_equal"] and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
