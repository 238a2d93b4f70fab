"""The pre-deploy gate against the real stack (API under uvicorn, a Celery worker process,
Postgres, Redis), driven by the `canary gate` CLI as CI would: pass, warn and fail on the tiny
model, the exit codes, the idempotency key, and the verdict surviving a worker restart."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.services.conftest import start_worker

P = "/api/v1/projects/gate"


@pytest.fixture(scope="module")
def project(stack):
    http = stack.http
    assert http.post("/api/v1/projects", json={"name": "gate"}).status_code == 201
    assert http.post(f"{P}/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
    for body in (
        {"name": "fp32", "model": "tiny", "baseline": True, "engine": "reference", "weights": "fp32"},
        {"name": "fp32-copy", "model": "tiny", "engine": "reference", "weights": "fp32"},  # identical: passes
        {"name": "int2", "model": "tiny", "engine": "reference", "weights": "rtn-int2"},  # +5.7 % perplexity
        {"name": "kv-int2", "model": "tiny", "engine": "reference", "kv_cache": "int2"},  # likewise
    ):
        assert http.post(f"{P}/configs", json=body).status_code == 201
    assert http.post(f"{P}/suites", json={"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 12, "seed": 5,
                                          "scorers": ["perplexity"], "perplexity": {"window": 64}}).status_code == 201
    # per-config budgets: int2 lands between warn and critical, kv-int2 past critical
    for rule in ({"metric": "ppl_ratio", "warn": 1.02, "critical": 1.5, "config": "int2"},
                 {"metric": "ppl_ratio", "warn": 1.01, "critical": 1.03, "config": "kv-int2"}):
        r = http.put(f"{P}/alert-rules", json=rule)
        assert r.status_code == 200, r.text
    return "gate"


def gate(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", "gate", "--api", stack.api, "--project", "gate", "--suite", "s", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=stack.env)


def test_pass_warn_fail_and_exit_codes(stack, project, tmp_path):
    ok = gate(stack, "--candidate", "fp32-copy", "--summary-md", str(tmp_path / "pass.md"))
    assert ok.returncode == 0, ok.stderr
    assert "gate" in ok.stderr and "pass" in ok.stderr
    md = (tmp_path / "pass.md").read_text()
    assert "gate: **pass**" in md and "on suite `s` (12 documents)" in md
    assert "| ppl_ratio | +0.00% [+0.00, +0.00] | 12 | ok |" in md  # an identical copy: no change, a zero-width CI
    warn = gate(stack, "--candidate", "int2", "--json")
    assert warn.returncode == 0  # warn lets the deploy go on by default…
    import json

    g = json.loads(warn.stdout)
    assert g["verdict"] == "warn" and g["comparisons"][0]["verdict"] == "warn"
    # its baseline took the first gate's rows (the same samples and inputs), in the worker, on Postgres
    figures = stack.http.get(f"{P}/runs/{g['run_id']}").json()["figures"]
    assert figures["fp32"]["reused_from_run"] < g["run_id"] and figures["int2"]["reused_from_run"] is None
    assert "**Decision:** deploy allowed: warn (exit 0)" in g["summary_markdown"]
    strict = gate(stack, "--candidate", "int2", "--warn-exit-code", "1", "--summary-md", str(tmp_path / "warn.md"))
    assert strict.returncode == 1  # …and blocks it when CI says so, in its comment too
    assert strict.stderr.strip().splitlines()[-1] == "canary: deploy blocked: warn (exit 1)"
    assert "**Decision:** deploy blocked: warn (exit 1)" in (tmp_path / "warn.md").read_text()
    bad = gate(stack, "--candidate", "kv-int2", "--summary-md", str(tmp_path / "fail.md"),
               "--report-html", str(tmp_path / "fail.html"))
    assert bad.returncode == 1 and "fail" in bad.stderr
    md = (tmp_path / "fail.md").read_text()
    assert "gate: **fail**" in md and "**Decision:** deploy blocked: fail (exit 1)" in md  # the decision, first
    assert "drop or fix (1):\n  " in md and ": ppl ratio +" in md  # then the verdict for people
    # the run's report, through the API, as the CI artifact: one HTML file naming the candidate's group
    html = (tmp_path / "fail.html").read_text()
    assert html.startswith("<!doctype html>") and "drop or fix (1):" in html and "kv-int2" in html


def test_bad_gate_requests_exit_2_naming_the_field(stack, project):
    missing = gate(stack, "--candidate", "no-such-config")
    assert missing.returncode == 2 and "no-such-config" in missing.stderr and "HTTP 404" in missing.stderr
    base = gate(stack, "--candidate", "int2", "--baseline", "fp32-copy")
    assert base.returncode == 2 and "baseline: 'fp32-copy' is not the baseline of model 'tiny'" in base.stderr
    down = subprocess.run([sys.executable, "-m", "app.cli", "gate", "--api", "http://127.0.0.1:9", "--candidate", "int2", "--suite", "s"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert down.returncode == 3 and "unreachable" in down.stderr  # the canary itself is down: its own code


def test_idempotency_key_and_a_worker_restart(stack, project):
    first = gate(stack, "--candidate", "kv-int2", "--idempotency-key", "sha-abc123", "--json", "--no-wait")
    assert first.returncode == 0  # no verdict yet with --no-wait
    import json

    g1 = json.loads(first.stdout)
    # the worker restarts while (or after) the gate's run is in flight
    old = stack.procs[0]
    old.terminate()
    old.wait(60)
    # the new worker runs the (single) beat, whose reconciler re-enqueues a config-run whose
    # message went down with the old worker (requeue after 5 s here instead of 5 min)
    stack.procs[0] = start_worker({**stack.env, "CANARY_REQUEUE_AFTER_SECONDS": "5"}, stack.logs["worker"], beat=True)
    again = gate(stack, "--candidate", "kv-int2", "--idempotency-key", "sha-abc123", "--json")
    g2 = json.loads(again.stdout)
    assert again.returncode == 1 and g2["verdict"] == "fail"
    assert (g2["gate_id"], g2["run_id"]) == (g1["gate_id"], g1["run_id"])  # the same gate, not a second run
    runs = stack.http.get(f"{P}/runs").json()
    assert sum(r["trigger"] == "gate" for r in runs) == 5  # 4 gates above + this one
    listed = stack.http.get(f"{P}/gates").json()
    assert listed[0]["gate_id"] == g1["gate_id"] and listed[0]["verdict"] == "fail"


def test_an_undecided_gate_tops_up_in_the_worker(stack, project):
    """A suite of 6 documents that may top up to 12, and a config whose rule asks for 8 paired
    documents: the first pass is 'too few samples', so the worker's aggregation draws 6 more, the
    worker reruns the baseline and the candidate on all 12 (new config-runs, on Postgres), and the
    gate passes on 12."""
    http = stack.http
    assert http.post(f"{P}/configs", json={"name": "int8", "model": "tiny", "engine": "reference",
                                           "weights": "int8"}).status_code == 201
    assert http.put(f"{P}/alert-rules", json={"metric": "ppl_ratio", "warn": 2.0, "critical": 3.0, "min_n": 8,
                                              "config": "int8"}).status_code == 200
    r = http.post(f"{P}/suites", json={"name": "topup", "corpus": "builtin:pydoc-heldout", "samples": 6,
                                       "max_samples": 12, "seed": 5, "scorers": ["perplexity"],
                                       "perplexity": {"window": 64}})
    assert r.status_code == 201 and r.json()["max_samples"] == 12, r.text
    out = subprocess.run([sys.executable, "-m", "app.cli", "gate", "--api", stack.api, "--project", "gate",
                          "--suite", "topup", "--candidate", "int8", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=stack.env)
    assert out.returncode == 0, out.stderr
    import json

    g = json.loads(out.stdout)
    assert g["verdict"] == "pass", g
    run = http.get(f"{P}/runs/{g['run_id']}").json()
    assert run["n_samples"] == 6 and run["samples_drawn"] == 12
    [ppl] = [c for c in run["comparisons"] if c["config"] == "int8" and c["metric"] == "ppl_ratio"]
    assert ppl["n"] == 12 and ppl["verdict"] == "ok"
    assert "topped up from 6 to 12 samples (max_samples 12)" in run["verdict_reason"]
    # each ran twice, in its own row: attempt 1 on 6 documents, attempt 2 on 12
    assert {c["config"]: (c["status"], c["attempt"]) for c in run["configs"]} == {"fp32": ("succeeded", 2),
                                                                                 "int8": ("succeeded", 2)}
    bad = http.post(f"{P}/suites", json={"name": "topup2", "corpus": "builtin:pydoc-heldout", "samples": 6,
                                         "max_samples": 3})
    assert bad.status_code == 422 and "max_samples: 3 is below samples (6)" in bad.text, bad.text


def test_a_stacked_gate_steps_back_in_the_worker(stack, tmp_path):
    """Step back one layer through the worker: a gate on int8 weights + an int2 KV cache (on the
    outlier model, where int2 keys collapse) breaches, the worker's aggregation adds the two
    single-optimization ablations, the worker runs them, and the gate's summary names the KV layer."""
    http, S = stack.http, "/api/v1/projects/stepback"
    assert http.post("/api/v1/projects", json={"name": "stepback"}).status_code == 201
    assert http.post(f"{S}/models", json={"name": "outlier", "path": "builtin:pydoc-outlier"}).status_code == 201
    for body in ({"name": "fp16", "model": "outlier", "baseline": True, "engine": "reference", "weights": "fp16"},
                 {"name": "int8-kv2", "model": "outlier", "engine": "reference", "weights": "int8",
                  "kv_cache": "int2"}):
        assert http.post(f"{S}/configs", json=body).status_code == 201
    assert http.post(f"{S}/suites", json={"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 4, "seed": 3,
                                          "scorers": ["perplexity"], "perplexity": {"window": 64}}).status_code == 201
    assert http.put(f"{S}/alert-rules", json={"metric": "ppl_ratio", "warn": 1.01, "critical": 1.03,
                                              "min_n": 3}).status_code == 200
    md = tmp_path / "gate.md"
    out = subprocess.run([sys.executable, "-m", "app.cli", "gate", "--api", stack.api, "--project", "stepback",
                          "--suite", "s", "--candidate", "int8-kv2", "--summary-md", str(md)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=stack.env)
    assert out.returncode == 1, out.stderr
    runs = http.get(f"{S}/runs").json()
    run = http.get(f"{S}/runs/{runs[0]['run_id']}").json()
    assert {c["config"]: c["status"] for c in run["configs"]} == {
        "fp16": "succeeded", "int8-kv2": "succeeded", "int8-kv2~weights-only": "succeeded",
        "int8-kv2~kv_cache-only": "succeeded"}
    [found] = run["step_back"]
    assert found["config"] == "int8-kv2" and found["disable"] == "kv_cache"
    # the advice in the verdict's lines, each layer's share in the table under them
    assert f" — step back: {found['advice']}" in md.read_text() and "**Step back one layer**" in md.read_text()
