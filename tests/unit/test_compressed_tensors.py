"""compressed-tensors read back by hand (engines/quant/compressed_tensors.py): the bit layout, the
zero point along the output dimension, group indices, and the refusals. The real checkpoints
(made by llm-compressor's oneshot) are checked in tests/llm_compressor."""

import pytest
import torch
from engines.quant.compressed_tensors import CheckpointFormatError, check_quantization_config, dequantize_state, unpack_int32

W4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 2, "symmetric": True}


def cfg(**weights) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**W4, **weights}}}}


def test_int4_words_by_hand():
    # values −8, −1, 0, 7 stored +8 → 0, 7, 8, 15 in nibbles 0..3 of one word: 0xF870 = 63600
    assert unpack_int32(torch.tensor([[0xF870]], dtype=torch.int32), 4, 4).tolist() == [[-8, -1, 0, 7]]
    # a word with its top bit set (a negative int32) reads as unsigned: every nibble 8 → 0, and 0xF… → 7
    assert unpack_int32(torch.tensor([[0x88888888 - 2**32]], dtype=torch.int32), 4, 8).tolist() == [[0] * 8]
    assert unpack_int32(torch.tensor([[0xF0000000 - 2**32]], dtype=torch.int32), 4, 8).tolist() == [[-8] * 7 + [7]]
    # 3-bit values cross word boundaries: element 10 holds bits 30..32 (two of word 0, one of word 1)
    values = torch.tensor([3, -4, 0, 1, 2, -1, -2, -3, 3, 0, 1, 2])
    stream = sum(int(v + 4) << (3 * i) for i, v in enumerate(values.tolist()))
    words = [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(2)]
    packed = torch.tensor([[w - 2**32 if w >= 2**31 else w for w in words]], dtype=torch.int32)
    assert unpack_int32(packed, 3, 12).tolist() == [values.tolist()]


def test_symmetric_group_weights_by_hand():
    # one row of 4 weights, groups of 2: q = [1, −2 | 3, 0], scales [0.5, 0.25] → [0.5, −1.0, 0.75, 0.0]
    packed = torch.tensor([[(9) | (6 << 4) | (11 << 8) | (8 << 12)]], dtype=torch.int32)
    state = {"l.weight_packed": packed, "l.weight_scale": torch.tensor([[0.5, 0.25]]),
             "l.weight_shape": torch.tensor([1, 4]), "norm.weight": torch.ones(4)}
    out = dequantize_state(state, cfg())
    assert out["l.weight"].tolist() == [[0.5, -1.0, 0.75, 0.0]] and set(out) == {"l.weight", "norm.weight"}


def test_zero_point_packed_along_the_output_dimension_and_g_idx_by_hand():
    # two rows of 2 weights in two groups of 1 column: zero points z[row, group]
    # [[1, −1], [0, 2]] packed along the rows: word for group 0 holds rows (1, 0) → 9 | 8 << 4,
    # group 1 holds (−1, 2) → 7 | 10 << 4; codes q = [[3, 3], [2, 2]], scales 1 → W = q − z
    zp = torch.tensor([[9 | (8 << 4), 7 | (10 << 4)]], dtype=torch.int32)
    codes = torch.tensor([[11 | (11 << 4)], [10 | (10 << 4)]], dtype=torch.int32)
    state = {"l.weight_packed": codes, "l.weight_scale": torch.ones(2, 2), "l.weight_shape": torch.tensor([2, 2]),
             "l.weight_zero_point": zp}
    assert dequantize_state(state, cfg(group_size=1, symmetric=False))["l.weight"].tolist() == [[2, 4], [2, 0]]
    # activation order: column 0 belongs to group 1 and column 1 to group 0
    state["l.weight_g_idx"] = torch.tensor([1, 0], dtype=torch.int32)
    assert dequantize_state(state, cfg(group_size=1, symmetric=False))["l.weight"].tolist() == [[4, 2], [0, 2]]


def test_an_asymmetric_tensor_scale_by_hand():
    # strategy tensor: one scale 0.5 and one unpacked zero point 2 for the whole weight: W = (q − 2) · 0.5
    state = {"l.weight_packed": torch.tensor([[(3 + 8) | ((0 + 8) << 4)]], dtype=torch.int32),
             "l.weight_scale": torch.tensor([0.5]), "l.weight_shape": torch.tensor([1, 2]),
             "l.weight_zero_point": torch.tensor([2], dtype=torch.int8)}
    c = cfg(strategy="tensor", group_size=None, symmetric=False)
    assert dequantize_state(state, c)["l.weight"].tolist() == [[0.5, -1.0]]


def set_path(c: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    node = c
    for key in parents:
        node = node[key]
    node[last] = value
    return c


@pytest.mark.parametrize("path,value,match", [
    ("format", "float-quantized", "format 'float-quantized'"),
    ("format", "nvfp4-pack-quantized", "format 'nvfp4-pack-quantized'"),
    ("config_groups.group_0.input_activations", {"num_bits": 8}, "quantizes activations"),
    ("config_groups.group_0.output_activations", {"num_bits": 8}, "quantizes activations"),
    ("config_groups.group_0.weights.type", "float", "holds float weights"),
    ("config_groups.group_0.weights.strategy", "block", "strategy 'block'"),
    ("transform_config", {"config_groups": {"u": {}}}, "an online transform"),
    ("sparsity_config", {"format": "sparse-bitmask"}, "sparsity"),
    ("kv_cache_scheme", {"num_bits": 8}, "a quantized KV cache"),
])
def test_what_the_engine_cannot_read_back_is_refused_naming_it_and_no_path(path, value, match):
    with pytest.raises(CheckpointFormatError, match=match) as e:
        check_quantization_config(set_path(cfg(), path, value))
    assert "/" not in str(e.value).replace("W4A16, W8A16", "")  # never the checkpoint's (real) path
