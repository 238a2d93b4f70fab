"""engine-serve's batched forwards multiply by oneDNN-packed linear weights
(engines/reference/packed.py): only inside `active()`, only for a forward of more than one token,
the plain weights everywhere else, on the tiny built-in model in fp32."""

import pytest
import torch
import torch.nn.functional as F
from engines.reference.packed import PackedLinears
from torch import nn

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not in this torch build")


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(64, 96, bias=True)
        self.down = nn.Linear(96, 64, bias=False)
        self.embed = nn.Embedding(10, 64)  # not a linear: left alone


@torch.inference_mode()
def test_packed_weights_serve_only_inside_active_and_only_past_one_token():
    toy = Toy()
    packed = PackedLinears(toy)
    assert [m for m, _ in packed.modules] == [toy.up, toy.down]
    x = torch.randn(2, 5, 64)
    one = torch.randn(1, 1, 64)
    plain, plain_one = toy.up(x), toy.up(one)
    with packed.active():
        inside, inside_one = toy.up(x), toy.up(one)
        assert toy.down(toy.up(x)).shape == (2, 5, 64)
    # oneDNN sums in another order than MKL: close, not always equal
    assert inside.shape == plain.shape and torch.allclose(inside, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(inside_one, plain_one)  # one token keeps the plain weights' GEMV
    assert torch.equal(toy.up(x), plain)  # outside active() the module is as it was
    assert "forward" not in vars(toy.up)
    # and the packed path is the one taken inside: a weight changed after packing is not seen there
    toy.up.weight.data += 1.0
    with packed.active():
        stale = toy.up(x)
    assert torch.allclose(stale, plain, rtol=1e-5, atol=1e-5) and not torch.allclose(toy.up(x), plain)


def test_the_forward_is_restored_when_the_batch_raises():
    toy = Toy()
    packed = PackedLinears(toy)
    with pytest.raises(RuntimeError, match="a step failed"), packed.active():
        raise RuntimeError("a step failed")
    assert "forward" not in vars(toy.up) and "forward" not in vars(toy.down)


def test_over_the_budget_nothing_is_packed_and_the_batch_uses_the_plain_weights():
    toy = Toy()
    assert PackedLinears(toy, budget=1000).modules == []  # 64 × 96 fp32 weights alone take 24 KiB
    with PackedLinears(toy, budget=1000).active():
        x = torch.randn(3, 64)
        assert torch.equal(toy.up(x), F.linear(x, toy.up.weight, toy.up.bias))
