"""benchmarks/kernel_bench.py without a GPU: `--help` runs nothing; without CUDA it says why and exits 0;
the CPU smoke run (tiny shapes, kernels on the Triton interpreter, 1 repeat) prints one JSON
object whose kernel-vs-reference checks all hold, whose decode matches transformers' generate on
the same weights, and whose every timed figure carries its spread; a failed check exits 1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # subprocess runs of benchmarks/kernel_bench.py

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernel_bench.py"


def run(*argv: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("CANARY_KERNELS", None)
    cmd = [sys.executable, "-c", code] if code else [sys.executable, str(SCRIPT), *argv]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


def last_json(p: subprocess.CompletedProcess) -> dict:
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_help_prints_usage_and_runs_nothing():
    code = (f"import runpy, sys\nsys.argv = [{str(SCRIPT)!r}, '--help']\n"
            f"try:\n    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules, '--help imported torch'\nprint('HELP-ONLY')")
    p = run(code=code)
    assert p.returncode == 0, p.stderr
    assert "usage: benchmarks/kernel_bench.py" in p.stdout and "--repeats" in p.stdout and "--long-context" in p.stdout
    assert p.stdout.strip().endswith("HELP-ONLY")  # no JSON: nothing was measured


def test_cpu_without_smoke_is_refused():
    p = run("--device", "cpu")
    assert p.returncode == 2 and "--smoke" in p.stderr and p.stdout == ""


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this host has CUDA")
def test_no_cuda_skips_with_a_reason():
    p = run()
    assert p.returncode == 0, p.stderr
    assert "no CUDA device" in last_json(p)["skipped"]


def test_cpu_smoke_checks_hold_and_figures_have_spread():
    p = run("--device", "cpu", "--smoke")
    assert p.returncode == 0, p.stderr[-4000:]
    d = last_json(p)
    assert d["smoke"] and d["triton_interpreter"] and d["errors"] == {}
    assert d["all_checks_equal"] and {c["check"].split()[0] for c in d["checks"]} == {"w4a16", "grouped_fp16", "turbo3", "kivi2", "fp8"}
    # the yardstick: the read stream divides; the copy is eager (the graph copy is CUDA only)
    ys = d["yardstick"]
    assert ys["read_bandwidth"]["sum_equal"] and ys["read_bandwidth"]["GBps"]["median"] > 0
    assert ys["copy_bandwidth"]["timing"].startswith("eager") and "graph_copy_bandwidth" not in ys
    assert all(c["equal"] and c["max_abs_error"] <= c["tolerance"] for c in d["checks"])
    assert {(r["K"], r["N"], r["batch"]) for r in d["w4a16"]} == {(128, 64, 1), (128, 64, 16), (128, 64, 32)}
    for r in d["w4a16"]:
        if r.get("prefill"):  # both prefill paths timed beside fp16, each checked against the reference
            for p in ("tiled_ms", "dequant_matmul_ms", "torch_fp16_ms"):
                assert set(r[p]) == {"median", "min", "max", "repeats"}, p
            assert r["auto_path"] == "dequant" and r["faster_path"] in ("tiled", "dequant")  # 32 rows: past the GEMV's 16
            continue
        assert set(r["w4a16_ms"]) == set(r["torch_fp16_ms"]) == {"median", "min", "max", "repeats"}
        assert r["speedup_vs_fp16"]["target"] and r["speedup_vs_fp16"]["meets_target"] is None  # smoke says nothing
    assert {c["check"] for c in d["checks"]} >= {"w4a16 128x64 prefill 32 rows, tiled", "w4a16 128x64 prefill 32 rows, dequant"}
    assert [(r["context"], r["batch"]) for r in d["decode_attention"]] == [(64, 1), (64, 2)]
    for att in d["decode_attention"]:
        assert all(att[k]["equal_to_reference"] and "median" in att[k]["ms"] for k in ("grouped_fp16", "turbo3", "kivi2", "fp8"))
        # cold L2 against the smoke's 1 MiB: the 16 KB caches are rotated through hundreds of copies
        assert att["cold_l2"]["l2_bytes"] == 1 << 20 and att["cold_l2"]["sets"]["turbo3"] > att["cold_l2"]["sets"]["sdpa_fp16"] > 1
    assert all(r["cold_l2"]["w4a16_sets"] >= r["cold_l2"]["fp16_sets"] >= 1 for r in d["w4a16"] if not r.get("prefill"))
    dec = d["decode_8b"]
    got = {(c["weights"], c["kv_cache"], c["context"]) for c in dec["configs"]}
    assert got == {("fp16", kv, 16) for kv in ("fp16", "fp8", "kivi-2", "turbo-3")} | {
        ("fp16", kv, 32) for kv in ("fp16", "fp8", "turbo-3", "kivi-2")} | {("rtn-int4", kv, 16) for kv in ("fp16", "turbo-3")}
    assert all(c["tokens_same_every_run"] and "median" in c["decode_tok_s"] for c in dec["configs"])
    fp16 = next(c for c in dec["configs"] if c["kv_cache"] == "fp16" and c["context"] == 16 and c["weights"] == "fp16")
    assert fp16["bandwidth_bound"]["tok_s"] > 0 and "read-bandwidth bound" in fp16["target"]["target"]
    peer = dec["transformers_generate"]["eager_dynamic_cache"]
    assert peer["agreement_with_ours_fp16"]["prefill_top1_equal"]
    assert peer["agreement_with_ours_fp16"]["tokens_identical"], peer
    tiny = d["tiny_model"]
    if "skipped" not in tiny:  # needs pydantic (the GPU image may lack it)
        assert set(tiny["weights"]) == {"fp16", "rtn-int4"}
        assert all("median" in tiny["weights"][w]["cpu"]["decode_tok_s"] for w in tiny["weights"])
        loops = tiny["loops"]["cpu"]  # reused decode loops and the static verify pass against their peers
        assert loops["decode_loops"]["same_tokens"] and loops["speculative_verify"]["same_tokens"]
        assert loops["decode_loops"]["on"]["reuse_decoders"] and not loops["decode_loops"]["off"]["reuse_decoders"]


def test_a_failed_check_exits_1_after_printing_the_json():
    code = (f"import sys\nsys.argv = ['kernel_bench.py', '--device', 'cpu', '--smoke', '--skip', 'attention', 'decode', 'tiny']\n"
            "import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('bench_kernels', {str(SCRIPT)!r})\n"
            "m = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(m)\n"
            "real = m.check\nm.check = lambda *a, **k: {**real(*a, **k), 'equal': False}\nsys.exit(m.main())")
    p = run(code=code)
    assert p.returncode == 1, p.stderr[-4000:]
    d = last_json(p)
    assert d["all_checks_equal"] is False and len(d["checks"]) == 6  # batch 1 and 16 (each GEMV), both prefill paths


def test_a_failing_decode_config_costs_its_row_only():
    # an OOM in one config (KIVI's 32K prefill on the card, say) must not discard the section:
    # that row records the error, the others are measured, the run exits 1 with the JSON printed
    code = (f"import sys\nsys.argv = ['kernel_bench.py', '--device', 'cpu', '--smoke', '--no-hf', '--skip', 'w4a16', 'attention', 'tiny']\n"
            "import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('bench_kernels', {str(SCRIPT)!r})\n"
            "m = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(m)\n"
            "real = m.decode_run\n"
            "def fake(clock, model, kv, ids, *a, **k):\n"
            "    if kv == 'kivi-2' and ids.shape[1] == 32:\n"
            "        raise RuntimeError('CUDA out of memory. Tried to allocate 64.00 GiB')\n"
            "    return real(clock, model, kv, ids, *a, **k)\n"
            "m.decode_run = fake\nsys.exit(m.main())")
    p = run(code=code)
    assert p.returncode == 1, p.stderr[-4000:]
    d = last_json(p)
    rows = {(c["weights"], c["kv_cache"], c["context"]): c for c in d["decode_8b"]["configs"]}
    assert len(rows) == 10
    bad = rows[("fp16", "kivi-2", 32)]
    assert "out of memory" in bad["error"] and "decode_tok_s" not in bad
    assert all("median" in c["decode_tok_s"] for k, c in rows.items() if k != ("fp16", "kivi-2", 32))
    assert list(d["errors"]) == ["decode_8b fp16/kivi-2/32"]
    assert "decode fp16 weights, kivi-2 KV, context 32: RuntimeError" in p.stderr  # the progress line
