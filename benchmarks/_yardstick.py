"""The yardstick every GPU figure is divided by, and cold-L2 inputs for the kernel timings.

- copy_bandwidth: a 1 GiB device-to-device copy timed EAGERLY (CUDA events around each call; a
  call takes ~0.5 ms on an H200, so host dispatch is not in it). The same copy replayed from a
  CUDA graph reads ~35 % slower (2.7 against 4.26 TB/s on an H200: the graph makes a memcpy node
  of its own; pytorch/pytorch#191284), which made every "fraction of bandwidth" before it look
  better than it was. graph_copy_bandwidth keeps that figure, to document the gap, never to divide by.
- read_bandwidth: a Triton kernel that reads a 2 GiB buffer once and writes one float per
  program. Decode is read-dominated (weights and KV are read, a few KB written), so every bound
  and every fraction of bandwidth divides by this read figure.
- cold_sets: how many copies of a kernel's inputs a timing rotates through so that no call finds
  the previous call's bytes in L2 (the copies together ≥ 4 × the L2 size). A copy made by clone()
  is as cold as fresh random data: L2 is addressed by address, not by content.

Shapes: n bytes. Nothing here needs pydantic or the engine.
"""

from __future__ import annotations

import math
import statistics

READ_BLOCK = 4096  # fp32 elements a program reads per iteration (16-byte vector loads)
READ_ITERS = 64  # iterations per program: 1 MiB read by each program
COLD_FACTOR = 4  # the rotated copies together span at least this many L2s
COLD_CAP_BYTES = 8 << 30  # never more than this in rotated copies (a 128K cache needs none)


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))

    return read_sum_kernel


def read_sum(x):
    """Σ x (fp32, 1-D) by the read-stream kernel → [programs] partial sums (their sum is Σ x)."""
    import torch

    kernel = _read_kernel()
    n = x.numel()
    programs = math.ceil(n / (READ_BLOCK * READ_ITERS))
    out = torch.empty(programs, dtype=torch.float32, device=x.device)
    kernel[(programs,)](x, out, n, BLOCK=READ_BLOCK, ITERS=READ_ITERS, num_warps=8)
    return out


def _spread(xs: list[float], nd: int = 4) -> dict:
    return {"median": round(statistics.median(xs), nd), "min": round(min(xs), nd), "max": round(max(xs), nd),
            "repeats": len(xs)}


def _gbps(nbytes: int, ms: dict) -> dict:
    def g(m: float) -> float:
        x = nbytes / (m / 1000) / 1e9
        return round(x, 1) if x >= 100 else float(f"{x:.3g}")  # the interpreter's figures are tiny, not zero

    return {"median": g(ms["median"]), "min": g(ms["max"]), "max": g(ms["min"]), "repeats": ms["repeats"]}


def eager_ms(fn, iters: int, cuda: bool) -> float:
    """Median ms of one eager call of fn: CUDA events around each call on CUDA, else perf_counter
    (with fn's result waited for)."""
    import time

    import torch

    if cuda:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in ev)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def copy_bandwidth(device: str, repeats: int, smoke: bool, iters: int = 10) -> dict:
    """1 GiB (64 MiB with smoke) device-to-device copy, timed eagerly → ms and GB/s of read + write."""
    import torch

    n = (64 << 20) if smoke else (1 << 30)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    cuda = str(device).startswith("cuda")
    b.copy_(a)  # warm
    ms = _spread([eager_ms(lambda: b.copy_(a), iters, cuda) for _ in range(repeats)])
    return {"bytes": n, "timing": "eager, events around each call", "ms": ms, "GBps": _gbps(2 * n, ms)}


def graph_copy_bandwidth(device: str, repeats: int, smoke: bool, iters: int = 10) -> dict:
    """The same copy replayed from a CUDA graph of `iters` copies (what the benchmarks divided by
    before; kept to document the gap). CUDA only."""
    import torch

    n = (64 << 20) if smoke else (1 << 30)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b.copy_(a)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            b.copy_(a)
    graph.replay()
    torch.cuda.synchronize()
    got = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        got.append(s.elapsed_time(e) / iters)
    ms = _spread(got)
    return {"bytes": n, "timing": f"CUDA graph of {iters} copies, replayed", "ms": ms, "GBps": _gbps(2 * n, ms)}


def read_bandwidth(device: str, repeats: int, smoke: bool, iters: int = 10) -> dict:
    """2 GiB (4 MiB with smoke) read once by the read-stream kernel, timed eagerly → ms and GB/s
    of reads; the partial sums checked against torch's sum first."""
    import torch

    n_bytes = (4 << 20) if smoke else (2 << 30)
    x = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    total = float(read_sum(x).double().sum())
    cuda = str(device).startswith("cuda")
    ms = _spread([eager_ms(lambda: read_sum(x), iters, cuda) for _ in range(repeats)])
    return {"bytes": n_bytes, "timing": "eager, events around each call", "kernel": "benchmarks/_yardstick.py read_sum_kernel",
            "sum_equal": total == float(x.numel()), "ms": ms, "GBps": _gbps(n_bytes, ms)}


def l2_bytes(device: str, override: int | None = None) -> int:
    """The device's L2 size (torch's figure for CUDA), or `override` (the CPU smoke run passes one)."""
    if override:
        return override
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    return 1 << 20


def cold_sets(footprint: int, l2: int, factor: int = COLD_FACTOR, cap: int = COLD_CAP_BYTES) -> int:
    """Copies of an input set of `footprint` bytes to rotate through so that together they span
    ≥ factor × l2 (a call then finds none of its bytes left in L2 by the calls before it), and no
    more than `cap` bytes in all (at least one)."""
    if footprint <= 0:
        raise ValueError("footprint must be positive")
    want = math.ceil(factor * l2 / footprint)
    return max(1, min(want, cap // footprint))


def clones(tensors: tuple, n: int) -> list[tuple]:
    """n input sets: the tensors themselves, then n − 1 clones (same values, other addresses)."""
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(n - 1)]
