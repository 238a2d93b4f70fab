"""AWQ: the AutoAWQ GEMM layout by hand, function-preserving scale folding, the search beating
RTN where a salient channel exists, and loading a checkpoint written in that layout."""

import pytest
import torch
from engines.protocol import GenerationRequest
from engines.quant import (
    dequantize_awq_gemm,
    dequantize_groupwise,
    fake_quantize,
    pack_awq_gemm,
    quantize_groupwise,
    unpack_awq_gemm,
)
from engines.reference.awq import apply_scale, awq_quantize, save_awq_checkpoint, search_clip, search_scale
from engines.reference.engine import ReferenceEngine
from engines.reference.model import RMSNorm, load_model
from engines.spec import OptimizationSpec
from engines.zoo import ARTIFACTS, resolve_model_path
from engines.zoo.corpus import read_jsonl
from torch import nn

TARGET = resolve_model_path("builtin:pydoc-target")


def test_gemm_packing_order_by_hand():
    # One input row, 8 output columns holding 0..7. Nibble i holds column [0,2,4,6,1,3,5,7][i]:
    # Σ v_i·16^i with v = (0,2,4,6,1,3,5,7) = 1966171168.
    q = torch.arange(8, dtype=torch.uint8)[:, None].repeat(1, 128)  # [out=8, in=128]
    zero, scale = torch.full((8, 1), 3.0), torch.full((8, 1), 0.5)
    zero_per_col = torch.arange(8.0)[:, None]  # zeros pack in the same order as the codes
    assert pack_awq_gemm(q, zero_per_col, scale)[1][0, 0].item() == 1966171168
    qweight, qzeros, scales = pack_awq_gemm(q, zero, scale)
    assert qweight.shape == (128, 1) and qweight.dtype == torch.int32
    assert qweight[0, 0].item() == 1966171168
    assert qzeros.shape == (1, 1) and scales.shape == (1, 8) and scales.dtype == torch.float16
    q2, z2, s2 = unpack_awq_gemm(qweight, qzeros, scales)
    assert torch.equal(q2, q) and torch.equal(z2, zero) and torch.equal(s2, scale)
    # dequantized (q − z)·s: column c holds (c − 3)·0.5
    assert dequantize_awq_gemm(qweight, qzeros, scales)[:, 0].tolist() == [(c - 3) * 0.5 for c in range(8)]


def test_round_trip_with_high_nibbles_and_negative_int32():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g)
    q, s, z = quantize_groupwise(w, 4)
    packed = pack_awq_gemm(q, z, s)
    q2, z2, s2 = unpack_awq_gemm(*packed)
    assert torch.equal(q2, q) and torch.equal(z2, z)
    assert (packed[0] < 0).any()  # nibble 7 ≥ 8 sets the sign bit of the int32
    assert torch.allclose(s2, s, rtol=1e-3)  # scales are stored in fp16


def test_scale_folding_preserves_the_function():
    torch.manual_seed(0)
    x = torch.randn(5, 128)
    norm, lin = RMSNorm(128, 1e-5), nn.Linear(128, 64, bias=False)
    norm.weight.data = torch.rand(128) + 0.5
    before = lin(norm(x))
    apply_scale(norm, [lin], torch.rand(128) + 0.5)
    assert torch.allclose(lin(norm(x)), before, atol=1e-5)
    up, down = nn.Linear(128, 256, bias=False), nn.Linear(256, 32, bias=False)
    before = down(up(x))
    apply_scale(up, [down], torch.rand(256) + 0.5)
    assert torch.allclose(down(up(x)), before, atol=1e-4)


def test_search_beats_round_to_nearest_on_a_salient_channel():
    # Channel 0 carries activations 50× the others: AWQ scales its weights up before quantizing.
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    x[:, 0] *= 50
    lin = nn.Linear(128, 64, bias=False)
    ref = lin(x)
    rtn = (x @ fake_quantize(lin.weight.data, 4).T - ref).pow(2).mean()
    s = search_scale(lin, [lin], x, x)
    assert s.argmax() == 0
    awq = (x @ (fake_quantize(lin.weight.data * s, 4) / s).T - ref).pow(2).mean()
    assert awq < 0.8 * rtn
    w = lin.weight.data
    max_val = search_clip(w, x)
    clipped = torch.clamp(w.reshape(64, 1, 128), -max_val, max_val).reshape(64, 128)
    err_clip = (x @ fake_quantize(clipped, 4).T - ref).pow(2).mean()
    err_plain = (x @ fake_quantize(w, 4).T - ref).pow(2).mean()
    assert err_clip <= err_plain and (max_val < w.abs().reshape(64, 1, 128).amax(-1, keepdim=True)).any()



def test_clip_search_picks_what_the_elementwise_definition_picks():
    # llm-awq's auto_clip: per (row, group) and shrink i, the output error mean_n (Σ_g X[n,G,g]·(Q(clip W) − W)[c,G,g])²,
    # computed here over the whole [co, n, G, g] product; search_clip takes it as one matmul per group
    torch.manual_seed(1)
    w, x = torch.randn(24, 256), torch.randn(40, 256)
    x[:, 7] *= 30
    xg, wg = x.reshape(1, 40, 2, 128), w.reshape(24, 1, 2, 128)
    max0 = wg.abs().amax(-1, keepdim=True)
    errs = []
    for i in range(10):
        m = max0 * (1 - i / 20)
        q = fake_quantize(torch.clamp(wg, -m, m).reshape(24, 256), 4).reshape(wg.shape)
        errs.append(((xg * (q - wg)).sum(-1)).pow(2).mean(1))  # [co, G]
    errs_t = torch.stack(errs)  # [shrink, co, G]
    best = errs_t.argmin(0)
    got = search_clip(w, x).reshape(24, 2)
    shrink = torch.round((1 - got / max0.reshape(24, 2)) * 20).long()  # which grid point it kept
    assert torch.allclose(got, max0.reshape(24, 2) * (1 - shrink / 20))
    # the same point, or one whose error ties the best's to float rounding (sums in another order)
    chosen = errs_t.gather(0, shrink[None])[0]
    assert torch.all(chosen <= errs_t.min(0).values * (1 + 1e-5))
    assert (shrink == best).float().mean() > 0.9
    assert (best > 0).any() and (best == 0).any()  # both clipped and unclipped groups

@pytest.mark.integration
def test_awq_checkpoint_in_autoawq_layout_loads_with_its_dequantized_weights(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    text = " ".join(d.text for d in read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl")[300:330])
    cal = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][: 2 * 64]).reshape(2, 64)  # the layout, not the search
    model = load_model(TARGET)
    packed = awq_quantize(model, cal)
    assert len(packed) == 6 * 7
    save_awq_checkpoint(model, packed, tmp_path / "awq", TARGET)
    loaded = load_model(tmp_path / "awq")
    for name, (q, zero, scale) in packed.items():
        expected = dequantize_groupwise(q, scale.half().float(), zero)  # scales travel in fp16
        assert torch.equal(loaded.get_submodule(name).weight.float(), expected)
    e = ReferenceEngine(str(tmp_path / "awq"), OptimizationSpec(engine="reference", weights="fp32"))
    assert e.generate([GenerationRequest("g", "os.path", 4)])[0].token_ids


def test_awq_without_calibration_is_refused():
    with pytest.raises(ValueError, match="weights: 'awq-int4' needs calibration text"):
        ReferenceEngine(str(TARGET), OptimizationSpec(engine="reference", weights="awq-int4"))


# -- the calibration cache ------------------------------------------------------------------------
def _calibration(start: int) -> list[str]:
    return [d.text for d in read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl")[start : start + 20]]


def _awq_engine(calibration: list[str]) -> ReferenceEngine:
    spec = OptimizationSpec(engine="reference", weights="awq-int4",
                            engine_options={"calibration_samples": 2, "calibration_tokens": 64})
    return ReferenceEngine(str(TARGET), spec, calibration=calibration)


def _ppl_logprobs(engine: ReferenceEngine) -> tuple[float, ...]:
    from engines.protocol import RollingRequest, WindowSpec

    doc = read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl")[0].text
    return engine.loglikelihood_rolling([RollingRequest("d", doc, WindowSpec(64, 64))])[0].logprobs


@pytest.mark.integration
def test_awq_search_is_cached_on_disk_and_the_cached_engine_is_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("CANARY_AWQ_CACHE", str(tmp_path / "cache"))
    first = _awq_engine(_calibration(300))
    assert first.awq_from_cache is False and len(list((tmp_path / "cache").glob("*.pt"))) == 1
    second = _awq_engine(_calibration(300))
    assert second.awq_from_cache is True
    # the same weights after folding and clipping, the same INT4 codes, the same log-probs
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[name], tensor), name
    assert first.packed.keys() == second.packed.keys()
    for name, parts in first.packed.items():
        assert all(torch.equal(a, b) for a, b in zip(parts, second.packed[name], strict=True)), name
    assert _ppl_logprobs(second) == _ppl_logprobs(first)
    assert (second.quantized_params, second.quantized_bytes) == (first.quantized_params, first.quantized_bytes)
    # other calibration text is another entry, searched afresh
    other = _awq_engine(_calibration(340))
    assert other.awq_from_cache is False and len(list((tmp_path / "cache").glob("*.pt"))) == 2


def test_awq_cache_key_follows_the_weights_not_the_path(tmp_path):
    import shutil

    from engines.reference.awq import awq_cache_key

    ids = torch.arange(128).reshape(2, 64)
    copy = tmp_path / "copy"
    shutil.copytree(TARGET, copy)
    assert awq_cache_key(copy, ids) == awq_cache_key(TARGET, ids)  # same content elsewhere: same entry
    assert awq_cache_key(TARGET, ids + 1) != awq_cache_key(TARGET, ids)
    assert awq_cache_key(TARGET, ids.reshape(4, 32)) != awq_cache_key(TARGET, ids)
    with (copy / "model.safetensors").open("r+b") as f:  # one byte of the weights changed
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert awq_cache_key(copy, ids) != awq_cache_key(TARGET, ids)


@pytest.mark.integration
def test_awq_cache_off_writes_nothing_and_a_damaged_entry_is_searched_again(tmp_path, monkeypatch):
    from engines.reference.awq import awq_cache_dir

    monkeypatch.setenv("CANARY_AWQ_CACHE", "off")
    assert awq_cache_dir() is None
    assert _awq_engine(_calibration(300)).awq_from_cache is False
    monkeypatch.setenv("CANARY_AWQ_CACHE", str(tmp_path))
    reference = _awq_engine(_calibration(300))
    (entry,) = tmp_path.glob("*.pt")
    entry.write_bytes(b"not a torch file")
    again = _awq_engine(_calibration(300))
    assert again.awq_from_cache is False and _ppl_logprobs(again) == _ppl_logprobs(reference)
    assert _awq_engine(_calibration(300)).awq_from_cache is True  # rewritten by the search
    monkeypatch.delenv("CANARY_AWQ_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert awq_cache_dir() == tmp_path / "xdg" / "inference-canary" / "awq"
