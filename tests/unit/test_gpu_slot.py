"""benchmarks/gpu_slot.py rehearsed on the CPU (tiny shapes, the GPU's code paths on the Triton
interpreter): every stage writes its own JSON, complete and with its checks holding; the synthetic
cache of each KV format is written through its own write path and holds only the format's bytes;
a deadline too short for a stage skips it, and a stage cut at the deadline keeps what it wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # subprocess runs of benchmarks/gpu_slot.py

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_slot.py"


def run(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CANARY_KERNELS", "TRITON_INTERPRET")}
    return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)


def stage(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def test_cpu_rehearsal_runs_every_stage(tmp_path):
    p = run("--device", "cpu", "--smoke", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert list(summary["stages"]) == ["S0_capacity", "S1_yardstick", "S2_w4a16", "S3_attention", "S4_decode", "S5_profile"]
    assert all(s["exit_code"] == 0 for s in summary["stages"].values())
    s0 = stage(tmp_path, "S0_capacity")
    assert s0["complete"] and s0["meets_target"] and s0["formats"]["turbo-3"]["vs_fp16_bytes"] == pytest.approx(68 / 256, abs=1e-3)  # 16 nibble words + a norm
    s1 = stage(tmp_path, "S1_yardstick")
    assert s1["complete"] and s1["read_bandwidth"]["sum_equal"] and s1["copy_bandwidth"]["timing"].startswith("eager")
    for name in ("S2_w4a16", "S3_attention"):
        d = stage(tmp_path, name)
        assert d["complete"] and d["all_checks_equal"] and d["checks"], name
        assert d["predicted"] and d["target"]  # pre-registered beside the figures
    s4 = stage(tmp_path, "S4_decode")
    assert s4["complete"] and s4["errors"] == {}
    rows = {(r["weights"], r["kv_cache"], r["batch"]): r for r in s4["rows"]}
    assert set(rows) == {("fp16", "fp16", 1), ("fp16", "fp16", 2), ("fp16", "fp8", 2), ("fp16", "turbo-3", 2),
                         ("fp16", "kivi-2", 2), ("rtn-int4", "fp16", 1)}
    wide = {kv: rows[("fp16", kv, 2)] for kv in ("fp16", "fp8", "turbo-3", "kivi-2")}
    # the kernel path's stores: codes only for fp8 and turbo-3 (turbo-3 at head_dim 64: 8 nibble words + a norm = 36 B of 128)
    assert wide["fp8"]["kv_cache_bytes"] * 2 == wide["fp16"]["kv_cache_bytes"]
    assert wide["turbo-3"]["kv_cache_bytes"] * 128 == wide["fp16"]["kv_cache_bytes"] * 36
    assert all("median" in r["decode_tok_s"] and r["bytes_bound_tok_s"] > 0 for r in rows.values())
    assert "vs_fp16" in wide["turbo-3"] and "bytes_model_ceiling_vs_fp16" in wide["turbo-3"]


def test_a_short_deadline_skips_what_does_not_fit_and_cuts_what_overruns(tmp_path):
    # S4's rehearsal at 8 repeats takes minutes here (at 1 repeat, 24 s on a fast machine: too short
    # to be cut), and its estimate admits it with 30 s left: given 31 s it starts, is stopped at the
    # deadline keeping its JSON, and S5 is skipped for want of time
    p = run("--device", "cpu", "--smoke", "--repeats", "8", "--out", str(tmp_path), "--deadline", "31",
            "--only", "S4", "S5")
    assert p.returncode == 1
    got = json.loads(p.stdout.strip().splitlines()[-1])["stages"]
    assert "stopped at the deadline" in got["S4_decode"]["error"]
    kept = stage(tmp_path, "S4_decode")
    assert "stopped at the deadline" in kept["error"] and kept["complete"] is False
    assert "s left of the deadline" in got["S5_profile"]["skipped"]
    assert (tmp_path / "summary.json").exists()
