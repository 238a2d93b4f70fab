"""The decode-attention kernels compiled for Hopper (sm_90) on this CPU, as a launch compiles them
(each format's launch shape, pointers and multiples of 16 specialized), by
benchmarks/kernel_resources.py: each compiles, and its main loop stays within its budget of SASS
instructions per lane per cached element. The budgets hold what the H200 runs measured
(benchmarks/results/gpu/README.md, runs 3-5): a kernel that grows past them got slower on the GPU
before anyone ran it there."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# lane instructions per cached element (keys and values) in the main loop, at head_dim 128, G = 4
BUDGETS = {
    "float_attention_kernel cache=fp8e4nv": 6.0,  # 4.4 at 128-slot tiles: memory-bound
    "float_attention_kernel cache=fp16": 6.0,
    # TurboQuant: 3-bit codes as nibbles read by byte permutes, 4.3 (23.5 with bit-planes and the
    # codebook polynomial before, 32.6 with an 8-way select before that: the GPU review's budget is 7);
    # 2 and 4 bits in 2- and 4-bit fields through the polynomial, 13.0 and 20.4 (17.3 and 32.7 as planes);
    # compiled as the fused decode step launches them, the query's RoPE in the prologue (ROPE)
    "attention_kernel BITS=2 F=2 LUT=False ROPE=True D=128": 15.0,
    "attention_kernel BITS=3 F=4 LUT=True ROPE=True D=128": 7.0,
    "attention_kernel BITS=4 F=4 LUT=False ROPE=True D=128": 23.0,
    # KIVI, in its loop over wholly compressed tiles (scales folded into the query and the weights,
    # codes made fp16 two a LOP3): 6.0 and 6.9 (14.6 and 14.7 before, dequantizing each element;
    # the GPU review's budget is 7). Its loop over the tiles that mix tiers keeps the old bound
    "attention_kernel GROUP=32 BITS=2": 7.0,
    "attention_kernel GROUP=32 BITS=4": 7.0,
}
MIXED_TILES = 24.0  # KIVI's loop over the few tiles at its window that mix compressed and raw slots


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real, not interpret
    out = subprocess.run([sys.executable, "benchmarks/kernel_resources.py", "--only", "decode-attention"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.integration
def test_decode_attention_kernels_compile_for_sm90_within_their_instruction_budgets(compiled):
    rows = [r for r in compiled["kernels"] if r["kernel"] != "merge_kernel"]
    assert not [r for r in compiled["kernels"] if "error" in r]
    assert len(rows) == len(BUDGETS)
    for row in rows:
        name = f"{row['kernel']} {row['config']}"
        budget = next(b for key, b in BUDGETS.items() if name.startswith(key))
        assert 0 < row["lane_instructions_per_element"] <= budget, (name, row)
        if "longest_loop_lane_instructions_per_element" in row:
            assert row["longest_loop_lane_instructions_per_element"] <= MIXED_TILES, (name, row)
        assert row["shared_bytes"] <= 232448, name  # an H100/H200 SM's limit


W4A16_BUDGET = 4.5  # lane-instructions per weight, the GPU review's budget (gemv1: 6.6-12.4)


@pytest.mark.integration
def test_the_tensor_core_w4a16_gemv_compiles_for_sm90_within_its_budget_in_every_configuration():
    # every autotune configuration of gemv_mma_kernel (the decode GEMV on CUDA), as a launch
    # compiles it: 3.9 a weight at 256 x 64, 4.4 at 128 x 128; none spills
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "benchmarks/kernel_resources.py", "--only", "w4a16"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])["kernels"]
    from engines.kernels._w4a16_triton import gemv_mma_configs

    assert len(rows) == len(gemv_mma_configs()) and not [r for r in rows if "error" in r]
    for row in rows:
        assert 0 < row["lane_instructions_per_element"] <= W4A16_BUDGET, row
        assert row["stack_bytes"] == 0 and row["shared_bytes"] <= 232448, row
