"""The AutoAWQ GEMM checkpoint layout (casper-hansen/AutoAWQ, version "gemm"): int4 codes and
zeros packed 8 per int32 along the output columns in the order [0, 2, 4, 6, 1, 3, 5, 7], fp16
scales per (group of input rows, column). Written by the AWQ search (engines/reference/awq.py),
read by the model loader and multiplied from by the W4A16 kernel (engines/kernels/w4a16.py).
"""

from __future__ import annotations

import torch

from engines.quant.minmax import GROUP_SIZE, dequantize_groupwise

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column held by nibble i of a packed int32


def _pack_cols(v: torch.Tensor) -> torch.Tensor:
    """[rows, out] ints in 0..15 → int32 [rows, out/8], nibble i = column 8c + AWQ_ORDER[i]."""
    rows, out = v.shape
    v = v.to(torch.int64).reshape(rows, out // 8, 8)[..., list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=v.device)
    packed = (v << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpack_cols(p: torch.Tensor) -> torch.Tensor:
    rows, cols = p.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=p.device)
    nib = (p.to(torch.int64)[..., None] >> shifts) & 0xF  # [rows, cols, 8]
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib
    return out.reshape(rows, cols * 8)


def pack_awq_gemm(q: torch.Tensor, zero: torch.Tensor,
                  scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ours (q [out, in] uint8, zero/scale [out, in/g]) → AutoAWQ GEMM tensors:
    qweight int32 [in, out/8], qzeros int32 [in/g, out/8], scales fp16 [in/g, out]."""
    return _pack_cols(q.T), _pack_cols(zero.round().T), scale.T.contiguous().to(torch.float16)


def unpack_awq_gemm(qweight: torch.Tensor, qzeros: torch.Tensor,
                    scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM tensors → ours: q [out, in], zero [out, in/g], scale [out, in/g]."""
    return _unpack_cols(qweight).T.to(torch.uint8), _unpack_cols(qzeros).T.float(), scales.T.float()


def dequantize_awq_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                        group_size: int = GROUP_SIZE) -> torch.Tensor:
    """Weight [out, in] = (q − z)·s."""
    q, zero, scale = unpack_awq_gemm(qweight, qzeros, scales)
    return dequantize_groupwise(q, scale, zero, group_size)
