"""GPU kernel figures (run on a CUDA machine; on a host without one it prints why and exits 0).
One JSON line:
  - W4A16 GEMV at batch 1 for 4096×4096, 4096×14336, 14336×4096 (K×N): achieved bandwidth
    (packed weight bytes + scales/zeros + activations) as a fraction of the card's measured
    device-to-device copy bandwidth, next to torch fp16 matmul on the same shapes;
  - compressed-KV decode attention (TurboQuant 3-bit, KIVI 2-bit with its 128-token fp16
    window, fp8) at 8K / 32K / 128K context (32 query heads over 8 KV heads, head_dim 128,
    batch 1 — Llama-3-8B's attention) vs torch SDPA on an fp16 KV cache of the same shape,
    with the bytes each reads;
  - end-to-end decode tokens/s of an 8B-shaped Llama (random weights, 32 layers) on the
    reference engine's model and cache, per config (weights × kv_cache), batch 1, after a
    prefill of --prompt tokens.

    python benchmarks/kernels.py [--prompt 1024] [--new-tokens 64] [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import time

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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"benchmark": "kernels", "skipped": "no CUDA device on this host; run it on a GPU machine"}))
        return
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
                     "torch_fp16_ms": round(ms16, 4), "torch_fp16_bandwidth_fraction": round(w16.nbytes / (ms16 / 1000) / 1e9 / peak, 3),
                     "speedup_vs_fp16": round(ms16 / ms, 2)})
    attn = [attention_point(S) for S in (8192, 32768, 131072)]
    e2e = [end_to_end(w, kv, args) for w, kv in (("fp16", "fp16"), ("rtn-int4", "fp16"), ("fp16", "fp8"),
                                                ("fp16", "kivi-2"), ("fp16", "turbo-3"), ("rtn-int4", "turbo-3"))]
    print(json.dumps({"benchmark": "kernels", "device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": round(peak, 1),
                      "w4a16_gemv": gemv, "decode_attention": attn, "end_to_end_8b_shaped": e2e}))


def attention_point(S: int, H: int = 32, Hkv: int = 8, D: int = 128) -> dict:
    from engines.kernels import fp8_kv, kivi_kv, turbo_kv

    q = torch.randn(1, H, D, device="cuda", dtype=torch.float16)
    k16 = torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.float16)
    v16 = torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.float16)
    lengths = torch.tensor([S], device="cuda")
    chunk = max(256, S // 64)  # enough split-K programs to fill the SMs at batch 1
    ms16 = cuda_time(lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k16, v16, enable_gqa=True), iters=20)
    out = {"context": S, "sdpa_fp16_ms": round(ms16, 4), "fp16_bytes": 2 * k16.nbytes}
    # TurboQuant 3-bit: 3 bit-planes per 32 channels + a norm per vector
    kc, kn = turbo_kv.quantize_on_write(k16.reshape(-1, D), 3)
    vc, vn = turbo_kv.quantize_on_write(v16.reshape(-1, D), 3)
    kc, vc = kc.reshape(1, Hkv, S, 3, D // 32), vc.reshape(1, Hkv, S, 3, D // 32)
    kn, vn = kn.reshape(1, Hkv, S), vn.reshape(1, Hkv, S)
    ms = cuda_time(lambda: turbo_kv.decode_attention(q, kc, kn, vc, vn, lengths, 3, chunk=chunk, block_s=64), iters=20)
    out.update(turbo3_ms=round(ms, 4), turbo3_speedup=round(ms16 / ms, 2), turbo3_bytes=2 * (kc.nbytes + kn.nbytes))
    # KIVI 2-bit: everything but the last 128 tokens compressed
    kq = [t.reshape(1, Hkv, -1, t.shape[-1]) for t in kivi_kv.quantize_keys(k16.reshape(-1, D), 2)]
    vq = [t.reshape(1, Hkv, -1, t.shape[-1]) for t in kivi_kv.quantize_values(v16.reshape(-1, D), 2)]
    nk = torch.tensor([S - 128], device="cuda")
    ms = cuda_time(lambda: kivi_kv.decode_attention(q, k16, v16, *kq, *vq, lengths, nk, nk, 2, chunk=chunk, block_s=64), iters=20)
    out.update(kivi2_ms=round(ms, 4), kivi2_speedup=round(ms16 / ms, 2))
    k8, v8 = fp8_kv.quantize_on_write(k16), fp8_kv.quantize_on_write(v16)
    ms = cuda_time(lambda: fp8_kv.decode_attention(q, k8, v8, lengths, chunk=chunk, block_s=64), iters=20)
    out.update(fp8_ms=round(ms, 4), fp8_speedup=round(ms16 / ms, 2))
    return out


def llama8b_args(layers: int):
    from engines.reference.model import ModelArgs

    return ModelArgs(model_type="llama", vocab_size=128256, dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8, head_dim=128,
                     intermediate_size=14336, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False,
                     attention_bias=False, rope_scaling={"rope_type": "default"})


@torch.inference_mode()
def end_to_end(weights: str, kv_cache: str, args, device: str = "cuda") -> dict:
    """Decode tokens/s of an 8B-shaped model with random weights (std 0.02), batch 1, greedy."""
    from engines.kernels.w4a16 import W4A16Linear
    from engines.quant import quantize_groupwise
    from engines.reference.cache import KVCache
    from engines.reference.kv import kv_format
    from engines.reference.model import Transformer

    torch.manual_seed(0)
    a = llama8b_args(args.layers)
    with torch.device(device):
        model = Transformer(a).to(torch.float16)
    for p in model.parameters():
        p.normal_(0, 0.02)
    model.fuse()
    if weights == "rtn-int4":  # the engine's int4 path on CUDA: packed weights, W4A16 kernels
        for layer in model.model.layers:
            for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
                lin = getattr(parent, name)
                q, s, z = quantize_groupwise(lin.weight.float(), 4)
                setattr(parent, name, W4A16Linear.from_parts([(q.cpu(), z.cpu(), s.cpu())], None, device))
    fmt = kv_format(kv_cache, torch.float16)
    if hasattr(fmt, "calibrate"):
        fmt.calibrate(model)
    slots = args.prompt + args.new_tokens
    cache = KVCache(a.n_layers, 1, slots, a.n_kv_heads, a.head_dim, torch.float16, torch.device(device), fmt)
    ids = torch.randint(0, a.vocab_size, (1, args.prompt), device=device)
    pos = torch.arange(args.prompt, device=device)
    full = torch.ones(args.prompt, slots, dtype=torch.bool, device=device).tril()[None, None]
    logits = model(ids, pos[None], pos, cache, full, last_only=True)
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for t in range(args.prompt, slots):
        slot = torch.tensor([t], device=device)
        mask = (torch.arange(slots, device=device) <= t)[None, None, None]
        nxt = model(nxt, slot[None], slot, cache, mask, last_only=True)[:, -1].argmax(-1, keepdim=True)
    sync()
    ms = (time.perf_counter() - t0) * 1000
    del model, cache
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"weights": weights, "kv_cache": kv_cache, "prompt": args.prompt, "new_tokens": args.new_tokens,
            "decode_tokens_per_s": round(args.new_tokens / (ms / 1000), 1), "ms_per_token": round(ms / args.new_tokens, 3)}


if __name__ == "__main__":
    main()
