"""Speculative decoding's verify step, as the one decode loop (engines/reference/batching.py)
takes it for every row: propose (cut to what the answer has room for), verify in one forward pass
of the target, accept (engines/reference/speculative.py holds the acceptance rule and the
proposers), and count what was drafted and accepted.

On CUDA (engine.static_verify), for generate()'s one request at a time (rows.SpeculativeRows),
the verify pass has one shape for the whole request: the last
token and k drafts, fewer drafts padded with copies of the last token, under a mask made on the
device from the first slot (StaticVerify). It is captured as a CUDA graph once per request and
replayed for every verification: eager, a pass of the 8B-shaped model is bound by kernel launches,
as a plain decode step is (docs/reference.md §12)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from engines.protocol import GenerationRequest, SpeculativeStats
from engines.reference.decode import capture_graph
from engines.reference.speculative import (
    DraftModelProposer,
    NgramProposer,
    SpeculativeCounters,
    sample_step,
)
from engines.sampling import adjust, pick, sampling_probs, token_logprob

if TYPE_CHECKING:
    from engines.reference.cache import KVCache
    from engines.reference.host import DecodeHost


def verify_drafts(logits: torch.Tensor, drafts: list[int], qs: list[torch.Tensor] | None, req: GenerationRequest,
                  out: list[int], gen: torch.Generator) -> tuple[list[int], int]:
    """The tokens one verification pass yields (the accepted drafts, then a correction or a bonus
    token) and how many drafts it accepted. logits[i] predicts the token after drafts[:i]."""
    new: list[int] = []
    accepted = 0
    # greedy with nothing that depends on the tokens picked: every row's argmax in one op
    best = (logits.argmax(-1).tolist() if req.temperature <= 0 and not req.logit_bias
            and not (req.presence_penalty or req.frequency_penalty) else None)
    for i, x in enumerate(drafts):
        # penalties count the drafts accepted so far
        row = logits[i] if best is not None else adjust(logits[i], req, out + new)
        if req.temperature <= 0:
            t = best[i] if best is not None else int(row.argmax())
            ok = t == x
        else:
            p = sampling_probs(row, req.temperature, req.top_p, req.top_k)
            q = (qs[i] if qs is not None
                 else torch.nn.functional.one_hot(torch.tensor(x, device=p.device), p.numel()).to(p))
            ok, t = sample_step(p, q, x, gen)
        new.append(t)
        if not ok:
            return new, accepted
        accepted += 1
    new.append(best[len(drafts)] if best is not None  # bonus token
               else pick(adjust(logits[len(drafts)], req, out + new), req, gen))
    return new, accepted


def propose(proposer: NgramProposer | DraftModelProposer, seq: list[int], req: GenerationRequest, out: list[int],
            gen: torch.Generator) -> tuple[list[int], list[torch.Tensor] | None]:
    """The proposer's drafts after seq (prompt and answer so far), cut to what the answer has room
    for: one correction or bonus token always follows them."""
    drafts, qs = proposer.propose(seq, req.temperature, gen)
    return drafts[: req.max_new_tokens - len(out) - 1], qs


@dataclass(frozen=True)
class Verified:
    """What one verification pass gives a request: its new tokens (cut after an EOS and at
    max_new_tokens), their log-probs when asked, and the step's counts (None when nothing was
    drafted: a plain decode step)."""

    tokens: list[int]
    scored: list
    step: SpeculativeStats | None


def accept(logits: torch.Tensor, drafts: list[int], qs: list[torch.Tensor] | None, req: GenerationRequest,
           out: list[int], gen: torch.Generator, counters: SpeculativeCounters, k: int, eos: int | None) -> Verified:
    """One request's verification: the acceptance rule (verify_drafts), the request's counters,
    and the cuts. Every row of the loop (batching.ContinuousBatch._speculate) takes each step through
    here. logits[i] predicts the token after drafts[:i]."""
    new, accepted = verify_drafts(logits, drafts, qs, req, out, gen)
    counters.record(len(drafts), accepted, k)
    if eos in new:
        new = new[: new.index(eos) + 1]
    new = new[: req.max_new_tokens - len(out)]
    want = req.logprobs
    # the i-th new token was picked from the verification's i-th row
    scored = [token_logprob(logits[i], t, want) for i, t in enumerate(new)] if want is not None else []
    step = SpeculativeStats(1, len(drafts), accepted, tuple(int(i < accepted) for i in range(k))) if drafts else None
    return Verified(new, scored, step)


class StaticVerify:
    """The target's verify pass at a fixed width of k + 1 positions over a cache of S slots:
    tokens [1, k + 1] and the first slot [1] are static device buffers, the slots and the causal
    mask [1, 1, k + 1, S] are made from them on the device, so the pass can be captured. A call
    with n < k + 1 tokens pads with copies of the last one: their rows are not returned, and
    the slots they write lie past every slot a later pass reads before writing it again (each pass
    writes its own slots first). Formats that re-encode whole token groups (KIVI) stay eager:
    padding would move their group boundaries. Captured once per request (its cache is the
    request's own); a failed capture is remembered by the engine and not tried again."""

    def __init__(self, engine: DecodeHost, cache: KVCache, k: int, graphs: bool):
        device = engine.device
        self.engine, self.cache, self.width = engine, cache, k + 1
        self.tokens = torch.zeros(1, k + 1, dtype=torch.long, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.offsets = torch.arange(k + 1, device=device)
        self.j = torch.arange(cache.k.shape[3], device=device)  # [S]
        blocker = cache.store.graph_blocker(False) or engine.verify.capture_failed
        self.graphs_wanted = graphs and device.type == "cuda" and blocker is None
        self.reason = ("wanted, not captured yet" if self.graphs_wanted else
                       blocker or ("CUDA graphs need a CUDA device" if graphs else "off"))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_logits: torch.Tensor | None = None

    def _forward(self) -> torch.Tensor:
        slots = self.start + self.offsets  # [k + 1]
        mask = (self.j[None, :] <= slots[:, None])[None, None]  # [1, 1, k + 1, S]
        return self.engine.model(self.tokens, slots[None], slots, self.cache, mask)[0].float()

    def __call__(self, tokens: list[int], start: int) -> torch.Tensor:
        """tokens (1 to k + 1) written from slot `start` → their logits [len(tokens), V]."""
        n = len(tokens)
        if not 1 <= n <= self.width:
            raise ValueError(f"a verify pass takes 1 to {self.width} tokens, not {n}")
        self.tokens.copy_(torch.tensor([tokens + [tokens[-1]] * (self.width - n)]))
        self.start.fill_(start)
        if self.graphs_wanted and self.graph is None:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            return cast(torch.Tensor, self.graph_logits)[:n]
        return self._forward()[:n]

    def _capture(self) -> None:
        """Warm up on a side stream, then capture (the warm-up passes write the same slots with the
        same tokens as the real one). A failure leaves the pass eager, with the reason kept."""
        self.graphs_wanted = False
        try:
            self.graph, self.graph_logits = capture_graph(self._forward, self.engine.device)
            self.reason = "captured"
        except Exception as e:  # noqa: BLE001 — a capture failure must not fail the request
            self.graph, self.graph_logits = None, None
            self.reason = f"capture failed, verifying eagerly: {type(e).__name__}: {e}"[:500]
            self.engine.verify.capture_failed = self.reason  # not retried for later requests
