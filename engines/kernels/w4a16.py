"""W4A16 matmul over the AutoAWQ GEMM layout: y = x · W where W [K, N] = (q − z) · s, q and z
packed 8 per int32 along N in the order [0, 2, 4, 6, 1, 3, 5, 7], scales fp16 per (group of
128 rows of K, column). Private kernel, launcher, public dispatcher, torch reference.

Shapes: x [M, K] (fp16 / bf16 / fp32), qweight int32 [K, N/8], qzeros int32 [K/G, N/8],
scales [K/G, N] → y [M, N] in x's dtype.

Five kernels (_w4a16_triton.py). On CUDA with 16-bit activations every decode batch (M ≤ 16) takes
gemv_mma: the rows padded to 16 for a tensor-core dot, each tile dequantized as fp16 pairs (a LOP3
makes two codes, 2^10 + q, of adjacent columns; the bias cancels in q − z), natural column order.
Elsewhere, or asked for (gemv="simt"): a batch-1 GEMV (the nibbles of a word kept as a tile axis,
zero point and scale taken out of each tile's sum), a skinny GEMV for decode batches (M ≤ 16: each packed word read
once and unpacked in registers, columns kept in the packed order; CUDA-core reduction below 16
rows, tensor cores at 16; split-K so that a 4096-wide layer fills the SMs) and
a tiled GEMM for short prefills (tensor-core dots on dequantized tiles). On CUDA they autotune.
A prefill of DEQUANT_MIN_M rows or more (every input past the GEMV's 16) dequantizes the weight
once (one pass over the packed words) and multiplies with torch's matmul, as vLLM's AWQ layer does
from 256 rows. On an H200 (benchmarks/results/gpu, runs 7 and 8) the tiled GEMM took 0.67–5.0 ms
per 8B layer at 24 to 1024 rows, dequantize + matmul 0.028–0.23 ms (7–24× faster at every
measured size, the smallest 24 rows; at 16 rows the GEMV and dequantize + matmul tie), and a
1K-token 8B prefill's TTFT went from 603 ms to 50 ms (fp16: 35 ms). The tiled GEMM stays as
`prefill="tiled"`.

At batch 1 on CUDA a W4A16Linear may take torch's own int4 GEMM instead (tinygemm,
`aten._weight_int4pack_mm`, bf16 activations), which the GPU report measured 1.6–1.9× faster
than gemv1 at the 8B shapes (benchmarks/results/gpu/README.md, run 2): the layer then holds the
weight in tinygemm's layout too (`TinyGemm`), and `batch1` names which kernel serves one row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engines.kernels import use_triton
from engines.quant import dequantize_awq_gemm, pack_awq_gemm


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int = 128) -> torch.Tensor:
    w = dequantize_awq_gemm(qweight, qzeros, scales.float(), group_size)  # [N, K]
    return (x.float() @ w.T.to(x.device)).to(x.dtype)


# decode batches take a GEMV (gemv_mma; or gemv1 and the skinny one); longer inputs dequantize, or take the tiled GEMM
GEMV_MAX_M = 16
GEMV_PATHS = ("auto", "mma", "simt")  # the decode GEMV: tensor cores on fp16 pairs, or CUDA-core arithmetic
DEQUANT_MIN_M = GEMV_MAX_M + 1  # from here: dequantize once, then torch's matmul (measured from 24: see above)
PREFILL_PATHS = ("auto", "tiled", "dequant")


def w4a16_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     group_size: int = 128, tune: bool | None = None) -> torch.Tensor:
    """The weight W [K, N] = (q − z)·s in `dtype`, by one Triton pass over the packed words."""
    from engines.kernels import _w4a16_triton as k
    from engines.kernels.launches import run

    K, N = qweight.shape[0], qweight.shape[1] * 8
    tune = qweight.is_cuda if tune is None else tune
    w = torch.empty(K, N, dtype=dtype, device=qweight.device)
    # CUDA: the fastest tile of an H200 sweep at both 8B shapes; the interpreter: few programs,
    # and a partial tile along N at the tests' N = 96
    block_k, block_n = (2, 1024) if tune else (32, 64)
    grid = (triton_cdiv(K, block_k), triton_cdiv(N, block_n))
    run(k.dequant_kernel, grid, qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), w, N, K,
        GROUP=group_size, BLOCK_K=block_k, BLOCK_N=block_n, **({"num_warps": 2} if tune else {}))
    return w


def gemv_pairs(x: torch.Tensor) -> bool:
    """Whether gemv_mma_kernel makes codes fp16 two an instruction (inline PTX): on CUDA for a
    16-bit x; elsewhere (the interpreter) by shifts, the same values."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def w4a16_triton(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int = 128, tune: bool | None = None, prefill: str = "auto",
                 gemv: str = "auto") -> torch.Tensor:
    """The Triton path. tune (default: on CUDA) autotunes tile sizes per (M's power-of-two
    bucket, N, K); without it (the interpreter) a fixed small configuration runs. prefill picks
    the path of more than GEMV_MAX_M rows: 'auto' (dequantize from DEQUANT_MIN_M rows, which is
    every such input today; the check stays should the bound move again), 'tiled' or 'dequant'
    (the benchmark measures both). gemv picks the kernel of up to GEMV_MAX_M rows: 'mma' (the
    rows padded to 16 for a tensor-core dot with the tile dequantized in fp16 pairs, natural
    column order: 3.9 lane-instructions a weight on sm_90 against gemv1's 6.6-12.4), 'simt'
    (gemv1 at one row, the skinny GEMV beyond), or 'auto': 'mma' on CUDA for a 16-bit x."""
    from engines.kernels import _w4a16_triton as k
    from engines.kernels.launches import run

    M, K = x.shape
    N = qweight.shape[1] * 8
    if K % group_size:
        raise ValueError(f"K={K} must be a multiple of the group size {group_size}")
    if prefill not in PREFILL_PATHS:
        raise ValueError(f"prefill: '{prefill}' is not one of {', '.join(PREFILL_PATHS)}")
    if M > GEMV_MAX_M and (prefill == "dequant" or (prefill == "auto" and M >= DEQUANT_MIN_M)):
        return x @ w4a16_dequantize(qweight, qzeros, scales, x.dtype, group_size, tune)
    if M <= GEMV_MAX_M and group_size % (128 if tune or (tune is None and x.is_cuda) else 32):
        raise ValueError(f"the W4A16 GEMV reads a tile's zeros and scales once: group size {group_size} "
                         "must be a multiple of its K tile (128 when tuned)")
    if gemv not in GEMV_PATHS:
        raise ValueError(f"gemv: '{gemv}' is not one of {', '.join(GEMV_PATHS)}")
    tune = x.is_cuda if tune is None else tune
    x = x.contiguous()
    args = (qweight.contiguous(), qzeros.contiguous(), scales.contiguous())
    if M <= GEMV_MAX_M and (gemv == "mma" or (gemv == "auto" and gemv_pairs(x))):
        y = torch.zeros(M, N, dtype=torch.float32, device=x.device)  # split-K adds into it
        if tune:
            grid = lambda meta: (triton_cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
            run(k.autotuned("gemv_mma"), grid, x, *args, y, M, N, K, GROUP=group_size, PAIRS=gemv_pairs(x))
        else:
            run(k.gemv_mma_kernel, (triton_cdiv(N, 32), 2), x, *args, y, M, N, K, GROUP=group_size, BLOCK_N=32,
                BLOCK_K=32, SPLIT_K=2, PAIRS=gemv_pairs(x))
        return y.to(x.dtype)
    if M == 1:
        y = torch.zeros(1, N, dtype=torch.float32, device=x.device)  # split-K adds into it
        if tune:
            grid = lambda meta: (triton_cdiv(N // 8, meta["W"]), meta["SPLIT_K"])  # noqa: E731
            run(k.autotuned("gemv1"), grid, x, *args, y, N, K, GROUP=group_size)
        else:
            run(k.gemv1_kernel, (triton_cdiv(N // 8, 4), 2), x, *args, y, N, K, GROUP=group_size, W=4, BLOCK_K=32,
                SPLIT_K=2)
        return y.to(x.dtype)
    if M <= GEMV_MAX_M:
        m_pad = 1 << (M - 1).bit_length()  # 2 … 16: batch 1 took gemv1 above
        y = torch.zeros(M, N, dtype=torch.float32, device=x.device)  # split-K adds into it
        if tune:
            grid = lambda meta: (triton_cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
            run(k.autotuned("gemv"), grid, x, *args, y, M, N, K, GROUP=group_size, M_PAD=m_pad)
        else:
            run(k.gemv_kernel, (triton_cdiv(N, 32), 2), x, *args, y, M, N, K, GROUP=group_size, M_PAD=m_pad,
                BLOCK_N=32, BLOCK_K=32, SPLIT_K=2)
        return y.to(x.dtype)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    fp32 = x.dtype == torch.float32
    if tune:
        grid = lambda meta: (triton_cdiv(M, meta["BLOCK_M"]), triton_cdiv(N, meta["BLOCK_N"]))  # noqa: E731
        run(k.autotuned("gemm_fp32" if fp32 else "gemm"), grid, x, *args, y, M, N, K, k.m_bucket(M), GROUP=group_size,
            FP32=fp32)
    else:
        # the interpreter pays per program and per loop step, not per element: tiles of 32 × 64 × 64
        # run a 6-layer model's prefill ~7× faster than 16 × 32 × 32 and still mask a partial tile
        # on every axis at the tests' shapes (M 33, N 96, K 384)
        run(k.gemm_kernel, (triton_cdiv(M, 32), triton_cdiv(N, 64)), x, *args, y, M, N, K, k.m_bucket(M),
            GROUP=group_size, BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, FP32=fp32)
    return y


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b



# engine_options.int4_gemv: the kernel of a single row (engines/spec.py lists the same choices;
# tests/unit/test_engine_options.py holds them equal)
INT4_GEMV = ("auto", "tinygemm", "triton")


class TinyGemm(torch.nn.Module):
    """One int4 weight in torch's tinygemm layout: y = x · Wᵀ with W[n, k] = (q − 8) · s + m per
    group of `group_size` along K, activations and (s, m) in bf16. From the AWQ parts
    w = (q − z) · s it is the same weight up to bf16 rounding: the same codes q, s, and
    m = (8 − z) · s; the activations are rounded to bf16 too, so a config's single-row outputs
    move by bf16's precision against the Triton GEMV's (describe() says which kernel ran).
    On CUDA `aten._convert_weight_to_int4pack` / `_weight_int4pack_mm`; on CPU their `_for_cpu`
    twins, the same arithmetic, which the CPU tests use."""

    INNER_K_TILES = 8
    scales_and_zeros: torch.Tensor  # buffers (registered in __init__)
    packed: torch.Tensor

    def __init__(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], device: str | torch.device,
                 group_size: int = 128) -> None:
        super().__init__()
        q = torch.cat([p[0] for p in parts]).to(torch.int32)  # [N, K]
        zero = torch.cat([p[1] for p in parts]).float()  # [N, K/G]
        scale = torch.cat([p[2] for p in parts]).float()
        self.group_size, self.out_features, self.in_features = group_size, q.shape[0], q.shape[1]
        sz = torch.stack([scale, (8 - zero) * scale], dim=-1).transpose(0, 1).contiguous()  # [K/G, N, 2]
        self.register_buffer("scales_and_zeros", sz.to(device=device, dtype=torch.bfloat16))
        device = torch.device(device)
        if device.type == "cuda":
            packed = torch.ops.aten._convert_weight_to_int4pack(
                (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device), self.INNER_K_TILES)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(device), self.INNER_K_TILES)
        self.register_buffer("packed", packed)

    @staticmethod
    def supports(in_features: int, out_features: int, group_size: int, device: str | torch.device) -> str | None:
        """Why tinygemm cannot hold this weight on `device`, or None when it can."""
        if torch.device(device).type != "cuda":
            return "tinygemm's CUDA kernel needs a CUDA device"
        if torch.version.hip is not None or torch.cuda.get_device_capability(device) < (8, 0):
            return "tinygemm's kernel needs an NVIDIA GPU of compute capability 8.0 or newer"
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
            return f"torch {torch.__version__} has no aten._weight_int4pack_mm"
        if in_features % (TinyGemm.INNER_K_TILES * 16) or out_features % 8 or group_size not in (32, 64, 128, 256):
            return f"shape {in_features}x{out_features} (group {group_size}) is not one tinygemm packs"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [M, K] → [M, N] in x's dtype
        mm = (torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu)
        return mm(x.to(torch.bfloat16).contiguous(), self.packed, self.group_size, self.scales_and_zeros).to(x.dtype)


class W4A16Linear(torch.nn.Module):
    """A linear layer whose int4 weight stays packed (AutoAWQ GEMM layout) and multiplies
    through w4a16(). Several layers of one input (q, k, v) concatenate along N.

    batch1 (engine_options.int4_gemv): which kernel multiplies a single row. 'auto' takes torch's
    tinygemm where it runs (CUDA, a torch that has it, a shape it packs), else the Triton GEMV;
    'tinygemm' insists (an error naming why it cannot); 'triton' keeps the own kernel. More rows
    (a decode batch, a prefill) always take the Triton kernels."""

    qweight: torch.Tensor  # buffers (registered in __init__)
    qzeros: torch.Tensor
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, tiny: TinyGemm | None = None) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("qzeros", qzeros)
        self.register_buffer("scales", scales)
        self.bias = bias
        self.tiny = tiny
        self.in_features, self.out_features = qweight.shape[0], qweight.shape[1] * 8

    @property
    def batch1(self) -> str:
        return "tinygemm" if self.tiny is not None else "triton"

    @classmethod
    def from_parts(cls, parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], bias: torch.Tensor | None,
                   device: str | torch.device, batch1: str = "triton") -> W4A16Linear:
        if batch1 not in INT4_GEMV:
            raise ValueError(f"engine_options.int4_gemv: '{batch1}' is not one of {', '.join(INT4_GEMV)}")
        packed = [pack_awq_gemm(q, zero, scale) for q, zero, scale in parts]  # each: [K, N_i/8] …
        qweight, qzeros, scales = (torch.cat([p[i] for p in packed], dim=1).to(device) for i in range(3))
        tiny = None
        if batch1 != "triton":
            why = TinyGemm.supports(qweight.shape[0], qweight.shape[1] * 8, 128, device)
            if why is None:
                tiny = TinyGemm(parts, device)
            elif batch1 == "tinygemm":
                raise ValueError(f"engine_options.int4_gemv: 'tinygemm' cannot run here: {why}; use 'auto' or 'triton'")
        return cls(qweight, qzeros, scales, bias, tiny)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.tiny is not None and rows.shape[0] == 1:
            y = self.tiny(rows)
        else:
            y = w4a16(rows, self.qweight, self.qzeros, self.scales)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def w4a16(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
          group_size: int = 128) -> torch.Tensor:
    """Dispatch: the Triton kernel where kernels run (CUDA, or CANARY_KERNELS=triton), else torch."""
    if use_triton(x.device):
        return w4a16_triton(x, qweight, qzeros, scales, group_size)
    return w4a16_reference(x, qweight, qzeros, scales, group_size)
