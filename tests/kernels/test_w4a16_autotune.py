"""The int4 prefill GEMM autotunes once per power-of-two bucket of M, not once per prompt length:
on CUDA each tuning times 7 configurations (~3-4 s over the 4 linear shapes), and it happens
inside the TTFT of the request that brings a new length. Here the autotuner runs (on the Triton
interpreter without CUDA) with its timing stubbed, and each configuration it would time is counted."""

import pytest
import torch
from engines.kernels import _w4a16_triton as k
from engines.kernels.w4a16 import w4a16_reference, w4a16_triton
from engines.quant import pack_awq_gemm, quantize_groupwise
from triton.runtime.autotuner import Autotuner


@pytest.fixture
def timed_configs(monkeypatch):
    """Counts the autotuner's configuration timings; the first configuration (the smallest
    tiles, the interpreter's quickest) always wins."""
    runs = []

    def fake_bench(self, *args, config, **meta):
        runs.append((self.fn.__name__, tuple(sorted(config.kwargs.items()))))
        return [float(self.configs.index(config)), 0.0, 0.0]

    monkeypatch.setattr(Autotuner, "_bench", fake_bench)
    monkeypatch.setattr(k, "_autotuned", {})  # a fresh tuner (an empty cache) for this test
    monkeypatch.setattr(k, "CACHE_TUNING", False)  # on CUDA: no stubbed timings read from or left on disk
    return runs


def test_new_prompt_lengths_reuse_their_buckets_tuning(timed_configs, device):
    K, N = 128, 64
    g = torch.Generator().manual_seed(0)
    q, s, z = quantize_groupwise(torch.randn(N, K, generator=g) / K**0.5, 4)
    qw, qz, sc = (t.to(device) for t in pack_awq_gemm(q, z, s))
    lengths = range(17, 41)  # 24 prompt lengths: buckets 32 (17-32) and 64 (33-40)
    for M in lengths:  # the tiled GEMM, as prefill="tiled" asks (the default dequantizes from 17 rows)
        x = torch.randn(M, K, generator=g).to(device)
        y = w4a16_triton(x, qw, qz, sc, tune=True, prefill="tiled")
        torch.testing.assert_close(y, w4a16_reference(x, qw, qz, sc), rtol=1e-4, atol=1e-4)
    per_tuning = len(k.gemm_configs(x.element_size()))  # fp32 inputs: fewer tiles fit shared memory
    buckets = {k.m_bucket(M) for M in lengths}
    assert buckets == {32, 64}
    # at most one tuning per bucket (keyed on the exact M it was 24 tunings: 168 timings)
    assert len(timed_configs) == per_tuning * len(buckets), len(timed_configs)
    # the default path from 17 rows: dequantize (one fixed tile) then matmul, no tuning at any length
    before = len(timed_configs)
    for M in (17, 23, 41, 100):
        x = torch.randn(M, K, generator=g).to(device)
        torch.testing.assert_close(w4a16_triton(x, qw, qz, sc, tune=True), w4a16_reference(x, qw, qz, sc),
                                   rtol=1e-4, atol=1e-4)
    assert len(timed_configs) == before


def test_decode_batches_tune_once_per_padded_batch(timed_configs, device):
    K, N = 128, 64
    g = torch.Generator().manual_seed(1)
    q, s, z = quantize_groupwise(torch.randn(N, K, generator=g) / K**0.5, 4)
    qw, qz, sc = (t.to(device) for t in pack_awq_gemm(q, z, s))
    for M in (1, 2, 3, 4, 16):  # the batch-1 GEMV, then M_PAD 2, 4, 4, 16
        x = torch.randn(M, K, generator=g).to(device)
        torch.testing.assert_close(w4a16_triton(x, qw, qz, sc, tune=True), w4a16_reference(x, qw, qz, sc),
                                   rtol=1e-4, atol=1e-4)
    assert len(timed_configs) == len(k.gemv1_configs()) + len(k.gemv_configs()) * 3


def test_prefill_gemm_row_offsets_are_int64():
    """Static: the GEMM addresses x and y at rm·K and rm·N, which pass 2³¹ within the contexts an
    8B model allows (gate_up N = 28672 at 128K tokens: 3.8·10⁹), so its row index must be int64
    before it is multiplied (an int32 product wraps and reads or writes out of bounds)."""
    import ast
    import inspect
    import textwrap

    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # K, N
    longest = 131072
    assert max(longest * max(K, N) for K, N in shapes.values()) >= 2**31  # int32 is not enough
    fn = k.gemm_kernel.fn if hasattr(k.gemm_kernel, "fn") else k.gemm_kernel
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    rm = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
          and any(isinstance(t, ast.Name) and t.id == "rm" for t in n.targets)]
    assert len(rm) == 1, "gemm_kernel assigns its row index rm once"
    cast = rm[0]
    assert (isinstance(cast, ast.Call) and isinstance(cast.func, ast.Attribute) and cast.func.attr == "to"
            and ast.unparse(cast.args[0]) == "tl.int64"), f"rm = {ast.unparse(cast)}: cast it .to(tl.int64)"
    # every x / y address is built from rm (so from the int64 index), never from pid_m directly
    src = ast.unparse(tree)
    assert "pid_m * BLOCK_M" in ast.unparse(cast) and src.count("pid_m") == 2, src


def test_fp32_gemm_tiles_fit_shared_memory():
    """On an H200 every fp32 GEMM configuration with the fp16 stage counts asked for more shared
    memory than an SM has (303104 > 232448 bytes) and the launch raised OutOfResources. fp32 tiles
    are cut to the budget; 2-byte inputs keep the tuned stages."""
    fp32 = k.gemm_configs(4)
    assert fp32, "at least one fp32 tile fits"
    for c in fp32:
        per = k.gemm_stage_bytes(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], 4)
        assert c.num_stages * per <= k.SMEM_BUDGET, c
    assert [c.num_stages for c in k.gemm_configs(2)] == [t[4] for t in k.GEMM_TILES]
