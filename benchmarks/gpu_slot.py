"""One prepared script for a 15-minute GPU slot: stages in priority order, each written to its own
JSON file the moment it ends, under one global deadline, so a slot cut short still returns every
stage it reached (docs/benchmarks.md "GPU report"; the round-3 GPU review, §6.2).

    python3 benchmarks/gpu_slot.py --out "$OUT" --deadline 380          # on the lent GPU
    python3 benchmarks/gpu_slot.py --out out/slot --device cpu --smoke   # rehearse every stage here
    python3 benchmarks/gpu_slot.py --out "$OUT" --only S3 S4             # rerun what failed

Stages (each a child process with what is left of the deadline as its limit; a stage whose
estimate does not fit what is left is skipped and says so):
  S0 capacity   KV bytes per format on the meta device (kernel-path stores): batch 16 × 32K against
                fp16, and 32K sequences that fit a 100 GB budget beside the 8B weights. No GPU.
  S1 yardstick  read stream 2 GiB, eager copy 1 GiB, graph-replayed copy (the old divisor), ×5 each.
  S2 w4a16      W4A16 with a cold L2 at batch 1 and 16 on the 8B shapes (qkv 4096×6144, o 4096×4096,
                gate_up 4096×28672, down 14336×4096, and 4096×14336): ours, tinygemm, fp16, each
                checked against its reference.
  S3 attention  decode attention with a cold L2 at 32K and 128K (batch 1) and 32K × batch 16: SDPA,
                the fp16 grouped kernel, fp8, TurboQuant-3, KIVI-2, each checked first.
  S4 decode     an 8B-shaped model (random fp16 weights) over a SYNTHETIC cache (Decoder.fill_synthetic:
                every layer written through its format's write path, no prefill): batch 1 × 1K fp16,
                batch 16 × 16K for fp16, fp8, turbo-3 and kivi-2, then batch 1 × 1K rtn-int4; tok/s,
                KVCache.nbytes() and the bytes-model ceiling beside each row.
  S5 profile    3 profiled decode steps of fp16 at 1K: kernels and launches per step, GPU µs per step.

Every stage's JSON carries the figures this review predicted for it ("predicted"), so a run can
prove the review wrong. Exit 0 only when every stage asked for ran to its end with its checks
holding (a skipped or stopped stage exits 1; its reason is in summary.json).
Needs torch, Triton and (S0, S4's rtn-int4 note) nothing else; no pydantic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("S0", "S1", "S2", "S3", "S4", "S5")
ESTIMATE_S = {"S0": 5, "S1": 20, "S2": 60, "S3": 90, "S4": 150, "S5": 30}  # on an H200, start-up included
NAMES = {"S0": "capacity", "S1": "yardstick", "S2": "w4a16", "S3": "attention", "S4": "decode", "S5": "profile"}
PREDICTED = {  # the round-3 GPU review (§6.2), written before the run
    "S1": {"eager_copy_TBps": "4.2-4.3", "read_stream_TBps": "4.4-4.7", "graph_copy_TBps": "~2.7"},
    # gemv_mma (now w4a16's decode GEMV on CUDA; gemv1 is its "w4a16_simt" peer): 58.7M weights at 3.9
    # lane-instructions each and ~60 % issue, against 30.3 MB at 4.4 TB/s (6.9 us)
    "S2": {"gemv1 4096x14336 batch 1 (us)": "30-35", "gemv_mma 4096x14336 batch 1 (us)": "11-15",
           "tinygemm (us)": "19-22", "fp16 (us)": "30-31"},
    # turbo3 and kivi2 as the kernels now are (nibbles read by byte permutes, 4.3 lane-instructions an
    # element; KIVI's scales folded, 6.0): the review's issue model at ~60 % issue, over their bytes
    # (the old kernels: turbo3 95-106, kivi2 115-128)
    "S3": {"32K batch 1 (us)": {"sdpa": "38-40", "grouped_fp16": "~35", "fp8": "30-32", "turbo3": "18-26", "kivi2": "20-30"}},
    # turbo-3 stores 68 B a vector now (3-bit codes in nibbles), 2.25 at 52 B before
    "S4": {"bytes-model ceiling 16x16K": {"turbo-3": 2.05, "kivi-2": 2.09, "fp8": 1.53}},
    # the fused step (engines/kernels/fused.py) as engines/reference/step_plan.py counts it on the meta
    # device: 10 launches a layer × 32 + 18 once, and the argmax after the replay; cuBLAS may split a
    # GEMV in two (the review's profile: ~1,000 launches a step before the fusion)
    "S5": {"launches per step, all kernels": "339-420", "planned on meta": 338},
}
TARGETS = {  # the table (H200, cold L2)
    "S2": "W4A16 batch 1 >= 2.0x fp16 and >= 0.5 of read bandwidth; batch 16 >= 1.5x fp16",
    "S3": "fp8 / turbo-3 / kivi-2 vs SDPA: 32K >= 1.6 / 1.3 / 1.5x; 128K >= 1.6 / 1.5 / 1.8x; 32K x 16: turbo-3 >= 2x",
    "S4": "fp16 1K >= 0.70 of the read bound; rtn-int4 >= 1.6x fp16; 16x16K turbo-3, kivi-2 >= 1.5x and fp8 >= 1.25x fp16",
    "S0": "turbo-3 KV bytes at 16 x 32K <= 0.35x fp16's; turbo-3 >= 3.5x fp16's sequences at 32K in the budget",
}
BUDGET_BYTES = 100 * 10**9  # the fixed memory budget of the capacity figure (weights + KV)


def progress(msg: str) -> None:
    print(f"[gpu-slot {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="benchmarks/gpu_slot.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for <stage>.json and the summary")
    ap.add_argument("--deadline", type=float, default=380, help="seconds for the whole script (default 380)")
    ap.add_argument("--only", nargs="+", choices=STAGES, default=None, help="stages to run (default: all, in order)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu with --smoke (Triton interpreter)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 1 repeat: proves the stages, measures nothing")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per timed figure (default 3; 1 with --smoke)")
    ap.add_argument("--stage", choices=STAGES, default=None, help=argparse.SUPPRESS)  # a child runs one stage
    args = ap.parse_args(argv)
    if args.device == "cpu" and not args.smoke:
        ap.error("--device cpu runs the --smoke shapes only")
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 3
    return args


class StageFile:
    """A stage's JSON, rewritten whole after every row, so a stage stopped midway leaves what it had."""

    def __init__(self, out: Path, stage: str, args):
        self.path = out / f"{stage}_{NAMES[stage]}.json"
        self.data: dict = {"stage": stage, "name": NAMES[stage], "device": args.device, "smoke": args.smoke,
                           "complete": False, "predicted": PREDICTED.get(stage), "target": TARGETS.get(stage)}
        self.save()

    def save(self, **more) -> None:
        self.data.update(more)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


# -- the stages (each runs in its own process) ----------------------------------------------------------
def kernel_args(args, **more):
    """The namespace benchmarks/kernel_bench.py's sections read."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_bench as bench
    from _yardstick import l2_bytes

    ns = bench.parse_args(["--device", args.device, "--repeats", str(args.repeats), *(["--smoke"] if args.smoke else [])])
    ns.l2_bytes = l2_bytes(args.device, None)
    for k, v in more.items():
        setattr(ns, k, v)
    return bench, ns


def read_bw(args) -> float:
    from _yardstick import read_bandwidth

    return read_bandwidth(args.device, args.repeats, args.smoke)["GBps"]["median"]


def stage_s0(args, f: StageFile) -> bool:
    """KV bytes of each format's cache on the meta device with the kernel-path stores (what a
    CUDA cache holds), at batch 16 × 32K, and the 32K sequences that fit a 100 GB budget."""
    os.environ["CANARY_KERNELS"] = "triton"  # the stores a CUDA cache makes (meta tensors: nothing runs)
    import torch
    from engines.reference.cache import KVCache
    from engines.reference.kv import kv_format

    L, Hkv, D, S = 32, 8, 128, 32768
    weights = 15_010_000_000  # the 8B shape's fp16 weights less the embedding table's unread rows (S4 measures it)
    meta = torch.device("meta")
    rows = {}
    for kv in ("fp16", "fp8", "kivi-2", "turbo-3"):
        one = KVCache(L, 1, S, Hkv, D, torch.float16, meta, kv_format(kv, torch.float16)).nbytes()
        b16 = KVCache(L, 16, S, Hkv, D, torch.float16, meta, kv_format(kv, torch.float16)).nbytes()
        rows[kv] = {"bytes_batch1_32k": one, "bytes_batch16_32k": b16, "sequences_in_budget": (BUDGET_BYTES - weights) // one}
    for r in rows.values():
        r["vs_fp16_bytes"] = round(r["bytes_batch16_32k"] / rows["fp16"]["bytes_batch16_32k"], 3)
        r["vs_fp16_sequences"] = round(r["sequences_in_budget"] / rows["fp16"]["sequences_in_budget"], 2)
    ok = rows["turbo-3"]["vs_fp16_bytes"] <= 0.35 and rows["turbo-3"]["vs_fp16_sequences"] >= 3.5
    f.save(budget_bytes=BUDGET_BYTES, weight_bytes=weights, formats=rows, meets_target=ok, complete=True)
    return ok


def stage_s1(args, f: StageFile) -> bool:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _yardstick import copy_bandwidth, graph_copy_bandwidth, l2_bytes, read_bandwidth

    r = args.repeats if args.smoke else 5
    out = {"read_bandwidth": read_bandwidth(args.device, r, args.smoke)}
    f.save(**out)
    out["copy_bandwidth"] = copy_bandwidth(args.device, r, args.smoke)
    f.save(**out)
    if args.device.startswith("cuda"):
        import torch

        out["graph_copy_bandwidth"] = graph_copy_bandwidth(args.device, r, args.smoke)
        p = torch.cuda.get_device_properties(args.device)
        out["device_properties"] = {"name": p.name, "sms": p.multi_processor_count, "memory_bytes": p.total_memory,
                                    "l2_bytes": l2_bytes(args.device)}
    f.save(**out, complete=True)
    return bool(out["read_bandwidth"]["sum_equal"])


def kernel_stage(args, f: StageFile, points, run_one) -> bool:
    """A kernel stage: run_one(bench, clock, ns, peak, point) → (rows, checks) for each point in
    turn, the stage's JSON rewritten after each; True when every output equals its reference."""
    bench, ns = kernel_args(args)
    clock = bench.Clock(args.device, warmup=0 if args.smoke else 2)
    peak = read_bw(args)
    rows, checks = [], []
    for point in points:
        r, c = run_one(bench, clock, ns, peak, point)
        rows += r
        checks += c
        f.save(read_GBps=peak, l2_bytes=ns.l2_bytes, rows=rows, checks=checks, timing_fallbacks=clock.fallbacks)
    ok = all(c["equal"] for c in checks)
    f.save(all_checks_equal=ok, complete=True)
    return ok


def stage_s2(args, f: StageFile) -> bool:
    shapes = ((128, 64),) if args.smoke else ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 14336))
    return kernel_stage(args, f, shapes, lambda bench, clock, ns, peak, shape: bench.w4a16_section(
        clock, args.device, ns, peak, shapes=(shape,), prefill_rows=()))


def stage_s3(args, f: StageFile) -> bool:
    points = ((64, 1), (64, 2)) if args.smoke else ((32768, 1), (131072, 1), (32768, 16))
    return kernel_stage(args, f, points, lambda bench, clock, ns, peak, point: bench.attention_section(
        clock, args.device, ns, peak, points=(point,)))


def synthetic_row(bench, clock, model, kv: str, batch: int, length: int, new: int, args, weight_bytes: int,
                  peak_gbps: float) -> dict:
    """Decode tok/s over a synthetic cache of `length` tokens per row: a fresh Decoder per repeat,
    prepare() (graph capture), fill_synthetic and one untimed step (KIVI codes its whole cache on
    the first step after a fill, as after a prefill) before the clock, then `new` steps with no
    host sync inside → the row, with the cache's bytes and the bytes-model bound (weights + the KV
    a step reads, over the read bandwidth)."""
    import statistics

    import torch
    from engines.reference.decode import Decoder
    from engines.reference.kv import kv_format

    tps, step_ms, nbytes, graphs = [], [], 0, None
    warm = 0 if args.smoke else 1
    for r in range(args.repeats + warm):  # run 0 warms up (autotuning, capture); the rehearsal times its only run
        dec = Decoder(model, kv_format(kv, torch.float16), batch, length + new + 1, torch.device(args.device), torch.float16)
        dec.prepare()
        dec.fill_synthetic(length, seed=r)
        tok = dec.step(torch.zeros(batch, dtype=torch.long, device=args.device)).argmax(-1)
        nbytes, kv_read = dec.cache.nbytes(), kv_bytes_read(dec.cache, length + 1 + new // 2)
        clock.sync()
        t0 = time.perf_counter()
        for _ in range(new):
            tok = dec.step(tok).argmax(-1)
        clock.sync()
        t1 = time.perf_counter()
        graphs = dec.graphs_reason
        if r >= warm:
            tps.append(batch * new / (t1 - t0))
            step_ms.append((t1 - t0) * 1000 / new)
        del dec
        bench._free(args.device)
    bound = peak_gbps * 1e9 / (weight_bytes + kv_read) * batch
    return {"kv_cache": kv, "batch": batch, "context": length, "new_tokens": new, "cuda_graphs": graphs,
            "kv_cache_bytes": nbytes, "kv_bytes_read_per_step": kv_read, "weight_bytes": weight_bytes,
            "decode_tok_s": bench.spread(tps, 1), "step_ms": bench.spread(step_ms, 3),
            "bytes_bound_tok_s": round(bound, 1), "fraction_of_bound": round(statistics.median(tps) / bound, 3)}


def kv_bytes_read(cache, tokens: int) -> int:
    """KV bytes a decode step reads at `tokens` tokens per row: the cache's bytes for those slots,
    where it holds one form of each slot (fp16, or codes only); for KIVI, which keeps its raw
    fp16 cache as the source of its recent window, the codes of those slots and the raw window."""
    slots = cache.k.shape[3]
    if cache.keeps_raw and cache.fmt.lossy:
        codes = sum(t.nbytes for t in cache.store.buffers())
        window = min(tokens, getattr(cache.fmt, "residual", 0))
        L, B, Hkv, _, D = cache.k.shape
        return int(codes * tokens / slots) + 2 * L * B * Hkv * window * D * cache.k.element_size()
    return int(cache.nbytes() * tokens / slots)


def stage_s4(args, f: StageFile) -> bool:
    import torch

    bench, ns = kernel_args(args)
    clock = bench.Clock(args.device, warmup=0)
    peak = read_bw(args)
    a = bench.llama8b_args(32, 16384 + 64, args.smoke)
    model, _ = bench.build_models(a, args.device, with_hf=False)
    weight_bytes = sum(p.nbytes for n, p in model.named_parameters() if "embed_tokens" not in n)
    new = 4 if args.smoke else 32
    short, long_, wide = (16, 48, 2) if args.smoke else (1024, 16384, 16)
    rows, errors = [], {}

    def run(name: str, kv: str, batch: int, length: int, wb: int) -> dict | None:
        progress(f"S4 {name} {kv} batch {batch} x {length}: start")
        try:
            row = {"weights": name, **synthetic_row(bench, clock, model, kv, batch, length, new, args, wb, peak)}
        except Exception as e:  # noqa: BLE001 - one row's failure (an OOM) is recorded; the others run
            errors[f"{name}/{kv}/{batch}x{length}"] = f"{type(e).__name__}: {e}"[:400]
            row = {"weights": name, "kv_cache": kv, "batch": batch, "context": length, "error": errors[f"{name}/{kv}/{batch}x{length}"]}
            bench._free(args.device)
        rows.append(row)
        f.save(read_GBps=peak, rows=rows, errors=errors)
        progress(f"S4 {name} {kv} batch {batch} x {length}: {row.get('decode_tok_s', row.get('error'))}")
        return row if "error" not in row else None

    with torch.inference_mode():
        model.fuse()
        base_1k = run("fp16", "fp16", 1, short, weight_bytes)
        base_wide = run("fp16", "fp16", wide, long_, weight_bytes)
        for kv in ("fp8", "turbo-3", "kivi-2"):
            r = run("fp16", kv, wide, long_, weight_bytes)
            if r and base_wide:
                x = r["decode_tok_s"]["median"] / base_wide["decode_tok_s"]["median"]
                want = bench.kv_target(kv, long_, wide)
                ceiling = (weight_bytes + base_wide["kv_bytes_read_per_step"]) / (weight_bytes + r["kv_bytes_read_per_step"])
                r["vs_fp16"] = bench.verdict(round(x, 2), x >= want, f">= {want:g}x fp16 KV at batch {wide} x {long_}", args.smoke)
                r["bytes_model_ceiling_vs_fp16"] = round(ceiling, 2)
        try:
            note = bench.quantize_int4(model, args.device)
            int4_bytes = sum(t.nbytes for n, t in list(model.named_parameters()) + list(model.named_buffers()) if "embed_tokens" not in n)
            r = run("rtn-int4", "fp16", 1, short, int4_bytes)
            if r:
                r["int4_gemv"] = note
                if base_1k:
                    x = r["decode_tok_s"]["median"] / base_1k["decode_tok_s"]["median"]
                    r["vs_fp16"] = bench.verdict(round(x, 2), x >= 1.6, ">= 1.6x fp16 tok/s (stretch 2.0x)", args.smoke)
        except Exception as e:  # noqa: BLE001 - recorded
            errors["rtn-int4"] = f"{type(e).__name__}: {e}"[:400]
    if base_1k:
        fr = base_1k["fraction_of_bound"]
        base_1k["target"] = bench.verdict(fr, fr >= 0.7, ">= 0.70 of the read-bandwidth bound", args.smoke)
    f.save(rows=rows, errors=errors, complete=True)
    return not errors


def stage_s5(args, f: StageFile) -> bool:
    import torch

    bench, ns = kernel_args(args)
    if not args.device.startswith("cuda"):
        f.save(skipped="the profile reads CUDA kernels; nothing to profile on the CPU", complete=True)
        return True
    from engines.reference.decode import Decoder
    from engines.reference.kv import kv_format

    a = bench.llama8b_args(32, 2048, args.smoke)
    model, _ = bench.build_models(a, args.device, with_hf=False)
    with torch.inference_mode():
        model.fuse()
        dec = Decoder(model, kv_format("fp16", torch.float16), 1, 1024 + 16, torch.device(args.device), torch.float16)
        dec.prepare()
        dec.fill_synthetic(1024)
        tok = dec.step(torch.zeros(1, dtype=torch.long, device=args.device)).argmax(-1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            tok = dec.step(tok).argmax(-1)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t) * 1e6 / 3
        prof = bench.profile_steps(dec, tok, 3, top=20)
    prof["wall_us_per_step"] = round(wall_us, 1)
    prof["gap_us_per_step"] = round(wall_us - prof["gpu_us_per_step"], 1)  # host and inter-node time
    prof["launches_per_step"] = round(sum(r["launches_per_step"] for r in prof["top"]), 1)  # the top kernels'
    from engines.reference.step_plan import plan_decode_step

    plan = plan_decode_step(a, "fp16", 1, 1024)  # the same step counted on the meta device, beside the profile
    prof["planned_launches_per_step"] = round(plan.per_layer * a.n_layers + plan.once, 1)
    prof["planned_layer_ops"] = plan.layer_ops
    f.save(**prof, cuda_graphs=dec.graphs_reason, complete=True)
    return True


RUN = {"S0": stage_s0, "S1": stage_s1, "S2": stage_s2, "S3": stage_s3, "S4": stage_s4, "S5": stage_s5}


def child(args) -> int:
    if args.device == "cpu":  # the rehearsal takes the GPU's code paths, kernels on the Triton interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("CANARY_KERNELS", "triton")
    sys.path.insert(0, str(ROOT))
    f = StageFile(args.out, args.stage, args)
    try:
        ok = RUN[args.stage](args, f)
    except Exception as e:  # noqa: BLE001 - the stage's JSON says what went wrong
        import traceback

        traceback.print_exc(file=sys.stderr)
        f.save(error=f"{type(e).__name__}: {e}"[:800])
        return 1
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        return child(args)
    if args.device.startswith("cuda"):
        try:
            import torch

            if not torch.cuda.is_available():
                print(json.dumps({"benchmark": "gpu_slot", "skipped": "no CUDA device here (--device cpu --smoke rehearses)"}))
                return 0
        except ImportError:
            print(json.dumps({"benchmark": "gpu_slot", "skipped": "torch is not installed"}))
            return 0
    start = time.monotonic()
    summary: dict = {"benchmark": "gpu_slot", "deadline_s": args.deadline, "device": args.device, "smoke": args.smoke, "stages": {}}
    for stage in args.only or STAGES:
        left = args.deadline - (time.monotonic() - start)
        name = f"{stage}_{NAMES[stage]}"
        if left < ESTIMATE_S[stage] * (0.2 if args.smoke else 0.6):
            summary["stages"][name] = {"skipped": f"{left:.0f} s left of the deadline, about {ESTIMATE_S[stage]} s needed"}
            progress(f"{name}: skipped ({left:.0f} s left)")
            continue
        progress(f"{name}: start ({left:.0f} s left)")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--out", str(args.out), "--device", args.device,
               "--repeats", str(args.repeats), *(["--smoke"] if args.smoke else [])]
        t = time.monotonic()
        try:
            code: int | None = subprocess.run(cmd, cwd=ROOT, timeout=max(1.0, left - 2)).returncode
            why = None
        except subprocess.TimeoutExpired:
            code, why = None, f"stopped at the deadline after {time.monotonic() - t:.0f} s"
        wall = round(time.monotonic() - t, 1)
        path = args.out / f"{name}.json"
        if why and path.exists():  # what the stage had written stays; say it was cut
            d = json.loads(path.read_text())
            d["error"] = why
            path.write_text(json.dumps(d, indent=1))
        summary["stages"][name] = {"file": path.name, "exit_code": code, "wall_s": wall, **({"error": why} if why else {})}
        progress(f"{name}: {'ok' if code == 0 else why or f'exit {code}'} ({wall} s)")
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary["wall_s"] = round(time.monotonic() - start, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    # 0 only when every stage asked for ran to its end with its checks holding
    return 0 if all(s.get("exit_code") == 0 for s in summary["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
