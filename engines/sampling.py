"""The sampling distribution of one decode step, as vLLM's sampler builds it: logits ÷ temperature,
then top-k (keep the k most likely tokens; 0 or -1: all), then top-p (keep the smallest set of the
most likely tokens whose probability reaches top_p; the most likely token always stays), then
renormalise. Greedy decoding (temperature 0) never comes here.

Speculative decoding verifies drafts against this filtered target distribution, so what it emits
follows the same law as plain sampling with the same parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engines.protocol import GenerationRequest


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """[V] logits → [V] probabilities of the next token."""
    probs = torch.softmax(logits.float() / temperature, -1)
    if 0 < top_k < probs.numel():
        kth = probs.topk(top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        ordered, index = probs.sort(descending=True)
        before = ordered.cumsum(-1) - ordered  # mass of the tokens more likely than each one
        keep = before < top_p * ordered.sum()  # the first token always (nothing is before it)
        probs = torch.zeros_like(probs).scatter(-1, index, torch.where(keep, ordered, torch.zeros_like(ordered)))
    return probs / probs.sum()


def token_logprob(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """log p(token) under the model's own distribution (before temperature and filters, as vLLM
    reports it by default) and the `top` most likely tokens with theirs."""
    logprobs = torch.log_softmax(logits.float(), -1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, index = logprobs.topk(min(top, logprobs.numel()))
        alternatives = tuple(zip(index.tolist(), values.tolist(), strict=True))
    return float(logprobs[token]), alternatives


def adjust_logits(logits: torch.Tensor, generated: list[int], presence: float = 0.0, frequency: float = 0.0,
                  bias: tuple[tuple[int, float], ...] = ()) -> torch.Tensor:
    """The logits a sampler picks from, as vLLM adjusts them before temperature: `bias` (OpenAI's
    logit_bias) added, then each token already generated lowered by `presence` once and by
    `frequency` per time it appeared (OpenAI's presence_penalty and frequency_penalty, over the
    output only). The log-probs a server reports stay the model's own."""
    if not (bias or (generated and (presence or frequency))):
        return logits
    out = logits.float().clone()
    for token, value in bias:
        out[token] += value
    if generated and (presence or frequency):
        ids, counts = torch.tensor(generated, device=out.device).unique(return_counts=True)
        out[ids] -= presence + frequency * counts.to(out.dtype)
    return out


def adjust(logits: torch.Tensor, req: GenerationRequest, generated: list[int]) -> torch.Tensor:
    """The request's penalties and logit bias applied, given the tokens generated so far."""
    return adjust_logits(logits, generated, req.presence_penalty, req.frequency_penalty, req.logit_bias)


def pick(logits: torch.Tensor, req: GenerationRequest, gen: torch.Generator) -> int:
    """Greedy at temperature 0, else a sample from the request's (top-p, top-k) distribution."""
    if req.temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(sampling_probs(logits, req.temperature, req.top_p, req.top_k), 1, generator=gen))
