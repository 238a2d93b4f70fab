"""Quantization math shared by the reference engine (engines/reference) and the Triton kernels
(engines/kernels): pure torch, no model, no cache, no kernel. Neither of those packages is
imported here (an import-linter contract in pyproject.toml holds it).

- minmax: group-wise asymmetric INT-b weights (RTN, AWQ's quantizer) and min-max along one axis;
- awq_gemm: the AutoAWQ GEMM packed layout;
- compressed_tensors: llm-compressor's checkpoints (pack-quantized, naive-quantized) read back to dense weights;
- turbo: TurboQuant's Lloyd-Max codebooks, rotation and QJL residual.
"""

from engines.quant.awq_gemm import AWQ_ORDER, dequantize_awq_gemm, pack_awq_gemm, unpack_awq_gemm
from engines.quant.minmax import (
    GROUP_SIZE,
    dequantize_groupwise,
    fake_quantize,
    minmax_quant,
    quantize_groupwise,
    quantized_bytes,
)
from engines.quant.turbo import (
    codebook_on,
    lloyd_max_gaussian,
    lloyd_max_sphere,
    qjl_residual,
    random_rotation,
    rotation_on,
    turbo_mse,
    turbo_mse_rotated,
)

__all__ = [
    "AWQ_ORDER", "GROUP_SIZE", "codebook_on", "dequantize_awq_gemm", "dequantize_groupwise", "fake_quantize",
    "lloyd_max_gaussian", "lloyd_max_sphere", "minmax_quant", "pack_awq_gemm", "qjl_residual", "quantize_groupwise",
    "quantized_bytes", "random_rotation", "rotation_on", "turbo_mse", "turbo_mse_rotated", "unpack_awq_gemm",
]
