"""Where a regression starts (evals/layer_drift.py, engines/reference/layer_states.py): the drift
figures worked by hand on tiny arrays, and the reference engine's per-layer states on the tiny
built-in model, where a KV format changes nothing before layer 0's keys and a config with the
baseline's weights and cache drifts nowhere."""

import math

import numpy as np
import pytest
import torch
from engines.protocol import LayerStates, RollingRequest, WindowSpec
from engines.reference.engine import ReferenceEngine
from engines.spec import OptimizationSpec
from engines.zoo import resolve_model_path
from evals.layer_drift import DIVERGES, LayerDriftRecord, mean_cosine, relative_error, summarize

TARGET = str(resolve_model_path("builtin:pydoc-target"))
TEXT = ("The json module encodes Python objects as JSON text and decodes JSON text back into objects; "
        "dumps returns a string and loads parses one, with options for indentation and key order.")


def test_relative_error_and_cosine_by_hand():
    base = np.array([[3.0, 4.0], [0.0, 1.0]])  # ‖base‖ = √26
    cand = np.array([[3.0, 4.0], [0.0, 2.0]])  # differs by 1 in one entry
    assert relative_error(base, cand) == pytest.approx(1 / math.sqrt(26))
    assert relative_error(base, base) == 0.0
    # row 1 identical (cos 1), row 2 same direction (cos 1); then a right angle on row 2 (cos 0)
    assert mean_cosine(base, cand) == pytest.approx(1.0)
    assert mean_cosine(base, np.array([[3.0, 4.0], [1.0, 0.0]])) == pytest.approx(0.5)


def _record(key, keys, values, attention, hidden):
    return LayerDriftRecord(key, keys, values, attention, hidden, tuple(1.0 for _ in hidden), 8)


def test_first_divergent_site_and_growth_by_hand():
    # layer 0: keys and values below 1e-3, attention past it; the hidden error 0.002 → 0.006 → 0.018: ×3 a layer
    a = _record("a", (0.0005, 0.01, 0.02), (0.0, 0.01, 0.02), (0.002, 0.01, 0.02), (0.002, 0.006, 0.018))
    b = _record("b", (0.0005, 0.01, 0.02), (0.0, 0.01, 0.02), (0.004, 0.01, 0.02), (0.002, 0.006, 0.018))
    summary = summarize([a, b])
    assert summary.first == (0, "attention") and summary.where() == "layer 0 attention"
    assert summary.per_layer["attention"][0] == pytest.approx(0.003)
    assert summary.growth == pytest.approx(3.0)
    # keys past the bound at layer 0 come first in a layer's order
    c = _record("c", (0.01, 0.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0))
    assert summarize([c]).where() == "layer 0 keys"
    # nothing past it anywhere
    z = _record("z", (0.0,) * 3, (0.0,) * 3, (0.0,) * 3, (0.0,) * 3)
    quiet = summarize([z])
    assert quiet.first is None and quiet.growth is None and quiet.where() == f"no layer past {DIVERGES:g}"


def test_record_round_trips_through_its_row():
    r = _record("d", (0.1, 0.2), (0.3, 0.4), (0.5, 0.6), (0.7, 0.8))
    row = r.to_row()
    assert row["metric"] == "layer_drift" and row["value"] == 0.8
    assert LayerDriftRecord.from_row("d", row["value"], row["extra"]) == r


def test_different_tokens_are_not_compared():
    s = LayerStates((1, 2), np.zeros((2, 2, 4)), np.zeros((1, 2, 4)), np.zeros((1, 2, 4)), np.zeros((1, 2, 4)))
    t = LayerStates((1, 3), s.hidden, s.attention, s.keys, s.values)
    assert LayerDriftRecord.measure("x", s, t) is None


def _engine(kv: str = "fp16") -> ReferenceEngine:
    return ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32", kv_cache=kv,
                                                    engine_options={"device": "cpu"}))


@pytest.fixture(scope="module")
def base_states():
    return _engine().layer_states(RollingRequest("d", TEXT, WindowSpec(64, 64)))


def test_states_are_the_pass_perplexity_runs(base_states):
    engine = _engine()
    s = base_states
    L, T = engine.args.n_layers, len(s.token_ids)
    assert s.hidden.shape == (L + 1, T, engine.args.dim) and s.attention.shape == (L, T, engine.args.dim)
    assert s.keys.shape == (L, T, engine.args.n_kv_heads * engine.args.head_dim) == s.values.shape
    # the last hidden state, through the final norm and lm_head, scores the window as the rolling pass does
    with torch.inference_mode():
        h = engine.model.model.norm(torch.from_numpy(s.hidden[-1]))
        logprobs = torch.log_softmax(engine.model.lm_head(h).float(), -1)
    ids = list(s.token_ids)
    picked = [float(logprobs[i, ids[i + 1]]) for i in range(T - 1)]
    rolling = engine.loglikelihood_rolling([RollingRequest("d", TEXT, WindowSpec(64, 64))])[0]
    assert np.allclose(picked, rolling.logprobs[: T - 1], atol=1e-3)  # 1e-6 apart as measured; another pass: > 0.1


def _long_request() -> RollingRequest:
    """A 256-token window: past KIVI's 128-token full-precision window, so its cache holds codes."""
    from engines.zoo import ARTIFACTS
    from engines.zoo.corpus import read_jsonl

    text = " ".join(d.text for d in read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl")[:6])
    return RollingRequest("long", text, WindowSpec(256, 256))


@pytest.fixture(scope="module")
def long_base_states():
    return _engine().layer_states(_long_request())


@pytest.mark.parametrize("kv", ["int2", "kivi-2", "turbo-3", "turbo-3.5"])
def test_a_kv_format_drifts_first_at_layer_zeros_cache_read_back(long_base_states, kv):
    """The same weights and input give the same layer-0 keys and values; what the cache holds for
    them (what the next token reads back) is where the drift starts. turbo-3 stores a rotated domain
    and is read back rotated back: its error is the codebook's (well under 1), not a rotation's (√2)."""
    cand = _engine(kv).layer_states(_long_request())
    assert len(cand.token_ids) == 256
    assert np.array_equal(cand.hidden[0], long_base_states.hidden[0])  # the embeddings
    record = LayerDriftRecord.measure("long", long_base_states, cand)
    assert record is not None
    assert summarize([record]).where() == "layer 0 keys"
    assert DIVERGES < record.keys[0] < 0.6 and DIVERGES < record.values[0] < 0.6
    assert record.hidden[-1] > DIVERGES


def test_kivi_drifts_nowhere_on_a_window_inside_its_full_precision_window(base_states):
    """KIVI keeps the last 128 keys and values in full precision (fp16): on a 43-token window the
    next token reads every one of them so, and the prefill read them so, so nothing drifts past
    fp16 rounding (about 2e-4 here, under DIVERGES)."""
    cand = _engine("kivi-2").layer_states(RollingRequest("d", TEXT, WindowSpec(64, 64)))
    record = LayerDriftRecord.measure("d", base_states, cand)
    assert record is not None and max(record.keys + record.values + record.hidden) < DIVERGES
    assert summarize([record]).first is None


def test_the_baselines_own_config_drifts_nowhere(base_states):
    cand = _engine().layer_states(RollingRequest("d", TEXT, WindowSpec(64, 64)))
    record = LayerDriftRecord.measure("d", base_states, cand)
    assert record is not None and max(record.hidden) == 0.0 and summarize([record]).first is None
