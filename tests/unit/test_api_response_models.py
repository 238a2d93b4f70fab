"""Every API answer has a declared shape: each 2xx response of each route carries a schema with
named properties (not a bare `object`), and the run, comparison and figures shapes follow the
records the workers write (vocabulary.figures.RunFigures, vocabulary.comparison.Comparison). Whether the
answers really match their schemas is schemathesis's check (test_api_schemathesis.py)."""

from __future__ import annotations

import dataclasses

from app.api.main import app
from app.schemas import ComparisonOut, FiguresOut
from engines.protocol import SpeculativeStats
from vocabulary.comparison import Comparison
from vocabulary.figures import RunFigures, ServerFigures, SpeculativeFigures


def _untyped(schema: dict) -> bool:
    if "$ref" in schema:
        return False
    if schema.get("type") == "array":
        return _untyped(schema.get("items", {}))
    if "anyOf" in schema:
        return any(_untyped(s) for s in schema["anyOf"] if s.get("type") != "null")
    return not schema.get("properties")


def test_every_route_declares_the_shape_of_each_success_response():
    spec = app.openapi()
    untyped = []
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            for code, response in operation["responses"].items():
                if not code.startswith("2"):
                    continue
                content = response.get("content", {})
                documents = {"text/html", "text/markdown"}  # the run report, as HTML or Markdown text
                if content and set(content) <= documents and all(
                        content[kind].get("schema") == {"type": "string"} for kind in content):
                    continue
                schema = content.get("application/json", {}).get("schema")
                if schema is None or _untyped(schema):
                    untyped.append(f"{method.upper()} {path} {code}")
    assert not untyped, f"responses without a declared shape: {untyped}"
    assert sum(len(ops) for path, ops in spec["paths"].items() if path.startswith("/api/v1")) >= 29


def test_comparison_response_carries_every_field_of_the_comparison_record():
    record = {f.name for f in dataclasses.fields(Comparison)} - {"config_id"}  # served as the config's name
    assert record <= set(ComparisonOut.model_fields), record - set(ComparisonOut.model_fields)
    assert set(ComparisonOut.model_fields) - record == {"config"}


def _figures(**changes) -> RunFigures:
    base = RunFigures(engine="reference", weights="int8", kv_cache="fp16", speculative="none", device="cpu",
                      compute_dtype="float32", parameters=1000, weight_bytes=1200, kv_bytes_per_token=64, versions={},
                      resident_weight_bytes=None, peak_kv_cache_bytes=4096, peak_device_bytes=None, notes=[],
                      token_ppl=12.5, n_documents=3, n_tokens=40, ttft_ms_p50=10.0, ttft_ms_p99=12.0, tbt_ms_mean=2.0,
                      tbt_ms_p50=2.0, tbt_ms_p99=3.0, tokens_per_second=500.0, generated_tokens=32, concurrency=1,
                      kv_cache_usage=0.25)
    return dataclasses.replace(base, **changes)


def test_figures_round_trip_and_their_response_shape():
    spec = SpeculativeFigures.from_stats(SpeculativeStats(4, 8, 6, (3, 3)))  # 6/8 accepted; 1 + 6/4 per pass; 3/4 at each position
    assert (spec.acceptance_rate, spec.mean_acceptance_length, spec.per_position_rate) == (0.75, 2.5, [0.75, 0.75])
    server = ServerFigures("http://h:8000/metrics", 0.5, 2.0, 4.0)
    full = _figures(server=server, spec=spec)
    assert RunFigures.from_json(full.to_json()) == full
    plain = _figures().to_json()
    assert "server" not in plain and "spec" not in plain  # sections a run did not have are not stored
    # a row stored before a field existed reads with that field None
    assert RunFigures.from_json({k: v for k, v in plain.items() if k != "kv_cache_usage"}).kv_cache_usage is None
    # the response shape: every record field, each optional, plus whatever else an engine reported
    assert set(FiguresOut.model_fields) == {f.name for f in dataclasses.fields(RunFigures)}
    out = FiguresOut.model_validate(full.to_json() | {"extra_engine_note": 1}).model_dump()
    assert out["spec"]["acceptance_rate"] == 0.75 and out["server"]["max_kv_cache_usage"] == 0.5
    assert out["extra_engine_note"] == 1
    assert FiguresOut.model_validate({}).model_dump()["token_ppl"] is None
