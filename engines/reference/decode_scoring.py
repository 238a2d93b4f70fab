"""Decode-regime scoring: a document's tokens teacher-forced one per decode step.

The rolling pass (ReferenceEngine.loglikelihood_rolling) scores a window in one prefill. Servers
differ on whether a prompt's prefill reads its compressed KV cache at all (vLLM attends over the
new keys and values before they are quantized into the cache), so a perplexity from the prefill
can show nothing for a KV format that breaks every long answer. Here each token is written to
the cache and the next one is predicted from what the cache gives back, as decoding does: the
same windows, the same scored tokens, one Decoder step per position.

Shapes: B windows in a batch, W the widest window's inputs, V vocabulary.
"""

from __future__ import annotations

import torch


def score_windows(engine, jobs: list) -> dict[int, tuple[list[float], list[int]]]:
    """jobs: (document index, input ids, scored count n, targets) as ReferenceEngine._windows
    makes them → {job: (log p of its n targets, argmax token at each)}. Windows of a batch are
    right-padded: a row's padding comes after its last input, so no real position reads it."""
    order = sorted(range(len(jobs)), key=lambda j: (len(jobs[j][1]), j))
    out: dict[int, tuple[list[float], list[int]]] = {}
    for s in range(0, len(order), engine.batch_size):
        idx = order[s : s + engine.batch_size]
        width = max(len(jobs[j][1]) for j in idx)
        pad = engine.start_id
        # the token each position predicts: the next input, and after the last input its target
        x = torch.tensor([jobs[j][1] + [pad] * (width - len(jobs[j][1])) for j in idx], device=engine.device)
        y = torch.tensor([jobs[j][1][1:] + [jobs[j][3][-1]] + [pad] * (width - len(jobs[j][1])) for j in idx],
                         device=engine.device)  # [B, W]
        decoder = engine.decoder(len(idx), width)
        decoder.prepare()
        picked, greedy = torch.empty(len(idx), width), torch.empty(len(idx), width, dtype=torch.long)
        logits = decoder.prefill(x[:, :1])
        for t in range(width):
            if t:
                logits = decoder.step(x[:, t])
            logprobs = torch.log_softmax(logits.float(), -1)  # [B, V]
            picked[:, t] = logprobs.gather(-1, y[:, t, None]).squeeze(-1).cpu()
            greedy[:, t] = logprobs.argmax(-1).cpu()
        engine._track(decoder.cache)
        engine._track_usage(sum(len(jobs[j][1]) for j in idx), decoder.cache)
        for row, j in enumerate(idx):
            length, n = len(jobs[j][1]), jobs[j][2]
            out[j] = (picked[row, length - n : length].tolist(), greedy[row, length - n : length].tolist())
    return out
