"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023; docs/reference.md §3).

A proposer drafts up to k tokens; the target scores all of them in one forward pass. Greedy:
accept while the draft equals the target's argmax, then take the target's token — the output
equals plain greedy decoding. Sampling: accept draft x with probability min(1, p(x)/q(x)); at
the first rejection sample from norm(max(0, p − q)); if all k are accepted, sample a bonus token
from p — the output is distributed exactly as the target's.

Proposers: a draft model sharing the tokenizer (its own KV cache), or n-gram prompt lookup
(the last n tokens matched earlier in the context; the tokens that followed are the drafts,
with q one-hot).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engines.reference.cache import KVCache

if TYPE_CHECKING:
    from engines.reference.model import Transformer


def causal_mask(slots: torch.Tensor, width: int) -> torch.Tensor:
    """[1, 1, T, width]: a query at slot t sees slots ≤ t."""
    return (torch.arange(width, device=slots.device)[None, :] <= slots[:, None])[None, None]


def sample_step(p: torch.Tensor, q: torch.Tensor, x: int, gen: torch.Generator) -> tuple[bool, int]:
    """One draft token x ~ q checked against target p ([V] probabilities). Returns (accepted,
    token): the token is x when accepted, else a sample from norm(max(0, p − q))."""
    if torch.rand((), generator=gen, device=p.device) < torch.clamp(p[x] / q[x], max=1.0):
        return True, x
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    residual = residual / total if total > 0 else p
    return False, int(torch.multinomial(residual, 1, generator=gen))


@dataclass
class SpeculativeCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int, k: int) -> None:
        if proposed == 0:
            return
        if len(self.accepted_per_position) < k:
            self.accepted_per_position.extend([0] * (k - len(self.accepted_per_position)))
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1


class NgramProposer:
    def __init__(self, k: int, n_max: int, n_min: int):
        self.k, self.n_max, self.n_min = k, n_max, n_min

    def reset(self, total_slots: int) -> None:
        pass

    def fresh(self) -> NgramProposer:
        """A proposer for another sequence: this one (it keeps no state)."""
        return self

    def propose(self, seq: list[int], temperature: float,
                gen: torch.Generator) -> tuple[list[int], list[torch.Tensor] | None]:
        for n in range(min(self.n_max, len(seq) - 1), self.n_min - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):  # most recent earlier occurrence first
                if seq[start : start + n] == tail:
                    follow = seq[start + n : start + n + self.k]
                    if follow:
                        return follow, None  # q is one-hot on each draft
        return [], None

    def accept(self, seq_len: int) -> None:
        pass


class DraftModelProposer:
    def __init__(self, model: Transformer, k: int, new_cache: Callable[[int], KVCache]):
        self.model, self.k, self.new_cache = model, k, new_cache

    def fresh(self) -> DraftModelProposer:
        """A proposer for another sequence decoded beside this one: the same draft model, its own cache."""
        return DraftModelProposer(self.model, self.k, self.new_cache)

    def reset(self, total_slots: int) -> None:
        self.cache: KVCache = self.new_cache(total_slots)
        self.valid = 0  # leading tokens of the sequence whose K/V the draft cache holds
        self.slots_total = total_slots
        self.held = 0  # high-water mark: slots written so far (stale drafts included)

    def _forward(self, tokens: list[int], start: int) -> torch.Tensor:
        dev = self.cache.k.device
        slots = torch.arange(start, start + len(tokens), device=dev)
        ids = torch.tensor([tokens], device=dev)
        self.held = max(self.held, start + len(tokens))
        # one token: it attends every slot written so far (no mask, KVCache.attend); several: a
        # causal mask only as wide as the slots they reach, not the whole cache
        mask = start + 1 if len(tokens) == 1 else causal_mask(slots, start + len(tokens))
        logits = self.model(ids, slots[None], slots, self.cache, mask, last_only=True)
        return logits[0, -1].float()

    def propose(self, seq: list[int], temperature: float,
                gen: torch.Generator) -> tuple[list[int], list[torch.Tensor] | None]:
        k = min(self.k, self.slots_total - len(seq))
        if k <= 0:
            return [], None
        logits = self._forward(seq[self.valid :], self.valid)  # catch up on tokens it has not seen
        drafts, qs = [], []
        for i in range(k):
            if temperature > 0:
                q = torch.softmax(logits / temperature, -1)
                x = int(torch.multinomial(q, 1, generator=gen))
                qs.append(q)
            else:
                x = int(logits.argmax())
            drafts.append(x)
            if i < k - 1:
                logits = self._forward([x], len(seq) + i)
        self.valid = len(seq) + k - 1  # fed seq and d1..d(k−1)
        return drafts, (qs if temperature > 0 else None)

    def accept(self, seq_len: int) -> None:
        # drafts beyond what was accepted are stale; keep only entries for accepted tokens
        self.valid = min(self.valid, seq_len - 1)
