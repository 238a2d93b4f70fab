"""KV-cache formats (REFERENCE.md §2). Each format says what a cache slot holds after it is
written (``encode``: the dequantized value a kernel would read back), how many leading positions
of a sequence are held compressed when its length is n (``boundary``: KIVI keeps a recent
full-precision window; the others compress every slot, the current one included), and its exact
storage cost (``bits_per_element``, metadata amortized).

The reference engine stores dequantized values (a faithful simulation of the arithmetic); the
Triton kernels of engines/kernels store the packed codes the bit counts describe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

import torch

FP16_BITS = 16


class KVFormat:
    name = "base"
    lossy = True
    per_token = True  # each slot encodes on its own: the cache encodes new slots only, once
    rotated = False  # stored values live in a rotated domain (TurboQuant): attention rotates q once

    def encode(self, k: torch.Tensor, v: torch.Tensor, seq_start: torch.Tensor, layer: int = 0):
        """k, v: [B, Hkv, S, D] raw → what the cache holds for them (same shapes)."""
        raise NotImplementedError

    def boundary_k(self, n: torch.Tensor) -> torch.Tensor:
        """Leading key positions held compressed when the sequence holds n tokens (all of them,
        the current one included, unless the format keeps a full-precision window)."""
        return n

    def boundary_v(self, n: torch.Tensor) -> torch.Tensor:
        return n

    @property
    def windowed(self) -> bool:
        return False

    def bits_per_element(self, head_dim: int) -> tuple[float, float]:
        """(key bits, value bits) per cached element, metadata included."""
        raise NotImplementedError


@dataclass
class FloatKV(KVFormat):
    dtype: torch.dtype
    compute_dtype: torch.dtype

    def __post_init__(self) -> None:
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[self.dtype]
        self.lossy = self.dtype != self.compute_dtype

    def encode(self, k, v, seq_start, layer=0):
        return k.to(self.dtype).to(k.dtype), v.to(self.dtype).to(v.dtype)

    def bits_per_element(self, head_dim):
        bits = torch.finfo(self.dtype).bits
        return float(bits), float(bits)


class Fp8KV(KVFormat):
    """fp8 e4m3 with unit scale (vLLM's kv_cache_dtype="fp8" without calibrated scales)."""

    name = "fp8"

    def encode(self, k, v, seq_start, layer=0):
        f8 = torch.float8_e4m3fn
        return k.float().clamp(-448, 448).to(f8).to(k.dtype), v.float().clamp(-448, 448).to(f8).to(v.dtype)

    def bits_per_element(self, head_dim):
        return 8.0, 8.0


def minmax_quant(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric min-max quantize → dequantize along `dim` (one scale and zero per slice)."""
    qmax = 2**bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo).clamp(min=1e-8) / qmax
    q = torch.round((x - lo) / scale).clamp(0, qmax)
    return q * scale + lo


@dataclass
class IntPerTokenKV(KVFormat):
    """Uniform int-b per token: min-max over each (token, head) vector of D channels, no
    full-precision window. int8 is near lossless; int4 and int2 are the naive baselines that
    KVQuant shows collapse (REFERENCE.md §2)."""

    bits: int = 8

    def __post_init__(self) -> None:
        self.name = f"int{self.bits}"

    def encode(self, k, v, seq_start, layer=0):
        return minmax_quant(k.float(), self.bits, -1).to(k.dtype), minmax_quant(v.float(), self.bits, -1).to(v.dtype)

    def bits_per_element(self, head_dim):
        b = self.bits + 2 * FP16_BITS / head_dim  # fp16 scale + zero per vector
        return b, b


@dataclass
class KiviKV(KVFormat):
    """KIVI (jy-yuan/KIVI): keys per channel over groups of G tokens, values per token over
    groups of G channels. Keys wait in a full-precision residual of up to R tokens and are
    flushed (quantized) R at a time, so 1…R recent keys are full precision; values leave their
    R-token full-precision window one token at a time."""

    bits: int
    group: int = 32
    residual: int = 128
    per_token = False  # key groups span tokens

    def __post_init__(self) -> None:
        self.name = f"kivi-{self.bits}"

    @property
    def windowed(self) -> bool:
        return True

    def boundary_k(self, n):
        return ((n - 1).clamp(min=0) // self.residual) * self.residual

    def boundary_v(self, n):
        return (n - 1 - self.residual).clamp(min=0)

    def encode(self, k, v, seq_start, layer=0):
        kq = k.clone()
        B, H, S, D = k.shape
        G = self.group
        for b in range(B):  # rows start at different slots under left padding
            s0 = int(seq_start[b])
            n_groups = (S - s0) // G
            if n_groups:
                blk = k[b, :, s0 : s0 + n_groups * G].float().reshape(H, n_groups, G, D)
                kq[b, :, s0 : s0 + n_groups * G] = (minmax_quant(blk, self.bits, 2)
                                                    .reshape(H, n_groups * G, D).to(k.dtype))
        if D % G == 0:
            vg = v.float().reshape(B, H, S, D // G, G)
            vq = minmax_quant(vg, self.bits, -1).reshape(B, H, S, D).to(v.dtype)
        else:
            vq = minmax_quant(v.float(), self.bits, -1).to(v.dtype)
        return kq, vq

    def bits_per_element(self, head_dim):
        """Quantized part only; the full-precision window (up to R keys, R values) comes on top."""
        per_group = 2 * FP16_BITS / self.group  # scale + zero per G elements, on either axis
        return self.bits + per_group, self.bits + per_group


# -- TurboQuant ------------------------------------------------------------------------------------
@lru_cache
def lloyd_max_gaussian(bits: int, iters: int = 300) -> tuple[float, ...]:
    """Lloyd-Max centroids for N(0, 1) at 2^bits levels (scale by 1/√d for a coordinate of a
    rotated unit vector in d dimensions). Centroid of [a, b] is (φ(a) − φ(b)) / (Φ(b) − Φ(a))."""
    n = 2**bits
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    c = [-2.5 + 5 * (i + 0.5) / n for i in range(n)]
    for _ in range(iters):
        edges = [-math.inf] + [(a + b) / 2 for a, b in pairwise(c)] + [math.inf]
        c = [(pdf(a) - pdf(b)) / max(cdf(b) - cdf(a), 1e-300) for a, b in pairwise(edges)]
    return tuple(c)


@lru_cache
def lloyd_max_sphere(d: int, bits: int, iters: int = 200, grid: int = 40001) -> tuple[float, ...]:
    """Lloyd-Max centroids for one coordinate of a uniformly random unit vector in d dimensions,
    whose exact law is f(x) ∝ (1 − x²)^((d−3)/2) on [−1, 1] (TurboQuant §3; for large d it tends
    to N(0, 1/d), whose codebook is lloyd_max_gaussian / √d). Numerical, on a fine grid."""
    if d < 3:
        raise ValueError(f"head_dim {d} is too small for TurboQuant")
    x = torch.linspace(-1, 1, grid, dtype=torch.float64)[1:-1]
    w = (1 - x * x).pow((d - 3) / 2)
    c = torch.tensor(lloyd_max_gaussian(bits), dtype=torch.float64) / math.sqrt(d)  # start from the Gaussian
    for _ in range(iters):
        edges = (c[1:] + c[:-1]) / 2
        cell = torch.bucketize(x, edges)
        mass = torch.zeros_like(c).index_add_(0, cell, w)
        c = torch.zeros_like(c).index_add_(0, cell, w * x) / mass.clamp(min=1e-300)
        c = (c - c.flip(0)) / 2  # the law is symmetric; keep the grid from tilting it
    return tuple(c.tolist())


@lru_cache
def random_rotation(d: int, seed: int) -> torch.Tensor:
    """Random orthogonal Π: QR of a Gaussian matrix, signs fixed (TurboQuant paper)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float().contiguous()  # LAPACK returns column-major


_on_device: dict[tuple, torch.Tensor] = {}


def rotation_on(d: int, seed: int, device) -> torch.Tensor:
    """Π on `device`, made once per device: a decode step pays no QR and no host-to-device copy
    (a copy from host memory would also break CUDA-graph capture)."""
    key = ("rotation", d, seed, str(device))
    if key not in _on_device:
        _on_device[key] = random_rotation(d, seed).to(device).contiguous()
    return _on_device[key]


def codebook_on(d: int, bits: int, device) -> torch.Tensor:
    """The Lloyd-Max codebook [2^bits] for dimension d on `device`, made once per device."""
    key = ("codebook", d, bits, str(device))
    if key not in _on_device:
        _on_device[key] = torch.tensor(lloyd_max_sphere(d, bits), dtype=torch.float32, device=device)
    return _on_device[key]


def turbo_mse_rotated(x: torch.Tensor, bits: int, seed: int) -> torch.Tensor:
    """TurboQuant-MSE in the rotated domain: c[idx]·‖x‖ where idx snaps each coordinate of the
    rotated unit vector Π·x/‖x‖ to the Lloyd-Max codebook of its exact law. x: [..., d]."""
    d = x.shape[-1]
    rot, book = rotation_on(d, seed, x.device), codebook_on(d, bits, x.device)
    xf = x.float()
    norm = xf.norm(dim=-1, keepdim=True)
    u = (xf / norm.clamp(min=1e-12)) @ rot.T  # rotated unit vector
    idx = (u[..., None] - book).abs().argmin(-1)
    return book[idx] * norm


def turbo_mse(x: torch.Tensor, bits: int, seed: int) -> torch.Tensor:
    """TurboQuant-MSE reconstruction Πᵀ·c[idx]·‖x‖ (rotate back)."""
    return turbo_mse_rotated(x, bits, seed) @ rotation_on(x.shape[-1], seed, x.device)


def qjl_residual(r: torch.Tensor, seed: int) -> torch.Tensor:
    """1-bit QJL sketch of a residual: ‖r‖·√(π/2)/d · Sᵀ·sign(S·r), S Gaussian d×d; unbiased for ⟨q, r⟩."""
    d = r.shape[-1]
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(d, d, generator=g).to(r.device)
    signs = torch.sign(r @ S.T)
    return r.norm(dim=-1, keepdim=True) * math.sqrt(math.pi / 2) / d * (signs @ S)


@dataclass
class TurboKV(KVFormat):
    """TurboQuant (arXiv 2504.19874). bits may be fractional: D/4 outlier channels get ⌈b⌉ bits,
    the rest ⌊b⌋, each part with its own rotation and norm. The outlier channels are fixed per
    layer and head from the projection weights (``calibrate``: row energy of k_proj — RoPE pairs
    kept together — and of v_proj), so a token's code never depends on other requests.
    inner_product=True: keys use MSE at b−1 bits plus the 1-bit QJL residual (unbiased inner
    products); values stay MSE at b bits."""

    bits: float
    inner_product: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        self.name = f"turbo-ip-{self.bits:g}" if self.inner_product else f"turbo-{self.bits:g}"
        self.fractional = self.bits != int(self.bits)
        self.rotated = not (self.inner_product or self.fractional)
        self.outliers: dict[tuple[int, str], torch.Tensor] = {}  # (layer, "k"|"v") → [Hkv, D/4] channel ids

    def calibrate(self, model) -> None:
        """Outlier channels per layer and head from the weights (data-free, order-free)."""
        if not self.fractional:
            return
        a = model.args
        D, Hkv = a.head_dim, a.n_kv_heads
        for i, layer in enumerate(model.model.layers):
            wk = layer.self_attn.k_proj.weight.detach().float().reshape(Hkv, D, -1).pow(2).sum(-1)  # [Hkv, D]
            pair = wk[:, : D // 2] + wk[:, D // 2 :]  # RoPE rotates channel i with i + D/2
            top = pair.topk(D // 8, dim=-1).indices
            self.outliers[(i, "k")] = torch.cat([top, top + D // 2], dim=-1).sort(-1).values
            wv = layer.self_attn.v_proj.weight.detach().float().reshape(Hkv, D, -1).pow(2).sum(-1)
            self.outliers[(i, "v")] = wv.topk(D // 4, dim=-1).indices.sort(-1).values

    def _outlier_mask(self, x: torch.Tensor, layer: int, which: str) -> torch.Tensor:
        D = x.shape[-1]
        idx = self.outliers.get((layer, which))
        if idx is None:  # uncalibrated (a format used on its own): this call's own energy
            idx = x.float().abs().mean(dim=(0, 2)).topk(D // 4, dim=-1).indices
        mask = torch.zeros(x.shape[1], D, dtype=torch.bool, device=x.device)
        return mask.scatter_(1, idx.to(x.device), True)

    def _mse(self, x: torch.Tensor, layer: int, which: str, bits: float) -> torch.Tensor:
        if bits == int(bits):
            return turbo_mse(x, int(bits), self.seed)
        mask = self._outlier_mask(x, layer, which)  # [Hkv, D]
        out = torch.empty_like(x, dtype=torch.float32)
        hi_bits, lo_bits = math.ceil(bits), math.floor(bits)
        for h in range(x.shape[1]):
            m = mask[h]
            out[:, h][..., m] = turbo_mse(x[:, h][..., m], hi_bits, self.seed + 1)
            out[:, h][..., ~m] = turbo_mse(x[:, h][..., ~m], lo_bits, self.seed + 2)
        return out

    def rotation(self, d: int, device) -> torch.Tensor:
        return rotation_on(d, self.seed, device)

    def encode(self, k, v, seq_start, layer=0):
        if self.rotated:  # stored in the rotated domain: codes × norms (Π·k̂, Π·v̂)
            return (turbo_mse_rotated(k, int(self.bits), self.seed).to(k.dtype),
                    turbo_mse_rotated(v, int(self.bits), self.seed).to(v.dtype))
        if self.inner_product:
            k_mse = self._mse(k, layer, "k", self.bits - 1)
            kq = k_mse + qjl_residual(k.float() - k_mse, self.seed + 3)
        else:
            kq = self._mse(k, layer, "k", self.bits)
        return kq.to(k.dtype), self._mse(v, layer, "v", self.bits).to(v.dtype)

    def code_bits(self, bits: float) -> float:
        # fractional: D/4 channels at ⌈b⌉, 3D/4 at ⌊b⌋ → ⌊b⌋ + 1/4 code bits per element
        return math.floor(bits) + 0.25 if bits != int(bits) else float(bits)

    def bits_per_element(self, head_dim):
        """Exact, norms included. The nominal width (2.5, 3.5) is the total at head_dim 128
        (REFERENCE.md §2: 32 channels at 3 bits + 96 at 2, plus two fp16 norms = 2.5); with a
        smaller head_dim the norms cost more per element."""
        norms = 2 if self.fractional else 1  # one fp16 norm per (sub)vector
        v_bits = self.code_bits(self.bits) + norms * FP16_BITS / head_dim
        if self.inner_product:  # b−1 bit MSE codes + 1 QJL sign bit, plus the residual's norm
            return self.code_bits(self.bits - 1) + 1 + (norms + 1) * FP16_BITS / head_dim, v_bits
        return v_bits, v_bits


def kv_format(name: str, compute_dtype: torch.dtype) -> KVFormat:
    floats = {"auto": compute_dtype, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    if name in floats:
        return FloatKV(floats[name], compute_dtype)
    if name == "fp8":
        return Fp8KV()
    if name in ("int8", "int4", "int2"):
        return IntPerTokenKV(int(name.removeprefix("int")))
    if name.startswith("kivi-"):
        return KiviKV(int(name.removeprefix("kivi-")))
    if name.startswith("turbo-ip-"):
        return TurboKV(float(name.removeprefix("turbo-ip-")), inner_product=True)
    if name.startswith("turbo-"):
        return TurboKV(float(name.removeprefix("turbo-")))
    raise ValueError(f"kv_cache: '{name}' has no format in the reference engine")
