"""W4A16 matmul over the AutoAWQ GEMM layout: y = x · W where W [K, N] = (q − z) · s, q and z
packed 8 per int32 along N in the order [0, 2, 4, 6, 1, 3, 5, 7], scales fp16 per (group of
128 rows of K, column). Private kernel, launcher, public dispatcher, torch reference.

Shapes: x [M, K] (fp16 / bf16 / fp32), qweight int32 [K, N/8], qzeros int32 [K/G, N/8],
scales [K/G, N] → y [M, N] in x's dtype.
"""

from __future__ import annotations

import torch

from engines.kernels import use_triton
from engines.reference.awq import dequantize_awq_gemm


def w4a16_reference(x: torch.Tensor, qweight, qzeros, scales, group_size: int = 128) -> torch.Tensor:
    w = dequantize_awq_gemm(qweight, qzeros, scales.float(), group_size)  # [N, K]
    return (x.float() @ w.T.to(x.device)).to(x.dtype)


_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def w4a16_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, y_ptr, M, N, K,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     FP32: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # nibble holding column n within its int32: the inverse of AWQ's [0,2,4,6,1,3,5,7]
        j = rn % 8
        shift = ((j % 2) * 4 + j // 2) * 4
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            packed = tl.load(qw_ptr + rk[:, None] * (N // 8) + (rn[None, :] // 8),
                             mask=(rk[:, None] < K) & (rn[None, :] < N), other=0)
            q = (packed >> shift[None, :]) & 0xF
            g = rk // GROUP
            zp = tl.load(qz_ptr + g[:, None] * (N // 8) + (rn[None, :] // 8), mask=(rk[:, None] < K) & (rn[None, :] < N), other=0)
            z = (zp >> shift[None, :]) & 0xF
            s = tl.load(s_ptr + g[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
            w = (q - z).to(tl.float32) * s.to(tl.float32)  # [BLOCK_K, BLOCK_N]
            if FP32:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x.to(tl.float16), w.to(tl.float16))
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))

    return w4a16_kernel


def w4a16_triton(x: torch.Tensor, qweight, qzeros, scales, group_size: int = 128,
                 block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    global _kernel
    if _kernel is None:
        _kernel = _build()
    M, K = x.shape
    N = qweight.shape[1] * 8
    if K % group_size or group_size % block_k:
        raise ValueError(f"K={K} must be a multiple of the group {group_size}, itself a multiple of BLOCK_K={block_k}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton_cdiv(M, block_m), triton_cdiv(N, block_n))
    _kernel[grid](x.contiguous(), qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), y, M, N, K,
                  GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP32=x.dtype == torch.float32)
    return y


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class W4A16Linear(torch.nn.Module):
    """A linear layer whose int4 weight stays packed (AutoAWQ GEMM layout) and multiplies
    through w4a16(). Several layers of one input (q, k, v) concatenate along N."""

    def __init__(self, qweight, qzeros, scales, bias=None):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self.bias = bias
        self.in_features, self.out_features = qweight.shape[0], qweight.shape[1] * 8

    @classmethod
    def from_parts(cls, parts, bias, device) -> "W4A16Linear":
        from engines.reference.awq import pack_awq_gemm

        packed = [pack_awq_gemm(q, zero, scale) for q, zero, scale in parts]  # each: [K, N_i/8] …
        qweight, qzeros, scales = (torch.cat([p[i] for p in packed], dim=1).to(device) for i in range(3))
        return cls(qweight, qzeros, scales, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = w4a16(x.reshape(-1, self.in_features), self.qweight, self.qzeros, self.scales)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def w4a16(x: torch.Tensor, qweight, qzeros, scales, group_size: int = 128) -> torch.Tensor:
    """Dispatch: the Triton kernel where kernels run (CUDA, or CANARY_KERNELS=triton), else torch."""
    if use_triton(x.device):
        return w4a16_triton(x, qweight, qzeros, scales, group_size)
    return w4a16_reference(x, qweight, qzeros, scales, group_size)
