"""GPU kernel figures (run on a CUDA machine; on a host without one it prints why and exits 0).
One JSON line:
  - W4A16 GEMV at batch 1 for 4096×4096, 4096×14336, 14336×4096 (K×N): achieved bandwidth
    (packed weight bytes + scales/zeros + activations) as a fraction of the card's measured
    device-to-device copy bandwidth, next to torch fp16 matmul on the same shapes;
  - TurboQuant 3-bit decode attention at 8K / 32K / 128K context (8 query heads over 2 KV heads,
    head_dim 128, batch 1) vs torch SDPA on an fp16 KV cache of the same shape.

    python benchmarks/kernels.py
"""

from __future__ import annotations

import json

import torch


def cuda_time(fn, iters: int = 50) -> float:
    """Median milliseconds per call with CUDA events."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (read + write) on a 1 GiB buffer."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = cuda_time(lambda: b.copy_(a), iters=20)
    return 2 * a.numel() / (ms / 1000) / 1e9


def main() -> None:
    if not torch.cuda.is_available():
        print(json.dumps({"benchmark": "kernels", "skipped": "no CUDA device on this host; run it on a GPU machine"}))
        return
    from engines.kernels.turbo_kv import decode_attention, quantize_on_write
    from engines.kernels.w4a16 import w4a16_triton
    from engines.quant import quantize_groupwise
    from engines.reference.awq import pack_awq_gemm

    peak = copy_bandwidth()
    gemv = []
    for K, N in ((4096, 4096), (4096, 14336), (14336, 4096)):
        w = torch.randn(N, K, device="cuda") / K**0.5
        q, s, z = quantize_groupwise(w, 4)
        qw, qz, sc = (t.cuda() for t in pack_awq_gemm(q.cpu(), z.cpu(), s.cpu()))
        x = torch.randn(1, K, device="cuda", dtype=torch.float16)
        ms = cuda_time(lambda: w4a16_triton(x, qw, qz, sc))
        moved = qw.numel() * 4 + qz.numel() * 4 + sc.numel() * 2 + x.numel() * 2 + N * 2
        w16 = w.T.half().contiguous()
        ms16 = cuda_time(lambda: x @ w16)
        gemv.append({"K": K, "N": N, "w4a16_ms": round(ms, 4), "w4a16_bandwidth_fraction": round(moved / (ms / 1000) / 1e9 / peak, 3),
                     "torch_fp16_ms": round(ms16, 4), "speedup_vs_fp16": round(ms16 / ms, 2)})
    attn = []
    H, Hkv, D = 8, 2, 128
    for S in (8192, 32768, 131072):
        k = torch.randn(Hkv * S, D, device="cuda")
        v = torch.randn(Hkv * S, D, device="cuda")
        kc, kn = quantize_on_write(k, 3)
        vc, vn = quantize_on_write(v, 3)
        kc, vc = kc.reshape(1, Hkv, S, 3, D // 32), vc.reshape(1, Hkv, S, 3, D // 32)
        kn, vn = kn.reshape(1, Hkv, S), vn.reshape(1, Hkv, S)
        q = torch.randn(1, H, D, device="cuda", dtype=torch.float16)
        lengths = torch.tensor([S], device="cuda")
        ms = cuda_time(lambda: decode_attention(q, kc, kn, vc, vn, lengths, 3, chunk=1024, block_s=64), iters=20)
        k16 = k.reshape(1, Hkv, S, D).half()
        v16 = v.reshape(1, Hkv, S, D).half()
        q16 = q[:, :, None]
        ms16 = cuda_time(lambda: torch.nn.functional.scaled_dot_product_attention(q16, k16, v16, enable_gqa=True), iters=20)
        attn.append({"context": S, "turbo3_ms": round(ms, 4), "sdpa_fp16_ms": round(ms16, 4), "speedup": round(ms16 / ms, 2)})
    print(json.dumps({"benchmark": "kernels", "device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": round(peak, 1),
                      "w4a16_gemv": gemv, "turbo3_decode_attention": attn}))


if __name__ == "__main__":
    main()
