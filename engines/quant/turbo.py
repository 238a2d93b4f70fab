"""TurboQuant's codebooks and rotations (arXiv 2504.19874; docs/reference.md §2): the Lloyd-Max
codebook for one coordinate of a rotated unit vector, the random rotation Π, MSE quantization
in the rotated domain, and the 1-bit QJL residual. Shared by the reference engine's KV format
(engines/reference/kv/turbo.py) and the Triton kernels (engines/kernels/turbo_kv.py), which must
agree on Π and the codebook bit for bit.
"""

from __future__ import annotations

import math
from functools import lru_cache
from itertools import pairwise

import torch


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


def rotation_on(d: int, seed: int, device: str | torch.device) -> torch.Tensor:
    """Π on `device`, made once per device: a decode step pays no QR and no host-to-device copy
    (a copy from host memory would also break CUDA-graph capture)."""
    key = ("rotation", d, seed, str(device))
    if key not in _on_device:
        _on_device[key] = random_rotation(d, seed).to(device).contiguous()
    return _on_device[key]


def codebook_on(d: int, bits: int, device: str | torch.device) -> torch.Tensor:
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
