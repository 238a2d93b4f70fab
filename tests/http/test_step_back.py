"""Step back one layer, end to end on the embedded default (SQLite, the task code in this process,
the real tiny model): a gate on a stacked config (int8 weights + naive int2 KV cache on the
outlier model, where int2 keys collapse) breaches; the run gains its two single-optimization
ablations on the same documents and seed, the gate waits for them, the KV layer takes the largest
share of the loss, and the verdict, the alert delivered to a real receiver, the gate summary and
the run's API response name it."""

from __future__ import annotations

import json
import math

from app import repo
from app.api.routes.gates import gate_out
from app.api.routes.views import overview
from app.config_file import parse_config
from app.db import session_scope
from app.gates import decide, record_gate
from app.models import ConfigRun, Gate, Run, SampleResult
from app.prometheus import CanaryCollector
from app.schemas import RunOut, jsonable
from app.services import apply_config_file, run_summary, start_run
from engines.zoo import resolve_corpus_path
from evals.step_back import format_share
from sqlalchemy import select


class StepDispatcher:
    """Holds the tasks sent, so the test runs them one at a time and looks between them."""

    def __init__(self):
        self.sent: list[tuple[str, tuple]] = []

    def send(self, task, *args, priority=0):
        self.sent.append((task, args))

    def run_all(self, until: str | None = None) -> list[str]:
        """Every task sent (and those they send), or up to the first that returns `until`."""
        from workers.tasks import INLINE

        results = []
        while self.sent and until not in results:
            task, args = self.sent.pop(0)
            results.append(INLINE[task](*args, dispatcher=self))
        return results


def config(url: str, corpus: str, stacked_opt_out: bool = False) -> dict:
    stacked = {"name": "int8-kv2", "engine": "reference", "weights": "int8", "kv_cache": "int2"}
    return {
        "project": "p",
        "model": {"name": "outlier", "path": "builtin:pydoc-outlier"},
        "configs": [{"name": "fp16", "baseline": True, "engine": "reference", "weights": "fp16"},
                    {**stacked, **({"step_back": False} if stacked_opt_out else {})},
                    {"name": "int8", "engine": "reference", "weights": "int8"}],
        "suites": [{"name": "s", "corpus": corpus, "samples": 4, "seed": 3, "scorers": ["perplexity"],
                    "perplexity": {"window": 64}}],
        "thresholds": {"ppl_ratio": {"warn": 1.01, "critical": 1.03, "min_n": 3}},
        "channels": [{"name": "hook", "kind": "webhook", "url": url}],
    }


def small_corpus(tmp_path) -> str:
    lines = resolve_corpus_path("builtin:pydoc-heldout").read_text().splitlines()[:6]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines))
    return str(path)


def test_a_breaching_stacked_gate_steps_back_and_names_the_kv_layer(sqlite_env, receiver, tmp_path):
    with session_scope() as s:
        apply_config_file(s, parse_config(config(receiver.url + "/hook", small_corpus(tmp_path))))
    dispatcher = StepDispatcher()
    run_id, _ = start_run("p", "s", ["int8-kv2"], dispatcher, trigger="gate", idempotency_key="gate:k1")
    with session_scope() as s:
        gate_id = record_gate(s, repo.get_project(s, "p"), run_id, "int8-kv2", "fp16", {"suite": "s"}, "k1").id
    # the two config-runs, then the first aggregation: a breach of a stacked config adds its layers
    assert dispatcher.run_all(until="step-back")[-1] == "step-back"
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run.status == "running" and run.verdict is None  # no verdict until the layers are in
        assert s.get(Gate, gate_id).verdict is None  # the gate waits for them
        layers = {cr.config.name: (cr.config.ablation_axis, cr.config.spec, cr.status) for cr in run.config_runs
                  if cr.config.ablation_of_id is not None}
        assert receiver.delivered() == []  # nor is anyone alerted yet
    # int8 alone is already a config of the project, but not of this run: both layers are derived
    assert layers == {
        "int8-kv2~weights-only": ("weights", {"engine": "reference", "weights": "int8", "kv_cache": "auto",
                                              "speculative": {"method": "off"}, "engine_options": {}}, "queued"),
        "int8-kv2~kv_cache-only": ("kv_cache", {"engine": "reference", "weights": "fp16", "kv_cache": "int2",
                                                "speculative": {"method": "off"}, "engine_options": {}}, "queued")}
    dispatcher.run_all()  # the layers, the last aggregation, the notification

    with session_scope() as s:
        project = repo.get_project(s, "p")
        run = s.get(Run, run_id)
        assert run.status == "done" and run.verdict == "fail"
        ids = {cr.config.name: cr.config_id for cr in run.config_runs}
        # the same documents for every config of the run: the layers' NLLs pair with the baseline's
        keys = {name: {r.sample_key for r in s.scalars(select(SampleResult).where(
            SampleResult.run_id == run_id, SampleResult.config_id == config_id, SampleResult.metric == "nll"))}
            for name, config_id in ids.items()}
        assert len(keys["fp16"]) == 4 and all(k == keys["fp16"] for k in keys.values()), keys
        assert set(keys["fp16"]) == set(run.sample_keys)
        finished = [cr.finished_at for cr in s.scalars(select(ConfigRun).where(ConfigRun.run_id == run_id))]
        gate = s.get(Gate, gate_id)
        decide(s, run_id)
        assert gate.verdict == "fail" and max(finished) <= run.finished_at  # decided after every layer ran
        summary = jsonable(run_summary(s, run))
        out = gate_out(s, project, gate)
        # the project's configs, its overview and its Prometheus gauges do not list the derived layers
        assert [c.name for c in repo.list_configs(s, project)] == ["fp16", "int8-kv2", "int8"]
        tiles = overview(project, s, suite="s")["models"]["outlier"]
        assert [tile["config"] for tile in tiles] == ["fp16", "int8-kv2", "int8"]
    gauges = {sample.labels["config"] for family in CanaryCollector(session_scope).collect()
              if family.name == "canary_ppl_ratio" for sample in family.samples}
    assert gauges == {"int8-kv2"}

    comps = {(c["config"], c["metric"]): c for c in summary["comparisons"]}
    stacked = comps[("int8-kv2", "ppl_ratio")]["estimate"]
    alone = {axis: comps[(f"int8-kv2~{axis}-only", "ppl_ratio")]["estimate"] for axis in ("weights", "kv_cache")}
    assert comps[("int8-kv2", "ppl_ratio")]["verdict"] == "critical"
    # the shares by their definition, from the stored ratios: log r_axis / Σ log r
    total = math.log(alone["weights"]) + math.log(alone["kv_cache"])
    [found] = summary["step_back"]
    assert found["config"] == "int8-kv2" and found["metric"] == "ppl_ratio" and found["disable"] == "kv_cache"
    shares = {layer["axis"]: layer["share"] for layer in found["layers"]}
    assert shares["kv_cache"] > shares["weights"] and shares["kv_cache"] > 0.5, (alone, stacked)
    assert shares["kv_cache"] == math.log(alone["kv_cache"]) / total
    assert found["interaction"] == math.log(stacked) - total
    advice = found["advice"]
    assert advice.startswith(f"disable kv_cache int2: {format_share(shares['kv_cache'])} of the ppl_ratio loss "
                             f"(ppl_ratio {alone['kv_cache']:.4g} alone)")
    RunOut.model_validate(summary)  # the API's response model carries it
    # the verdict, the gate summary and the alert name the layer to disable; the layers decide nothing
    assert f"step back int8-kv2: {advice}" in summary["verdict_reason"]
    assert "~" not in summary["verdict_reason"].split("; step back")[0]
    assert f" — step back: {advice}" in out["summary_markdown"]  # in the verdict's lines, as on every surface
    assert "| kv_cache int2 |" in out["summary_markdown"]
    delivered = [json.loads(d["body"]) for d in receiver.delivered()]
    assert len(delivered) == 1  # one message: the critical alert of the stacked config (it inhibits the warn)
    alert = delivered[0]["alerts"][0]
    assert alert["labels"]["config"] == "int8-kv2" and alert["labels"]["metric"] == "ppl_ratio"
    assert alert["annotations"]["step_back"] == advice
    assert alert["annotations"]["description"].endswith(
        f"Step back: {advice}. Runbook: docs/runbooks.md#canaryperplexityratiohigh")  # app/runbooks.py


def test_a_config_of_the_run_is_reused_as_a_layer_and_step_back_false_opts_out(sqlite_env, receiver, tmp_path,
                                                                                 monkeypatch):
    corpus = small_corpus(tmp_path)
    with session_scope() as s:
        apply_config_file(s, parse_config(config(receiver.url + "/hook", corpus)))
    dispatcher = StepDispatcher()
    run_id, _ = start_run("p", "s", None, dispatcher)
    dispatcher.run_all()
    with session_scope() as s:
        run = s.get(Run, run_id)
        derived = [cr.config.name for cr in run.config_runs if cr.config.ablation_of_id is not None]
        summary = jsonable(run_summary(s, run))
    assert derived == ["int8-kv2~kv_cache-only"]  # the weights layer is the run's own `int8`
    [found] = summary["step_back"]
    assert {layer["axis"]: layer["config"] for layer in found["layers"]} == {
        "weights": "int8", "kv_cache": "int8-kv2~kv_cache-only"}

    from app.settings import get_settings

    monkeypatch.setenv("CANARY_MAX_CONFIGS", "3")  # the derived layer does not count against the team's limit
    get_settings.cache_clear()
    with session_scope() as s:
        apply_config_file(s, parse_config(config(receiver.url + "/hook", corpus, stacked_opt_out=True)))
    run_id, _ = start_run("p", "s", ["int8-kv2"], dispatcher)
    assert dispatcher.run_all()[-1] != "step-back"
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run.status == "done" and run.verdict == "fail"
        assert [cr.config.name for cr in run.config_runs] == ["fp16", "int8-kv2"]  # no layers ran
        summary = jsonable(run_summary(s, run))
    assert summary["step_back"] == [] and "step back" not in summary["verdict_reason"]


def test_a_failed_layer_gives_no_advice_and_leaves_the_verdict_alone(sqlite_env, receiver, tmp_path):
    with session_scope() as s:
        apply_config_file(s, parse_config(config(receiver.url + "/hook", small_corpus(tmp_path))))
    dispatcher = StepDispatcher()
    run_id, _ = start_run("p", "s", ["int8-kv2"], dispatcher)
    assert dispatcher.run_all(until="step-back")[-1] == "step-back"
    with session_scope() as s:  # the KV layer cannot load: a device this host does not have
        run = s.get(Run, run_id)
        layer = next(cr.config for cr in run.config_runs if cr.config.ablation_axis == "kv_cache")
        layer.spec = {**layer.spec, "engine_options": {"device": "cuda:99"}}
    dispatcher.run_all()
    with session_scope() as s:
        run = s.get(Run, run_id)
        status = {cr.config.name: cr.status for cr in run.config_runs}
        summary = jsonable(run_summary(s, run))
    assert summary["status"] == "done"
    assert status == {"fp16": "succeeded", "int8-kv2": "succeeded", "int8-kv2~weights-only": "succeeded",
                      "int8-kv2~kv_cache-only": "failed"}
    # the stacked config's own critical decides, as it would without the layers; nothing is guessed
    assert summary["verdict"] == "fail" and summary["step_back"] == []
    assert "missing results" not in summary["verdict_reason"] and "step back" not in summary["verdict_reason"]
    [alert] = [json.loads(d["body"])["alerts"][0] for d in receiver.delivered()]
    assert alert["labels"]["config"] == "int8-kv2" and "step_back" not in alert["annotations"]
    assert "Step back" not in alert["annotations"]["description"]


def test_two_stacked_configs_that_share_a_layer_measure_it_once(sqlite_env, receiver, tmp_path):
    """int8-kv2 and a second stack of other weights (RTN int4) on the same int2 KV cache: both
    breach; the KV layer alone runs once, and both step-backs use it."""
    cfg = config(receiver.url + "/hook", small_corpus(tmp_path))
    cfg["configs"] = [c for c in cfg["configs"] if c["name"] != "int8"] + [
        {"name": "int4-kv2", "engine": "reference", "weights": "rtn-int4", "kv_cache": "int2"}]
    with session_scope() as s:
        apply_config_file(s, parse_config(cfg))
    dispatcher = StepDispatcher()
    run_id, _ = start_run("p", "s", None, dispatcher)
    dispatcher.run_all()
    with session_scope() as s:
        run = s.get(Run, run_id)
        layers = sorted(cr.config.name for cr in run.config_runs if cr.config.ablation_of_id is not None)
        summary = jsonable(run_summary(s, run))
    assert layers == ["int4-kv2~weights-only", "int8-kv2~kv_cache-only", "int8-kv2~weights-only"]
    found = {f["config"]: {layer["axis"]: layer["config"] for layer in f["layers"]} for f in summary["step_back"]}
    assert found == {"int8-kv2": {"weights": "int8-kv2~weights-only", "kv_cache": "int8-kv2~kv_cache-only"},
                     "int4-kv2": {"weights": "int4-kv2~weights-only", "kv_cache": "int8-kv2~kv_cache-only"}}


def test_a_top_up_reruns_a_breaching_stacked_config_so_its_layers_share_its_samples(sqlite_env, receiver, tmp_path):
    """int8 is undecided at 4 documents (its own rule asks for 6), so the run tops up to 6; the
    stacked int8-kv2, already critical, reruns too, and its two layers then run on the same 6."""
    from app.models import AlertRule

    cfg = config(receiver.url + "/hook", small_corpus(tmp_path))
    cfg["suites"][0]["max_samples"] = 6
    with session_scope() as s:
        project = apply_config_file(s, parse_config(cfg))
        s.add(AlertRule(project_id=project.id, metric="ppl_ratio", warn=2.0, critical=3.0, direction="above", min_n=6,
                        config_id=repo.get_config(s, project, "int8").id))
    dispatcher = StepDispatcher()
    run_id, _ = start_run("p", "s", None, dispatcher)
    dispatcher.run_all()
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert len(run.sample_keys) == 6 and run.verdict == "fail", run.verdict_reason
        passes = {cr.config.name: cr.attempt_base for cr in run.config_runs}
        ids = {cr.config.name: cr.config_id for cr in run.config_runs}
        keys = {name: {r.sample_key for r in s.scalars(select(SampleResult).where(
            SampleResult.run_id == run_id, SampleResult.config_id == config_id, SampleResult.metric == "nll"))}
            for name, config_id in ids.items()}
        summary = jsonable(run_summary(s, run))
    assert passes == {"fp16": 1, "int8-kv2": 1, "int8": 1, "int8-kv2~kv_cache-only": 0}, passes
    assert all(k == set(run.sample_keys) for k in keys.values()), keys
    [found] = summary["step_back"]
    assert found["disable"] == "kv_cache"
