"""Attention over what a KV cache holds, in torch: masked GQA SDPA, TurboQuant's rotated-domain
attention, and KIVI's two-tier attention (compressed slots beside a full-precision window).
The KV formats (kv.py) pick one for their storage; the Triton decode kernels
(engines/kernels) compute the same on packed codes.

Shapes: B batch, H query heads, Hkv key/value heads, T queries, S slots read, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Causal:
    """The mask of a first pass over slots 0…T−1 with no left padding (query t sees slots 0…t),
    given in place of the [B, 1, T, T] tensor: attention takes SDPA's causal kernel (flash where it
    runs) and no mask is built; a 128K prompt's would be 16 GiB. `shape` reads as the tensor's
    would, so a store's S = mask.shape[-1] holds; `dense()` builds it where a tensor is needed."""

    def __init__(self, T: int) -> None:
        self.shape = (1, 1, T, T)

    def dense(self, device: str | torch.device) -> torch.Tensor:
        T = self.shape[-1]
        return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]


def masked_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | Causal | None) -> torch.Tensor:
    """SDPA with a mask under grouped-query attention. q: [B, H, T, D]; k, v: [B, Hkv, S, D];
    mask: [B, 1, T, S], None where every query attends every slot given, or Causal. The G = H/Hkv query
    heads that share a kv head are folded into the query length ([B, Hkv, G·T, D]), so SDPA sees
    equal head counts: flash and memory-efficient attention refuse `enable_gqa` with a mask, and
    the math fallback would copy K and V to every query head (in fp32) on each decode step."""
    if isinstance(mask, Causal):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if H == Hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    G = H // Hkv
    folded = q.reshape(B, Hkv, G * T, D)  # query head h = kv head h // G, then group member h % G
    if mask is None or T == 1:  # no mask, or one row that every folded query shares (it broadcasts)
        return F.scaled_dot_product_attention(folded, k, v, attn_mask=mask).reshape(B, H, T, D)
    m = mask.unsqueeze(2).expand(B, 1, G, T, mask.shape[-1]).reshape(B, 1, G * T, mask.shape[-1])
    return F.scaled_dot_product_attention(folded, k, v, attn_mask=m).reshape(B, H, T, D)


def rotated_attention(q: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, rot: torch.Tensor,
                      mask: torch.Tensor | Causal | None) -> torch.Tensor:
    """q: [B, H, T, D]; kr, vr: [B, Hkv, S, D] rotated-domain codes × norms; rot: Π [D, D].
    ⟨q, Πᵀĉ‖k‖⟩ = ⟨Πq, ĉ‖k‖⟩: rotate the query once and score against the stored codes;
    accumulate Σ pᵢ·ĉᵢ‖vᵢ‖ in the rotated domain and rotate back once."""
    out_rot = masked_gqa_attention(q @ rot.T, kr, vr, mask)
    return out_rot @ rot


SCORE_BYTES = 1 << 30  # the fp32 scores of one query chunk, [B, H, chunk, S], stay within 1 GiB


def query_chunk(rows: int, S: int, budget: int = SCORE_BYTES) -> int:
    """Queries per chunk so that fp32 scores over S slots for `rows` (= B·H) query heads stay
    within `budget` bytes (a multiple of 16, at least 16): 256 for an 8B model (32 heads) at 32K,
    64 at 128K, with SCORE_BYTES. Prefill memory is then O(chunk × S), not O(T × S)."""
    return max(16, budget // (4 * rows * max(S, 1)) // 16 * 16)


CPU_SCORE_BYTES = 2 << 20  # on the CPU, a chunk's fp32 scores stay about cache-sized (2 MiB)


def two_tier_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor,
                       mask: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                       chunk: int | None = None) -> torch.Tensor:
    """Scores read compressed keys where ck, values mix compressed values where cv.
    q: [B, H, T, D]; k, v: raw and kq, vq: dequantized [B, Hkv, S, D]; mask, ck, cv: [B, 1, T, S].
    The G = H/Hkv query heads of a kv head are folded into its query rows ([B, Hkv, G·C, D] against
    [B, Hkv, S, D]), so K and V are never copied per query head; queries run `chunk` at a time
    (default: query_chunk; on the CPU, chunks of about CPU_SCORE_BYTES of scores over all S slots),
    so the scores held are [B, Hkv, G, chunk, S] at most, not [B, H, T, S]. On the CPU a chunk reads
    only the slots up to the last one any of its queries may see (a causal mask's later slots are
    never read; a host sync per chunk, which the GPU path never makes)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    cpu = q.device.type == "cpu"
    chunk = chunk or query_chunk(B * H, S, CPU_SCORE_BYTES if cpu else SCORE_BYTES)
    qg = q.reshape(B, Hkv, G, T, D)  # query head h = kv head h // G, then group member h % G
    scale = 1.0 / D**0.5
    outs = []
    for t0 in range(0, T, chunk):
        def rows(m: torch.Tensor, t0: int = t0) -> torch.Tensor:
            # [B, 1, T, S] → this chunk's rows as [B, 1, 1, C, S] (a 1-row mask broadcasts)
            return (m if m.shape[-2] == 1 else m[:, :, t0 : t0 + chunk])[:, :, None]

        m, ckc, cvc = rows(mask), rows(ck), rows(cv)
        # the slots this chunk reads: all of them, or on the CPU up to the last one it may see
        s1 = int(m.flatten(0, -2).any(0).nonzero().max()) + 1 if cpu and bool(m.any()) else S
        m, ckc, cvc = m[..., :s1], ckc[..., :s1], cvc[..., :s1]
        qc = qg[:, :, :, t0 : t0 + chunk]  # [B, Hkv, G, C, D]
        C = qc.shape[3]
        qf = qc.reshape(B, Hkv, G * C, D)
        s_raw = ((qf @ k[:, :, :s1].transpose(-1, -2)) * scale).reshape(B, Hkv, G, C, s1)
        s_cmp = ((qf @ kq[:, :, :s1].transpose(-1, -2)) * scale).reshape(B, Hkv, G, C, s1)
        scores = torch.where(ckc, s_cmp, s_raw).float().masked_fill_(~m, float("-inf"))
        del s_raw, s_cmp
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        del scores
        compressed = p * cvc  # p where the value is read compressed, else 0; p − it: the rest, exactly
        out = ((compressed.reshape(B, Hkv, G * C, s1) @ vq[:, :, :s1])
               + ((p - compressed).reshape(B, Hkv, G * C, s1) @ v[:, :, :s1]))
        outs.append(out.reshape(B, Hkv, G, C, D))
    return torch.cat(outs, dim=3).reshape(B, H, T, D)


def causal_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over equal head counts, q, k, v: [B, H, T, D] → (out [B, H, T, D], each
    query's log-sum-exp of its scaled scores [B, H, T] in fp32, natural log): what two partial
    attentions need to merge. Flash attention's own kernels give both (memory-efficient attention
    for fp32 on CUDA); SDPA's public call returns no log-sum-exp."""
    T = q.shape[2]
    if q.device.type == "cuda":
        out = None
        if q.dtype in (torch.float16, torch.bfloat16):
            try:  # flash attention: sm80 on, head_dim ≤ 256
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[:2]
            except RuntimeError:  # an older card or another head size: memory-efficient attention takes it
                out = None
        if out is None:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[:2]
    else:  # the CPU's flash attention (meta included)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[:2]
    return out, lse[..., :T].float()  # memory-efficient attention pads the query axis of lse


def windowed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kq: torch.Tensor, vq: torch.Tensor,
                              residual: int) -> torch.Tensor:
    """KIVI's two-tier attention for a first pass over slots 0…T−1 with no padding (Causal), with
    no [T, T] mask or scores. q: [B, H, T, D]; k, v raw and kq, vq dequantized: [B, Hkv, T, D];
    R = residual. Query t reads
      - far: slots j < t − R, key and value compressed: one causal flash pass over kq, vq with the
        queries shifted R + 1 slots on;
      - near: slots t − R ≤ j ≤ t, values raw, keys compressed below R·⌊t/R⌋ (the last key flush)
        and raw from there: at most R + 1 slots, in blocks of R queries over the 2R slots before
        their block's end (the previous block's keys compressed, the block's own raw);
    and the two parts merge by their log-sum-exps. The same as two_tier_attention under the
    masks of KiviKV's boundaries (boundary_k(n) = R⌊(n−1)/R⌋, boundary_v(n) = n − 1 − R)."""
    B, H, T, D = q.shape
    Hkv, R = k.shape[1], residual
    G = H // Hkv
    nb = -(-T // R)
    pad = nb * R - T

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [B, Hkv, T, D] → [B, Hkv, nb, R, D], zeros after slot T − 1
        return F.pad(x, (0, 0, 0, pad)).reshape(B, Hkv, nb, R, D)

    def previous(x: torch.Tensor) -> torch.Tensor:  # block b − 1 beside block b (zeros before block 0)
        return F.pad(x, (0, 0, 0, 0, 1, 0))[:, :, :nb]

    kb, vb = blocks(k), blocks(v)
    kn = torch.cat([previous(blocks(kq)), kb], dim=3)[:, :, None]  # [B, Hkv, 1, nb, 2R, D]
    vn = torch.cat([previous(vb), vb], dim=3)[:, :, None]
    qb = F.pad(q, (0, 0, 0, pad)).reshape(B, Hkv, G, nb, R, D)
    # query r of block b is t = bR + r; near slot c is j = (b − 1)R + c: t − R ≤ j ≤ t ⟺ r ≤ c ≤ R + r
    r, c = torch.arange(R, device=q.device)[:, None], torch.arange(2 * R, device=q.device)[None, :]
    near = ((c >= r) & (c <= R + r))[None].repeat(nb, 1, 1)  # [nb, R, 2R]
    near[0, :, :R] = False  # no slots before 0
    per_block = B * H * R * 2 * R * 4
    step = max(1, SCORE_BYTES // per_block)
    outs, lses = [], []
    for b0 in range(0, nb, step):
        s = ((qb[:, :, :, b0 : b0 + step] * D**-0.5) @ kn[:, :, :, b0 : b0 + step].transpose(-1, -2)).float()
        s = s.masked_fill(~near[b0 : b0 + step], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, nb', R]: every query reads itself, so finite
        outs.append(torch.exp(s - lse[..., None]).to(v.dtype) @ vn[:, :, :, b0 : b0 + step])
        lses.append(lse)
        del s
    out = torch.cat(outs, dim=3).reshape(B, H, nb * R, D)[:, :, :T]
    lse_near = torch.cat(lses, dim=3).reshape(B, H, nb * R)[:, :, :T]
    del outs, lses
    if T <= R + 1:  # no query has a slot more than R before it
        return out
    F0 = T - R - 1  # far: queries R + 1 … T − 1 over slots 0 … T − R − 2
    expand = lambda x: x[:, :, None, :F0].expand(B, Hkv, G, F0, D).reshape(B, H, F0, D)  # noqa: E731
    out_far, lse_far = causal_attention_lse(q[:, :, R + 1 :], expand(kq), expand(vq))
    lse_n = lse_near[:, :, R + 1 :]
    total = torch.logaddexp(lse_far, lse_n)
    merged = (torch.exp(lse_far - total)[..., None] * out_far.float()
              + torch.exp(lse_n - total)[..., None] * out[:, :, R + 1 :].float())
    return torch.cat([out[:, :, : R + 1], merged.to(q.dtype)], dim=2)
