"""AWQ int4 g128 (Lin et al., arXiv 2306.00978; mit-han-lab/llm-awq auto_scale.py, auto_clip.py)
and the AutoAWQ GEMM checkpoint it writes.

Per decoder layer, on calibration activations X of the *domain* text:
  scale search — for the groups (input_layernorm → q,k,v judged through the attention block),
  (post_attention_layernorm → gate,up judged through the MLP), (up_proj → down_proj), and
  (v_proj → o_proj when their shapes match, i.e. no GQA): s = mean|x|^α, α ∈ {0, 0.05, …, 0.95},
  clamped ≥ 1e-4 and normalised by √(max s · min s); quantize W·diag(s), divide the input by s,
  keep the α with the lowest output MSE; fold 1/s into the preceding norm or linear.
  clip search — per (output row, group) try max ← max₀·(1 − i/20), i = 0…9, keep the one
  minimising ‖X·Q(clip W) − X·W‖² on ≤ 512 sampled tokens; q_proj and k_proj are skipped.
Then every decoder linear is quantized group-wise asymmetric INT4 (engines/quant/minmax.py) and
written in the AutoAWQ GEMM layout (engines/quant/awq_gemm.py).

The search is offline work, like an AWQ checkpoint: its outcome (the model's weights after scale
folding and clipping, and the INT4 codes) is cached on disk, keyed by the model's weight files,
the calibration token ids and the source of the code that computes it, so a second load of the
same model on the same calibration data skips it (CANARY_AWQ_CACHE: the folder, or "off").
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
from collections.abc import Callable, Iterable
from functools import partial
from typing import cast

import torch
from torch import nn

from engines.fingerprint import model_digest, source_digest
from engines.quant import GROUP_SIZE, dequantize_groupwise, fake_quantize, pack_awq_gemm, quantize_groupwise
from engines.reference.cache import KVCache
from engines.reference.kv import kv_format
from engines.reference.model import MLP, Attention, DecoderLayer, Transformer, rope_cos_sin

N_GRID = 20
MAX_SHRINK = 0.5
CLIP_TOKENS = 512
log = logging.getLogger(__name__)


# -- search ---------------------------------------------------------------------------------------
def _quant_error_scales(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    s = x_mean.pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def search_scale(block: Callable[[torch.Tensor], torch.Tensor], linears: list[nn.Linear], x: torch.Tensor,
                 inp: torch.Tensor) -> torch.Tensor:
    """α grid search. x: block input; inp: the linears' shared input [N, ci]. Returns s [ci]."""
    x_mean = inp.abs().reshape(-1, inp.shape[-1]).float().mean(0)
    original = [lin.weight.data.clone() for lin in linears]
    ref = block(x)
    best: torch.Tensor | None = None
    best_err = float("inf")
    for i in range(N_GRID):
        s = _quant_error_scales(x_mean, i / N_GRID).to(inp.dtype)
        for lin, w in zip(linears, original, strict=True):
            lin.weight.data = fake_quantize(w * s, 4) / s  # Q(W·diag(s))·diag(s)⁻¹: the input is divided by s
        err = (block(x) - ref).float().pow(2).mean().item()
        if err < best_err:
            best, best_err = s, err
    for lin, w in zip(linears, original, strict=True):
        lin.weight.data = w
    return best  # type: ignore[return-value]  # None only if every grid point's error is NaN


def apply_scale(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """Fold: prev's output (a norm's weight, or a linear's output rows) ÷ s; each linear's input columns × s."""
    if isinstance(prev, nn.Linear):
        prev.weight.data.div_(s[:, None])
        if prev.bias is not None:
            prev.bias.data.div_(s)
    else:  # RMSNorm
        cast(torch.Tensor, prev.weight).data.div_(s)
    for lin in linears:
        lin.weight.data.mul_(s)


@torch.no_grad()
def search_clip(w: torch.Tensor, inp: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """Per (output row, group) clip threshold [co, n_groups, 1] minimising the output MSE.

    A group's output error on token n is X[n, G]·(Q(clip W)[c, G] − W[c, G]): one batched matmul
    per grid point (groups as the batch), never the [co, n, ci] products llm-awq's auto_clip
    materialises (the same quantity; 0.4 GB a grid point for the demo's MLP)."""
    co, ci = w.shape
    x = inp.reshape(-1, ci).float()
    if x.shape[0] > CLIP_TOKENS:
        x = x[torch.linspace(0, x.shape[0] - 1, CLIP_TOKENS, device=x.device).long()]
    n_groups = ci // group_size
    xg = x.reshape(-1, n_groups, group_size).transpose(0, 1)  # [G, n, g]
    wg = w.float().reshape(co, n_groups, group_size)  # [co, G, g]
    max0 = wg.abs().amax(-1, keepdim=True)  # [co, G, 1]
    best_max, best_err = max0.clone(), torch.full(max0.shape, float("inf"), device=w.device)
    for i in range(int(MAX_SHRINK * N_GRID)):
        m = max0 * (1 - i / N_GRID)
        q = fake_quantize(torch.clamp(wg, -m, m).reshape(co, ci), 4, group_size).reshape(wg.shape)
        diff = torch.bmm(xg, (q - wg).permute(1, 2, 0))  # [G, n, co]
        err = diff.pow(2).mean(1).transpose(0, 1)[..., None]  # [co, G, 1]
        better = err < best_err
        best_err, best_max = torch.where(better, err, best_err), torch.where(better, m, best_max)
    return best_max


def apply_clip(lin: nn.Linear, max_val: torch.Tensor, group_size: int = GROUP_SIZE) -> None:
    co, ci = lin.weight.shape
    w = lin.weight.data.reshape(co, ci // group_size, group_size)
    lin.weight.data = torch.clamp(w, -max_val.to(w.dtype), max_val.to(w.dtype)).reshape(co, ci)


@torch.no_grad()
def awq_quantize(model: Transformer, calibration: torch.Tensor,
                 log: Callable[[str], None] = lambda *_: None) -> dict[str, tuple]:
    """Search AWQ scales and clips layer by layer on `calibration` token ids [N, T], then quantize
    every decoder linear to INT4 g128. Returns {param name: (q, zero, scale)} for checkpoints."""
    a = model.args
    N, T = calibration.shape
    slots = torch.arange(T, device=calibration.device)
    pos = slots[None].expand(N, -1)
    mask = torch.ones(T, T, dtype=torch.bool, device=calibration.device).tril()[None, None]
    dtype = model.model.embed_tokens.weight.dtype
    cos, sin = rope_cos_sin(model.inv_freq, pos, dtype)
    h = model.model.embed_tokens(calibration)
    packed: dict[str, tuple] = {}
    for li, layer in enumerate(cast("Iterable[DecoderLayer]", model.model.layers)):
        attn, mlp = layer.self_attn, cast(MLP, layer.mlp)  # a dense MLP: the engine refuses AWQ on a mixture (MOE_AWQ)
        cache = KVCache(1, N, T, a.n_kv_heads, a.head_dim, dtype, h.device, kv_format("auto", dtype))

        def attn_block(x: torch.Tensor, attn: Attention = attn, cache: KVCache = cache) -> torch.Tensor:
            return attn(x, cos, sin, 0, cache, slots, mask)

        # llm-awq: the next layer's input comes from this layer with its original weights
        h_next = h + attn_block(layer.input_layernorm(h))
        h_next = h_next + mlp(layer.post_attention_layernorm(h_next))

        # 1. input_layernorm → q, k, v (judged through the whole attention block)
        xn = layer.input_layernorm(h)
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        s = search_scale(attn_block, qkv, xn, xn)
        apply_scale(layer.input_layernorm, qkv, s)
        xn = layer.input_layernorm(h)
        # 2. v_proj → o_proj, only without GQA (v's outputs are o's inputs one to one)
        o_in = _capture_input(attn.o_proj, partial(attn_block, xn))
        if attn.v_proj.weight.shape == attn.o_proj.weight.shape:
            s = search_scale(attn.o_proj, [attn.o_proj], o_in, o_in)
            apply_scale(attn.v_proj, [attn.o_proj], s)
            o_in = _capture_input(attn.o_proj, partial(attn_block, xn))
        h_mid = h + attn_block(xn)
        # 3. post_attention_layernorm → gate, up (judged through the MLP)
        xm = layer.post_attention_layernorm(h_mid)
        s = search_scale(mlp, [mlp.gate_proj, mlp.up_proj], xm, xm)
        apply_scale(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], s)
        xm = layer.post_attention_layernorm(h_mid)
        # 4. up_proj → down_proj
        down_in = _capture_input(mlp.down_proj, partial(mlp, xm))
        s = search_scale(mlp.down_proj, [mlp.down_proj], down_in, down_in)
        apply_scale(mlp.up_proj, [mlp.down_proj], s)
        down_in = _capture_input(mlp.down_proj, partial(mlp, xm))
        # clipping (q_proj and k_proj are skipped: their errors pass through softmax)
        for lin, inp in ((attn.v_proj, xn), (attn.o_proj, o_in), (mlp.gate_proj, xm), (mlp.up_proj, xm),
                         (mlp.down_proj, down_in)):
            apply_clip(lin, search_clip(lin.weight.data, inp))
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(attn, name)
            q, sc, z = quantize_groupwise(lin.weight.data, 4)
            packed[f"model.layers.{li}.self_attn.{name}"] = (q, z, sc)
            lin.weight.data = dequantize_groupwise(q, sc, z).to(lin.weight.dtype)
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(mlp, name)
            q, sc, z = quantize_groupwise(lin.weight.data, 4)
            packed[f"model.layers.{li}.mlp.{name}"] = (q, z, sc)
            lin.weight.data = dequantize_groupwise(q, sc, z).to(lin.weight.dtype)
        h = h_next
        log(f"awq: layer {li} done")
    return packed


def _capture_input(lin: nn.Linear, run: Callable[[], object]) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    hook = lin.register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    try:
        run()
    finally:
        hook.remove()
    return seen[0]


def save_awq_checkpoint(model: Transformer, packed: dict[str, tuple], out: str | pathlib.Path,
                        source_dir: str | pathlib.Path, group_size: int = GROUP_SIZE) -> None:
    """Write an HF directory whose decoder linears are in the AutoAWQ GEMM layout
    (`<name>.qweight`, `.qzeros`, `.scales`) with an AWQ quantization_config."""
    import json
    import pathlib
    import shutil

    from safetensors.torch import save_file

    out, source_dir = pathlib.Path(out), pathlib.Path(source_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in model.state_dict().items():
        mod = name.rsplit(".", 1)[0]
        if mod in packed or (model.args.tie_embeddings and name == "lm_head.weight"):
            continue
        state[name] = t.detach().to(torch.float16).contiguous()
    for mod, (q, zero, scale) in packed.items():
        qweight, qzeros, scales = pack_awq_gemm(q, zero, scale)
        state[f"{mod}.qweight"], state[f"{mod}.qzeros"], state[f"{mod}.scales"] = qweight, qzeros, scales
    save_file(state, out / "model.safetensors")
    cfg = json.loads((source_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm",
                                  "zero_point": True}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in source_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)


# -- the calibration cache ------------------------------------------------------------------------
def awq_cache_dir() -> pathlib.Path | None:
    """CANARY_AWQ_CACHE: the cache folder; "off" (or 0, false, none) turns the cache off. Default
    $XDG_CACHE_HOME/inference-canary/awq (~/.cache/… without it). Deleting the folder clears it."""
    value = os.environ.get("CANARY_AWQ_CACHE", "").strip()
    if value.lower() in ("off", "0", "false", "none"):
        return None
    if value:
        return pathlib.Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "inference-canary" / "awq"


def awq_cache_key(model_dir: str | pathlib.Path, calibration: torch.Tensor) -> str:
    """sha256 over what decides awq_quantize's result: the model's weight files and config (by
    content, not path), the calibration token ids [N, T], torch's version and the source of the
    code it runs (the reference model and the quantizers: an edit there is a new entry, so a
    cached result never outlives the code that computed it)."""
    engines = pathlib.Path(__file__).resolve().parent.parent
    code = source_digest(engines / "reference", engines / "quant")
    h = hashlib.sha256(f"awq int4 g{GROUP_SIZE}; torch {torch.__version__}; code {code}\n".encode())
    h.update(model_digest(model_dir, ("*.safetensors", "*.bin", "config.json")).encode())
    ids = calibration.to(torch.int64).cpu().contiguous()
    h.update(f"calibration {tuple(ids.shape)}\n".encode())
    h.update(ids.numpy().tobytes())
    return h.hexdigest()


def load_awq_cache(model: Transformer, key: str, cache_dir: pathlib.Path | None) -> dict[str, tuple] | None:
    """The cached outcome of awq_quantize for `key`, loaded into `model` (its weights after
    folding and clipping); None on a miss. An unreadable entry is a miss (and is recomputed)."""
    if cache_dir is None:
        return None
    path = cache_dir / f"{key}.pt"
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(entry["state"])
        return {name: (q, zero, scale) for name, (q, zero, scale) in entry["packed"].items()}
    except Exception as e:  # noqa: BLE001 - a damaged entry is recomputed and rewritten
        log.warning("AWQ cache entry %s is unreadable (%s: %s); searching again", path, type(e).__name__, e)
        return None


def store_awq_cache(model: Transformer, packed: dict[str, tuple], key: str, cache_dir: pathlib.Path | None) -> None:
    """Write the entry atomically (a temporary file renamed), so concurrent workers never read half
    of one. A cache that cannot be written costs only the next load's time."""
    if cache_dir is None:
        return
    path = cache_dir / f"{key}.pt"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        state = {name: t.detach().cpu() for name, t in model.state_dict().items()}
        torch.save({"state": state, "packed": {n: list(v) for n, v in packed.items()}}, tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("AWQ cache not written to %s (%s); the next load searches again", path, e)
