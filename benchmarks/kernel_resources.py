"""Registers, stack (spills) and shared memory of every Triton kernel configuration, compiled
ahead of time for a GPU target — no GPU needed. One JSON object.

The W4A16 batch-1 GEMV's configurations (gemv1_configs) and the GEMV's (engines/kernels/_w4a16_triton.py gemv_configs) at each
decode batch padding (M_PAD 2, 4, 8, 16), and the TurboQuant / fp8 / KIVI decode-attention and
quantize kernels at head_dim 128, are compiled with the installed Triton for `--arch` (default 90,
Hopper) and read back with the cuobjdump that ships with Triton. A kernel that spills (stack > 0)
or needs more shared memory than the SM has runs, but slowly: the GEMV and attention
configurations are chosen so that none does. Triton's version is printed: a GPU machine's Triton may
allocate differently.

    python benchmarks/kernel_resources.py [--arch 90]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


DIV16 = ("S", "SG", "stride_b", "stride_h", "code_sb", "code_sh", "norm_sb", "norm_sh")  # multiples of 16 at 8B shapes
DIV16_W4A16 = (*DIV16, "N", "K")  # a W4A16 launch at the 8B shapes specializes its N and K too


def main_loop_instructions(sass: str, first: bool = False) -> int:
    """SASS instructions of a kernel's main loop: the longest span that a backward branch closes
    (where the loop body has branches of its own, both sides count); first: the loop that starts
    first in the code instead (KIVI's loop over its wholly compressed tiles, which comes before the
    longer one over the few tiles that mix tiers)."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    for addr, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr:
            loops.append((int(t.group(1), 16), addr))
    if not loops:
        return 0
    outer = [s for s in loops if not any(o != s and o[0] <= s[0] and s[1] <= o[1] for o in loops)]
    lo, hi = min(outer) if first else max(loops, key=lambda span: span[1] - span[0])
    return sum(lo <= addr <= hi for addr, _, _ in ins)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability ×10 (90 = H100/H200, 80 = A100)")
    ap.add_argument("--only", choices=("all", "decode-attention", "w4a16"), default="all",
                    help="decode-attention: just those kernels at their launch shapes; w4a16: the tensor-core decode "
                         "GEMV's configurations (what the budget tests compile)")
    args = ap.parse_args()
    import triton
    from engines.kernels import _kivi_kv_triton as kivi
    from engines.kernels import _turbo_kv_triton as turbo
    from engines.kernels import _w4a16_triton as w4a16
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out: dict = {"benchmark": "kernel_resources", "triton": triton.__version__, "arch": f"sm_{args.arch}", "kernels": []}

    def compile_one(fn, sig: dict, consts: dict, options: dict, label: str, elements: int | None = None,
                    first_loop: bool = False, div16: tuple[str, ...] = DIV16) -> None:
        """Compile as a launch would: pointers (torch allocations) and the ints named in DIV16
        specialized as multiples of 16. elements: what one trip of the kernel's main loop
        processes; the row then gets the loop's SASS instructions per element per lane."""
        full = {name: ("constexpr" if name in consts else sig[name]) for name in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
                 if n not in consts and (t.startswith("*") or n in div16)}
        row: dict = {"kernel": fn.__name__, "config": label}
        try:
            k = triton.compile(ASTSource(fn, full, consts, attrs), target=target, options=options)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
                sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True).stdout if elements else ""
            m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
            row.update(registers=int(m.group(1)), stack_bytes=int(m.group(2)), shared_bytes=int(m.group(3)) + int(k.metadata.shared))
            if elements:
                n = main_loop_instructions(sass, first_loop)
                row.update(loop_instructions=n, lane_instructions_per_element=round(n * options["num_warps"] * 32 / elements, 1))
                if first_loop:
                    m = main_loop_instructions(sass)
                    row.update(longest_loop_instructions=m,
                               longest_loop_lane_instructions_per_element=round(m * options["num_warps"] * 32 / elements, 1))
        except Exception as e:  # noqa: BLE001 — a config that does not compile is a finding, not a crash
            row["error"] = f"{type(e).__name__}: {str(e)[-300:]}"
        out["kernels"].append(row)

    if args.only == "all":
        gemv_sig = dict(x_ptr="*fp16", qw_ptr="*i32", qz_ptr="*i32", s_ptr="*fp16", y_ptr="*fp32", M="i32", N="i32", K="i32")
        for m_pad in (2, 4, 8, 16):  # batch 1 is gemv1_kernel's
            for c in w4a16.gemv_configs():
                kw = c.kwargs
                compile_one(w4a16.gemv_kernel, gemv_sig, dict(GROUP=128, M_PAD=m_pad, **kw),
                            dict(num_warps=c.num_warps, num_stages=c.num_stages),
                            f"M_PAD={m_pad} BLOCK_N={kw['BLOCK_N']} BLOCK_K={kw['BLOCK_K']} SPLIT_K={kw['SPLIT_K']} "
                            f"warps={c.num_warps} stages={c.num_stages}", div16=DIV16_W4A16)
    if args.only in ("all", "w4a16"):  # the tensor-core decode GEMV: lane-instructions per weight in its loop
        mma_sig = dict(x_ptr="*fp16", qw_ptr="*i32", qz_ptr="*i32", s_ptr="*fp16", y_ptr="*fp32", M="i32", N="i32", K="i32")
        for c in w4a16.gemv_mma_configs():
            kw = c.kwargs
            compile_one(w4a16.gemv_mma_kernel, mma_sig, dict(GROUP=128, PAIRS=True, **kw),
                        dict(num_warps=c.num_warps, num_stages=c.num_stages),
                        f"BLOCK_N={kw['BLOCK_N']} BLOCK_K={kw['BLOCK_K']} SPLIT_K={kw['SPLIT_K']} "
                        f"warps={c.num_warps} stages={c.num_stages}", elements=kw["BLOCK_N"] * kw["BLOCK_K"], div16=DIV16_W4A16)
    if args.only == "all":
        gemv1_sig = dict(x_ptr="*fp16", qw_ptr="*i32", qz_ptr="*i32", s_ptr="*fp16", y_ptr="*fp32", N="i32", K="i32")
        for c in w4a16.gemv1_configs():
            kw = c.kwargs
            compile_one(w4a16.gemv1_kernel, gemv1_sig, dict(GROUP=128, **kw), dict(num_warps=c.num_warps, num_stages=c.num_stages),
                        f"W={kw['W']} BLOCK_K={kw['BLOCK_K']} SPLIT_K={kw['SPLIT_K']} warps={c.num_warps} stages={c.num_stages}",
                        div16=DIV16_W4A16)
    if args.only == "w4a16":
        return finish(out)
    import torch
    import triton.language as tl
    from engines.kernels import _decode_triton as dec
    from engines.kernels import fp8_kv, kivi_kv, turbo_kv
    from engines.kernels.decode import FLOAT_TUNING, GROUP_ROWS

    def launch_of(t, **consts):  # a format's Tuning → (constexprs, options, label, elements per loop trip: K and V)
        c = dict(D=128, G=4, GP=GROUP_ROWS, BLOCK_S=t.block_s, DOT=tl.float16, **consts)  # Llama-3-8B: 32 heads on 8
        label = " ".join(f"{k}={v}" for k, v in consts.items()) + f" D=128 G=4 BLOCK_S={t.block_s} warps={t.num_warps} stages={t.num_stages}"
        return c, {"num_warps": t.num_warps, "num_stages": t.num_stages}, label.strip(), 2 * t.block_s * 128

    split = dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", HKV="i32", S="i32")
    attn_sig = dict(q_ptr="*fp16", kc_ptr="*i32", kn_ptr="*fp32", vc_ptr="*i32", vn_ptr="*fp32", len_ptr="*i64",
                    poly_ptr="*fp32", rot_ptr="*fp32", cos_ptr="*fp16", sin_ptr="*fp16", **split, code_sb="i32",
                    code_sh="i32", norm_sb="i32", norm_sh="i32", scale="fp32", la="i32", lb="i32", ha="i32", hb="i32",
                    q_sb="i32", cos_sb="i32")
    for bits in (2, 3, 4):  # as the fused decode step launches it: the query's RoPE in the kernel (ROPE)
        compile_one(turbo.attention_kernel, attn_sig, *launch_of(turbo_kv.TUNING[bits], BITS=bits, F=turbo_kv.field_bits(bits),
                                                                 LUT=turbo_kv.byte_lookup(bits, torch.float16, "cuda"), ROPE=True))
        if args.only == "all":
            strides = {name: "i32" for name in ("x_sb", "x_sh", "x_st", "y_sb", "y_sh", "y_st", "c_kv", "c_sb", "c_sh",
                                                  "c_ss", "n_kv", "n_sb", "n_sh", "n_ss", "d_sb", "d_sh", "d_ss",
                                                  "cos_sb", "cos_st")}
            write_sig = dict(x_ptr="*fp16", y_ptr="*fp16", slot_ptr="*i64", rot_ptr="*fp32", book_ptr="*fp32",
                             codes_ptr="*i32", norms_ptr="*fp32", dx_ptr="*fp16", dy_ptr="*fp16", cos_ptr="*fp16",
                             sin_ptr="*fp16", N="i32", T="i32", HKV="i32", **strides)
            # the fused decode step's launch: RoPE of the keys as they are read (ROPE), no shadow
            compile_one(turbo.write_kernel, write_sig, dict(D=128, BITS=bits, F=turbo_kv.field_bits(bits), BLOCK_N=16,
                                                            DEQUANT=False, ROPE=True),
                        {"num_warps": turbo_kv.WRITE_WARPS}, f"D=128 bits={bits} BLOCK_N=16 ROPE warps={turbo_kv.WRITE_WARPS}")
    for cache, tuning in (("fp8e4nv", fp8_kv.TUNING), ("fp16", FLOAT_TUNING)):
        consts, options, label, elements = launch_of(tuning)
        compile_one(dec.float_attention_kernel, dict(q_ptr="*fp16", k_ptr=f"*{cache}", v_ptr=f"*{cache}", len_ptr="*i64",
                                                     **split, stride_b="i32", stride_h="i32", scale="fp32"),
                    consts, options, f"cache={cache} {label}", elements)
    kivi_sig = dict(q_ptr="*fp16", kc_ptr="*i32", ks_ptr="*fp32", kz_ptr="*fp32", vc_ptr="*i32", vs_ptr="*fp32",
                    vz_ptr="*fp32", k_ptr="*fp16", v_ptr="*fp16", len_ptr="*i64", nk_ptr="*i64", nv_ptr="*i64",
                    **split, SG="i32", scale="fp32")
    for bits in (2, 4):  # per element in the loop over wholly compressed tiles; the mixed tiles' loop beside it
        compile_one(kivi.attention_kernel, kivi_sig, *launch_of(kivi_kv.TUNING, GROUP=32, BITS=bits,
                                                                PAIRS=kivi_kv.pair_codes(torch.float16, "cuda")),
                    first_loop=True)
    compile_one(dec.merge_kernel, dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", rot_ptr="*fp32", out_ptr="*fp16",
                                       NC="i32"), dict(D=128, NCP=64, ROTATE=True), {"num_warps": 4}, "D=128 NCP=64 ROTATE")
    return finish(out)


def finish(out: dict) -> int:
    """The summary beside the rows, and the one JSON object printed."""
    rows = out["kernels"]
    out["summary"] = {"compiled": sum("error" not in r for r in rows), "failed": sum("error" in r for r in rows),
                      "lane_instructions_per_element": {
                          f"{r['kernel']} {r['config']}": r["lane_instructions_per_element"]
                          for r in rows if "lane_instructions_per_element" in r},
                      "spilling": [f"{r['kernel']} {r['config']} ({r['stack_bytes']} B)" for r in rows if r.get("stack_bytes")]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.exit(main())
