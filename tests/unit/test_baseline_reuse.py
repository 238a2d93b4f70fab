"""A gate's baseline takes an earlier run's results when nothing that decides them changed
(workers/baseline_reuse.py inputs_key), on the embedded default with the real tiny model: the second
gate's baseline rows are the first's, row for row, and its verdict the same; a rewritten model
file, a manual run or CANARY_GATE_REUSE_BASELINE=false computes it again."""

import shutil

import pytest
from app import repo
from app.config_file import parse_config
from app.db import session_scope
from app.dispatch import InlineDispatcher
from app.models import SampleResult
from app.schemas import jsonable
from app.services import apply_config_file, run_summary, start_run
from engines.zoo import resolve_model_path
from sqlalchemy import select


def _config(model_path: str) -> dict:
    return {
        "project": "p",
        "model": {"name": "tiny", "path": model_path},
        "configs": [{"name": "fp16", "baseline": True, "engine": "reference", "weights": "fp16"},
                    {"name": "int8", "engine": "reference", "weights": "int8"}],
        "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 10, "seed": 3,
                    "scorers": ["perplexity", "generation", "labelled"], "perplexity": {"window": 64},
                    "labelled": {"items": "builtin:pydoc-next-word", "max_items": 4},
                    "generation": {"prompts": 2, "prompt_words": 6, "max_new_tokens": 4}}],
    }


def _gate(key: str, trigger: str = "gate") -> dict:
    run_id, _ = start_run("p", "s", ["int8"], InlineDispatcher(), trigger=trigger, idempotency_key=key)
    with session_scope() as s:
        summary = jsonable(run_summary(s, repo.get_run(s, repo.get_project(s, "p"), run_id)))
        baseline_id = repo.get_config(s, repo.get_project(s, "p"), "fp16").id
        rows = s.execute(select(SampleResult.sample_key, SampleResult.metric, SampleResult.value, SampleResult.extra)
                         .where(SampleResult.run_id == run_id, SampleResult.config_id == baseline_id)
                         .order_by(SampleResult.sample_key, SampleResult.metric)).all()
    return {**summary, "baseline_rows": [tuple(r) for r in rows]}


@pytest.fixture
def model_copy(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(resolve_model_path("builtin:pydoc-target"), path)
    return path


def _apply(model_path) -> None:
    with session_scope() as s:
        apply_config_file(s, parse_config(_config(str(model_path))))


@pytest.mark.integration
def test_a_second_gate_takes_the_first_gates_baseline_rows(sqlite_env, model_copy):
    _apply(model_copy)
    first = _gate("g1")
    second = _gate("g2")
    assert first["status"] == second["status"] == "done"
    assert first["figures"]["fp16"].get("reused_from_run") is None
    assert second["figures"]["fp16"]["reused_from_run"] == first["run_id"]
    assert second["figures"]["fp16"]["inputs_key"] == first["figures"]["fp16"]["inputs_key"]
    # every row of the baseline, value and extra (token ids, text), as the first gate computed it
    # (10 documents, 2 generations and 4 labelled items)
    assert second["baseline_rows"] == first["baseline_rows"] and len(first["baseline_rows"]) == 10 + 2 + 4
    # the candidate ran again; its comparisons are the same figures
    assert second["figures"]["int8"].get("reused_from_run") is None
    ratio = {g["run_id"]: next(c for c in g["comparisons"] if c["config"] == "int8" and c["metric"] == "ppl_ratio")
             for g in (first, second)}
    assert ratio[first["run_id"]]["estimate"] == pytest.approx(ratio[second["run_id"]]["estimate"], abs=1e-12)
    assert first["verdict"] == second["verdict"]
    flips = [next(c for c in g["comparisons"] if c["config"] == "int8" and c["metric"] == "task_flips") for g in
             (first, second)]
    assert flips[0]["n"] == flips[1]["n"] == 4 and flips[0]["estimate"] == flips[1]["estimate"]
    # a third gate names the run that computed the rows, not the one that copied them
    assert _gate("g3")["figures"]["fp16"]["reused_from_run"] == first["run_id"]


@pytest.mark.integration
def test_a_rewritten_model_file_a_manual_run_or_the_setting_off_compute_the_baseline_again(
        sqlite_env, model_copy, monkeypatch):
    from app.settings import get_settings
    from engines.fingerprint import weights_digest

    _apply(model_copy)
    loaded = weights_digest(model_copy)
    first = _gate("g1")
    # the weights each config loaded, by content (the release report's environment names them)
    assert first["figures"]["fp16"]["model_digest"] == first["figures"]["int8"]["model_digest"] == loaded
    assert _gate("m1", trigger="manual")["figures"]["fp16"].get("reused_from_run") is None  # only gates reuse
    monkeypatch.setenv("CANARY_GATE_REUSE_BASELINE", "false")
    get_settings.cache_clear()
    assert _gate("g2")["figures"]["fp16"].get("reused_from_run") is None
    monkeypatch.delenv("CANARY_GATE_REUSE_BASELINE")
    get_settings.cache_clear()
    # the same path, another checkpoint: the key follows the files' content
    config = model_copy / "config.json"
    config.write_text(config.read_text() + "\n")
    changed = _gate("g3")
    assert changed["figures"]["fp16"].get("reused_from_run") is None
    assert changed["figures"]["fp16"]["inputs_key"] != first["figures"]["fp16"]["inputs_key"]
    assert changed["figures"]["fp16"]["model_digest"] == weights_digest(model_copy) != loaded
    assert _gate("g4")["figures"]["fp16"]["reused_from_run"] == changed["run_id"]
