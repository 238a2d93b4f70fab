"""A readable Llama-family decoder (Llama, Mistral, Qwen2 and Qwen3 HF layouts) that loads
safetensors directly. Module names follow the HF checkpoints, so a state dict loads without
remapping. Qwen3 differs from Llama by an RMSNorm over each head's query and key (q_norm,
k_norm, one weight per head channel shared by the heads), applied before RoPE; Qwen3-MoE adds a
sparse MLP (SparseMoE: a router picks each token's top-k experts, each a SwiGLU MLP).

On the kernel path (engines.kernels.use_triton: CUDA, or meta under launches.planning()) a
one-token step takes the fused operators of engines/kernels/fused.py: the residual add with the
next RMSNorm, RoPE with the KV store, SiLU·mul; 10 launches a layer for an fp16 cache instead of
38 (engines/reference/step_plan.py counts them). Elsewhere the operators below, unfused.

Shapes: B batch, T new tokens, S cache slots, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, cast, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from engines.kernels import fused, fused_step_enabled, use_triton
from engines.quant import dequantize_awq_gemm
from engines.quant.compressed_tensors import dequantize_state as dequantize_compressed_tensors
from engines.reference.attention import Causal
from engines.zoo import REFERENCE_FAMILIES

SUPPORTED_TYPES = REFERENCE_FAMILIES  # engines/zoo: checked there before a load, torch-free


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    tie_embeddings: bool
    attention_bias: bool
    rope_scaling: dict = field(default_factory=dict)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's query and key before RoPE
    # Qwen3-MoE: experts per sparse layer, how many each token takes, each expert's MLP width,
    # whether the k routing weights are renormalised to sum to 1, and which layers are sparse
    n_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelArgs:
        mtype = cfg.get("model_type")
        if mtype not in SUPPORTED_TYPES:
            raise ValueError(f"model_type '{mtype}' is not supported by the reference engine; "
                             f"supported: {', '.join(SUPPORTED_TYPES)}")
        rope = dict(cfg.get("rope_parameters") or {})  # transformers ≥ 5
        rope.update(cfg.get("rope_scaling") or {})  # transformers 4 layout
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ValueError(f"rope scaling '{kind}' is not supported by the reference engine; "
                             "supported: default, linear, llama3")
        n_heads = cfg["num_attention_heads"]
        return cls(
            model_type=mtype,
            vocab_size=cfg["vocab_size"],
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            # Sliding-window attention (Mistral) is not implemented: cap the context at the window,
            # where full attention and sliding-window attention agree.
            max_seq_len=min(cfg.get("max_position_embeddings", 2048),
                            (cfg.get("sliding_window") or 1 << 30) if cfg.get("use_sliding_window", True) else 1 << 30),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", mtype == "qwen2")),
            rope_scaling={**rope, "rope_type": kind},
            qk_norm=mtype in ("qwen3", "qwen3_moe"),
            **_moe_args(cfg) if mtype == "qwen3_moe" else {},
        )


def _moe_args(cfg: dict) -> dict:
    """Qwen3-MoE's sparse layers, as transformers places them: layer i is sparse unless listed in
    mlp_only_layers, when (i + 1) is a multiple of decoder_sparse_step."""
    # transformers 5 writes num_local_experts, 4 wrote num_experts
    n_layers, n_experts = cfg["num_hidden_layers"], cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    dense, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step", 1) or 1
    return {"n_experts": n_experts, "experts_per_token": cfg.get("num_experts_per_tok", 1),
            "moe_intermediate_size": cfg.get("moe_intermediate_size", cfg["intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "sparse_layers": tuple(i for i in range(n_layers)
                                   if n_experts > 0 and i not in dense and (i + 1) % step == 0)}


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """[D/2] inverse frequencies, with the config's scaling (HF modeling_rope_utils)."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = args.rope_scaling
    if s["rope_type"] == "linear":
        inv = inv / s["factor"]
    elif s["rope_type"] == "llama3":  # Llama 3.1: scale long wavelengths, keep short ones, blend between
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def rope_cos_sin(inv_freq: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # pos: [B, T] → cos, sin: [B, 1, T, D] (the two halves repeat, HF's rotate_half convention)
    freqs = pos.float()[..., None] * inv_freq.to(pos.device)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RopeTable:
    """On CPU, cos and sin of every position up to the longest seen (at least min(context, 8192)),
    made once per dtype and frequency tensor with rope_cos_sin, so each row holds the values it
    gives; sin is kept with its first half negated, so that rotate_half(x)·sin equals
    swap_halves(x)·sin_signed value for value. A forward pass then gathers its positions' rows
    instead of computing them, and RoPE takes one copy (the swap) instead of a negation and a
    concatenation. Not used on CUDA, where a lookup's bounds check would be a host sync."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.cos = self.sin = torch.empty(0)

    def lookup(self, inv_freq: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype,
               context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, T] → cos, signed sin: [B, T, 1, D] (broadcast over the heads of a [B, T, heads, D] tensor)."""
        top = int(pos.max())
        key = (dtype, inv_freq.data_ptr())
        if key != self.key or top >= self.cos.shape[0]:
            n = max(top + 1, min(context, 8192), 2 * self.cos.shape[0] if key == self.key else 0)
            cos, sin = rope_cos_sin(inv_freq, torch.arange(n, device=pos.device)[None], dtype)
            half = sin.shape[-1] // 2
            self.cos, self.sin = cos[0, 0], torch.cat([-sin[0, 0, :, :half], sin[0, 0, :, half:]], dim=-1)  # [n, D]
            self.key = key
        return self.cos[pos][:, :, None], self.sin[pos][:, :, None]


def rope_swap(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """apply_rope with RopeTable's signed sin: x·cos + swap_halves(x)·sin_signed, where
    swap_halves(x)·sin_signed = cat(−x2, x1)·sin value for value (the sign moves to the sine)."""
    d = x.shape[-1]
    swapped = x.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2)
    return x * cos + swapped * sin_signed


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class AttentionCache(Protocol):
    """What attention reads the keys and values through, layer by layer (a type only): a KVCache,
    NoCache, a row store of rows.py, layer_states' read-back."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal | int | None) -> torch.Tensor: ...


@runtime_checkable
class RopeStoreCache(Protocol):
    """A cache that lets the fused RoPE kernel store a step's new keys and values itself (KVCache)."""

    def rope_destination(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def rope_in_store(self) -> bool: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | Causal | int | None, stored: bool = False,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor: ...


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        bias = args.attention_bias
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        # Llama's attention_bias covers o_proj too; Qwen2 biases q, k, v only
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=bias and args.model_type != "qwen2")
        self.qkv_proj: nn.Linear | None = None  # fused after loading (one matmul instead of three)
        # Qwen3: per-head RMSNorm of queries and keys, over the head dim (None elsewhere)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None

    def fuse(self) -> None:
        lins = (self.q_proj, self.k_proj, self.v_proj)
        fused = nn.Linear(self.args.dim, sum(m.out_features for m in lins), bias=self.args.attention_bias,
                          device=self.q_proj.weight.device, dtype=self.q_proj.weight.dtype)
        fused.weight.data = torch.cat([m.weight.data for m in lins])
        if self.args.attention_bias:
            fused.bias.data = torch.cat([m.bias.data for m in lins])
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, cache: AttentionCache,
                slots: torch.Tensor, mask: torch.Tensor | Causal | int | None, swapped: bool = False) -> torch.Tensor:
        """swapped: cos and sin are RopeTable's ([B, T, 1, D], signed sin), applied before the
        heads move ahead of the tokens; else rope_cos_sin's ([B, 1, T, D]), applied after."""
        a = self.args
        B, T, _ = x.shape
        H, Hkv, D = a.n_heads, a.n_kv_heads, a.head_dim
        if self.qkv_proj is not None and swapped and self.q_norm is None:  # q and k rotated together
            qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, D)
            qk = rope_swap(qkv[:, :, : H + Hkv], cos, sin)
            q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hkv :]
        else:
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], -1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
            if self.q_norm is not None and self.k_norm is not None:  # Qwen3: before RoPE, as HF applies them
                q, k = self.q_norm(q), self.k_norm(k)
            if swapped:
                q, k = rope_swap(q, cos, sin), rope_swap(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H or Hkv, T, D]
        if not swapped:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = cache.attend(layer, q, k, v, slots, mask)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * D))

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, cache: AttentionCache,
                      slots: torch.Tensor, mask: torch.Tensor | Causal | int | None,
                      stores: RopeStoreCache | None = None) -> torch.Tensor:
        """forward on the kernel path: RoPE of q (into a new tensor) and k (in place in the fused q/k/v output), and the
        new keys and values stored where the cache lets the same kernel put them (fused.rope_store);
        where the store's kernels apply RoPE themselves (TurboQuant), no RoPE launch at all.
        cos, sin: rope_cos_sin's; stores: `cache` when it is a RopeStoreCache (decided once a pass).
        A Qwen3 query/key norm or unfused projections take forward."""
        if self.qkv_proj is None or self.q_norm is not None:
            return self.forward(x, cos, sin, layer, cache, slots, mask)
        a = self.args
        B, T, _ = x.shape
        H, Hkv, D = a.n_heads, a.n_kv_heads, a.head_dim
        qkv = self.qkv_proj(x).view(B, T, H + 2 * Hkv, D)
        if stores is not None and stores.rope_in_store():  # the store's kernels rotate q and k as they read them
            q, k, v = (t.transpose(1, 2) for t in (qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]))
            out = stores.attend(layer, q, k, v, slots, mask, rope=(cos, sin))
            return self.o_proj(out.transpose(1, 2).reshape(B, T, H * D))
        dst = stores.rope_destination(layer) if stores is not None else None
        q = fused.rope_store(qkv, cos, sin, H, Hkv, slots, dst)
        q, k, v = (t.transpose(1, 2) for t in (q, qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]))
        if stores is not None and dst is not None:
            out = stores.attend(layer, q, k, v, slots, mask, stored=True)
        else:
            out = cache.attend(layer, q, k, v, slots, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, width: int | None = None):
        super().__init__()
        width = width or args.intermediate_size
        self.gate_proj = nn.Linear(args.dim, width, bias=False)
        self.up_proj = nn.Linear(args.dim, width, bias=False)
        self.down_proj = nn.Linear(width, args.dim, bias=False)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        w = torch.cat([self.gate_proj.weight.data, self.up_proj.weight.data])
        self.gate_up_proj = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        self.gate_up_proj.weight.data = w
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, fused_step: bool = False) -> torch.Tensor:
        """fused_step: SiLU·mul in one kernel launch (fused.silu_mul; the kernel path's one-token steps)."""
        if self.gate_up_proj is not None and fused_step:
            return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            gate, up = gate_up.chunk(2, dim=-1)
            if not gate_up.requires_grad:  # SwiGLU in the fused output's own memory (no autograd to keep)
                return self.down_proj(F.silu(gate, inplace=True).mul_(up))
            return self.down_proj(F.silu(gate) * up)
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)  # SwiGLU


class SparseMoE(nn.Module):
    """Qwen3-MoE's sparse MLP (HF Qwen3MoeSparseMoeBlock): the router's softmax over all experts,
    each token's top-k of it (renormalised to sum to 1 when norm_topk_prob), and the sum of those
    experts' SwiGLU outputs weighted by it. Each expert runs on the rows routed to it only.

    x [B, T, dim] → [B, T, dim]; the routing reads the host (which experts were picked), so a
    decode step over it is not captured as a CUDA graph (Decoder falls back to eager)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.k, self.renormalise = args.experts_per_token, args.norm_topk_prob
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)  # the router
        self.experts = nn.ModuleList(MLP(args, args.moe_intermediate_size) for _ in range(args.n_experts))

    def fuse(self) -> None:
        for expert in cast("Iterable[MLP]", self.experts):
            expert.fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, dim = x.shape
        flat = x.reshape(B * T, dim)
        probs = torch.softmax(self.gate(flat).float(), dim=-1)  # [N, E]
        weight, picked = probs.topk(self.k, dim=-1)  # [N, k]
        if self.renormalise:
            weight = weight / weight.sum(-1, keepdim=True)
        weight = weight.to(x.dtype)
        out = torch.zeros_like(flat)
        for e in picked.unique().tolist():
            rows, slot = (picked == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](flat[rows]) * weight[rows, slot, None])
        return out.view(B, T, dim)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp: MLP | SparseMoE = SparseMoE(args) if index in args.sparse_layers else MLP(args)


def layer_linears(layer: DecoderLayer) -> list[tuple[str, nn.Linear]]:
    """A decoder layer's projections by checkpoint name, before fuse(): attention's q, k, v and o,
    then the MLP's gate, up and down, or each expert's. A mixture's router stays out: it is
    tiny and picks the experts, so weight quantization leaves it in full precision."""
    attn = layer.self_attn
    out = [(f"self_attn.{n}_proj", getattr(attn, f"{n}_proj")) for n in ("q", "k", "v", "o")]
    mlps = ([(f"mlp.experts.{e}.", m) for e, m in enumerate(layer.mlp.experts)] if isinstance(layer.mlp, SparseMoE)
            else [("mlp.", layer.mlp)])
    return out + [(f"{prefix}{n}_proj", getattr(m, f"{n}_proj")) for prefix, m in mlps for n in ("gate", "up", "down")]


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)


class Transformer(nn.Module):
    inv_freq: torch.Tensor  # a buffer (registered in __init__)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.rope_table = RopeTable()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Transformer:
        # RoPE frequencies stay fp32 whatever dtype the weights are cast to: in fp16 they put
        # 0.3 rad of phase error on position 2K and 5 rad on 32K (bf16 ~8× worse)
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.args).to(self.inv_freq.device)
        return self

    def fuse(self) -> Transformer:
        """Fuse q/k/v and gate/up projections (after any weight quantization: both quantize per
        output row, so fusing does not change the values)."""
        for layer in cast("Iterable[DecoderLayer]", self.model.layers):
            layer.self_attn.fuse()
            layer.mlp.fuse()
        if self.inv_freq.device.type == "cpu":
            self.column_major()
        return self

    def column_major(self) -> None:
        """Store each linear weight [out, in] column-major (the same values, transposed in
        memory): F.linear multiplies by weight.t(), which is then contiguous, and MKL's GEMM
        without a transposed operand runs ~15 % faster on this CPU at one token and at a
        thousand (measured, benchmarks/reference_decode.py and perplexity_throughput.py)."""
        for mod in self.modules():
            if isinstance(mod, nn.Linear) and mod.weight.is_contiguous() and mod.weight.dim() == 2:
                mod.weight.data = mod.weight.data.t().contiguous().t()

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, cache: AttentionCache,
                mask: torch.Tensor | Causal | int | None, last_only: bool = False,
                hidden: bool = False) -> torch.Tensor:
        """ids, pos: [B, T] tokens and their RoPE positions; slots: [T] cache slots they fill;
        mask: [B, 1, T, S] True where a query may attend a slot; None: causal over the new tokens
        (slots 0…T−1); attention.Causal: the same through a lossy cache's store; an int n: every
        query attends all of slots 0…n−1 (one new token per row, no padding; the cache decides
        how, see KVCache.attend). Returns logits [B, T, V]."""
        h = self.model.embed_tokens(ids)
        if self.fused_step(h):
            return self._forward_fused(h, pos, slots, cache, mask, last_only, hidden)
        swapped = h.device.type == "cpu" and pos.numel() > 0
        if swapped:
            cos, sin = self.rope_table.lookup(self.inv_freq, pos, h.dtype, self.args.max_seq_len)
        else:
            cos, sin = rope_cos_sin(self.inv_freq, pos, h.dtype)
        for i, layer in enumerate(cast("Iterable[DecoderLayer]", self.model.layers)):
            h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, i, cache, slots, mask, swapped)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.model.norm(h)
        if last_only:
            h = h[:, -1:]
        return h if hidden else self.lm_head(h)  # hidden=True: the caller applies lm_head where needed

    def fused_step(self, h: torch.Tensor) -> bool:
        """Whether a pass over embeddings h [B, T, dim] takes the fused operators: one new token
        per row, no autograd, on the kernel path, with the projections fused (after fuse()), and no
        hook on a module the fused pass does not call (layer_states hooks the norms and attention),
        unless CANARY_FUSED_STEP=off."""
        return (h.shape[1] == 1 and not torch.is_grad_enabled() and use_triton(h.device)
                and cast(DecoderLayer, self.model.layers[0]).self_attn.qkv_proj is not None
                and not self._hooked() and fused_step_enabled())

    def _hooked(self) -> bool:
        """Whether a forward hook watches a module that _forward_fused does not call as a module."""
        from torch.nn.modules import module as nn_module

        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        skipped: list[nn.Module] = [self.model.norm]
        for layer in cast("Iterable[DecoderLayer]", self.model.layers):
            skipped += [layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn]
        return any(m._forward_hooks or m._forward_pre_hooks for m in skipped)

    def _forward_fused(self, h: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, cache: AttentionCache,
                       mask: torch.Tensor | Causal | int | None, last_only: bool, hidden: bool) -> torch.Tensor:
        """forward with each residual add folded into the RMSNorm after it (fused.add_rms_norm): a
        layer is add+norm, q/k/v, RoPE+store, attention, o, add+norm, gate/up, SiLU·mul, down."""
        cos, sin = rope_cos_sin(self.inv_freq, pos, h.dtype)
        layers = list(cast("Iterable[DecoderLayer]", self.model.layers))
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        first = layers[0].input_layernorm
        x, res = fused.add_rms_norm(h, None, first.weight, first.eps)
        stores = cache if isinstance(cache, RopeStoreCache) else None  # a Protocol check: once a pass
        for i, (layer, after) in enumerate(zip(layers, norms, strict=True)):
            a = layer.self_attn.forward_fused(x, cos, sin, i, cache, slots, mask, stores)
            post = layer.post_attention_layernorm
            x, res = fused.add_rms_norm(a, res, post.weight, post.eps)
            m = layer.mlp(x, fused_step=True) if isinstance(layer.mlp, MLP) else layer.mlp(x)
            x, res = fused.add_rms_norm(m, res, after.weight, after.eps)
        if last_only:
            x = x[:, -1:]
        return x if hidden else self.lm_head(x)


def _dequantize_awq_state(state: dict, qcfg: dict) -> dict:
    """An AutoAWQ / llm-compressor GEMM checkpoint: qweight/qzeros/scales → fp weights. A refusal
    names the method, never the checkpoint's path (which may be the real one a symlink led to)."""
    if qcfg.get("quant_method") != "awq" or qcfg.get("bits") != 4 or qcfg.get("version", "gemm").lower() != "gemm":
        raise ValueError(f"the model's quantization_config (quant_method '{qcfg.get('quant_method')}', "
                         f"{qcfg.get('bits')}-bit, version '{qcfg.get('version')}') is not supported; the reference "
                         "engine loads AWQ 4-bit GEMM and compressed-tensors (llm-compressor) weight-only int "
                         "checkpoints")
    out = {k: v for k, v in state.items() if not k.endswith((".qweight", ".qzeros", ".scales"))}
    for k in state:
        if k.endswith(".qweight"):
            mod = k.removesuffix(".qweight")
            out[f"{mod}.weight"] = dequantize_awq_gemm(state[k], state[f"{mod}.qzeros"], state[f"{mod}.scales"],
                                                       qcfg.get("group_size", 128))
    return {k: v.float() for k, v in out.items()}


def load_model(path: str | pathlib.Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> Transformer:
    """Build the decoder from an HF directory: config.json + *.safetensors (sharded or not)."""
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    args = ModelArgs.from_hf(json.loads((path / "config.json").read_text()))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in '{path}'")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    qcfg = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    if qcfg.get("quant_method") == "compressed-tensors":  # llm-compressor's output (AWQ, GPTQ, RTN recipes)
        state = {k: v.float() if v.is_floating_point() else v for k, v in
                 dequantize_compressed_tensors(state, qcfg).items()}
    elif qcfg:
        state = _dequantize_awq_state(state, qcfg)
    with torch.device("meta"):
        model = Transformer(args)
    if args.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (args.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint in '{path}' does not fit a {args.model_type} decoder: "
                         f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    if args.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(args)
    return model.to(device=device, dtype=dtype).eval()
