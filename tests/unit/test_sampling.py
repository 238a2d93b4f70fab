"""The sampling distribution (engines/sampling.py), worked by hand."""

import math

import pytest
import torch
from engines.sampling import sampling_probs

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))  # temperature 1 gives these back


def test_temperature_one_is_the_softmax():
    assert sampling_probs(LOGITS, 1.0).tolist() == pytest.approx([0.5, 0.2, 0.15, 0.1, 0.05])
    hot = sampling_probs(LOGITS, 2.0)  # p^(1/2), renormalised
    roots = [math.sqrt(p) for p in (0.5, 0.2, 0.15, 0.1, 0.05)]
    assert hot.tolist() == pytest.approx([r / sum(roots) for r in roots])


def test_top_k_keeps_the_k_most_likely():
    assert sampling_probs(LOGITS, 1.0, top_k=2).tolist() == pytest.approx([0.5 / 0.7, 0.2 / 0.7, 0, 0, 0])
    assert sampling_probs(LOGITS, 1.0, top_k=0).tolist() == pytest.approx([0.5, 0.2, 0.15, 0.1, 0.05])  # off


@pytest.mark.parametrize("top_p, kept", [
    (0.5, 1),     # 0.5 alone reaches 0.5
    (0.6, 2),     # 0.5 < 0.6: the next one (0.2) joins; 0.7 ≥ 0.6
    (0.85, 3),    # 0.5 + 0.2 = 0.7 < 0.85 → 0.15 joins: 0.85
    (0.86, 4),
    (1e-9, 1),    # the most likely token always stays
])
def test_top_p_keeps_the_smallest_set_that_reaches_it(top_p, kept):
    probs = sampling_probs(LOGITS, 1.0, top_p=top_p)
    base = [0.5, 0.2, 0.15, 0.1, 0.05][:kept]
    assert probs.tolist() == pytest.approx([p / sum(base) for p in base] + [0] * (5 - kept))


def test_top_k_then_top_p():
    # top-k 3 leaves 0.5, 0.2, 0.15 (renormalised: 0.588, 0.235, 0.176); top-p 0.7 of that keeps two
    probs = sampling_probs(LOGITS, 1.0, top_p=0.7, top_k=3)
    assert probs.tolist() == pytest.approx([0.5 / 0.7, 0.2 / 0.7, 0, 0, 0])


def test_logit_bias_then_presence_and_frequency_penalties_by_hand():
    from engines.sampling import adjust_logits

    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # token 1 generated twice, token 3 once: −(presence + frequency × count)
    out = adjust_logits(logits, [1, 3, 1], presence=0.5, frequency=0.25, bias=((0, 10.0),))
    assert out.tolist() == pytest.approx([11.0, 2.0 - 0.5 - 0.5, 3.0, 4.0 - 0.5 - 0.25])
    assert adjust_logits(logits, [1, 3]) is logits  # nothing asked: the logits as they are
