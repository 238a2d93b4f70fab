"""A seeded API for the dashboard tests: `canary run -f` on the embedded default (a real run of
the tiny model with an alert that fires and escalates, then a cheap run of a second suite,
"smoke", so that pages can be checked for mixing suites), then `canary serve` on loopback, a CI
gate through the API and a silence. Both the AppTest tests and the browser test read it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from engines.zoo import resolve_corpus_path

from tests.conftest import ROOT
from tests.loopback import canary_serve

SMOKE = "smoke"


def seed_config(corpus: str) -> dict:
    return {
        "project": "dash",
        "model": {"name": "tiny", "path": "builtin:pydoc-target"},
        "configs": [{"name": "fp32", "baseline": True, "engine": "reference", "weights": "fp32"},
                    {"name": "int8", "engine": "reference", "weights": "int8"},
                    {"name": "int2", "engine": "reference", "weights": "rtn-int2"},
                    {"name": "spec-ngram", "engine": "reference", "weights": "fp32",
                     "speculative": {"method": "ngram", "k": 4}}],
        "suites": [{"name": "s", "corpus": corpus, "samples": 12, "seed": 2,
                    "scorers": ["perplexity", "generation", "agreement", "faithfulness", "labelled"],
                    # two position buckets: 0–127, 128–255; 4 documents' next-token distributions (kld_mean)
                    "perplexity": {"window": 256, "distribution_samples": 4},
                    # the built-in labelled task's first 24 items (task_recovery, task_flips; min_n 20)
                    "labelled": {"items": "builtin:pydoc-next-word", "max_items": 24},
                    # 20 new tokens: two buckets of the answers (0–15, 16–63) in gen_nll_ratio
                    "generation": {"prompts": 10, "prompt_words": 8, "max_new_tokens": 20}},
                   # the second suite: perplexity only on 4 documents, run last over fp32 and int8 (a few
                   # seconds); 4 are too few to decide (min_n 10), so the run tops up to 8, then 12
                   {"name": SMOKE, "corpus": corpus, "samples": 4, "max_samples": 12, "seed": 3,
                    "scorers": ["perplexity"], "perplexity": {"window": 64}}],
        "thresholds": {"ppl_ratio": {"warn": 1.01, "critical": 1.03}},
        "schedules": [{"name": "daily", "cron": "0 6 * * *", "suite": "s"}],
    }


def seed(tmp) -> dict:
    """The seeded database under `tmp` (two `canary run`s); returns the environment that serves it."""
    lines = resolve_corpus_path("builtin:pydoc-heldout").read_text().splitlines()[:14]
    (tmp / "corpus.jsonl").write_text("\n".join(lines))
    (tmp / "canary.yaml").write_text(yaml.safe_dump(seed_config(str(tmp / "corpus.jsonl"))))
    env = {**os.environ, "CANARY_DATABASE_URL": f"sqlite:///{tmp / 'dash.db'}", "CANARY_EXECUTION": "inline",
           "CANARY_DASHBOARD_URL": "http://127.0.0.1:8501"}
    env.pop("CANARY_BROKER_URL", None)
    for extra in ([], ["--suite", SMOKE, "--configs", "fp32,int8"]):
        r = subprocess.run([sys.executable, "-m", "app.cli", "run", "-f", str(tmp / "canary.yaml"), "--json", *extra],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode in (0, 1), r.stderr[-3000:]  # a failing verdict is expected: int2 is critical
    # the daily schedule was made three days ago and none of its runs has succeeded: the canary is
    # stale (app/staleness.py), and the overview says so
    import sqlite3

    with sqlite3.connect(tmp / "dash.db") as db:
        db.execute("UPDATE schedules SET created_at = datetime('now', '-3 days')")
    return env


@pytest.fixture(scope="session")
def seeded_api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash")
    env = seed(tmp)
    with canary_serve(env, str(tmp / "api.log"), "--no-upgrade-db") as base:
        http = httpx.Client(base_url=base + "/api/v1", timeout=60)
        g = http.post("/projects/dash/gates", json={"candidate": "int8", "suite": "s"},
                      headers={"Idempotency-Key": "seed"}).json()
        deadline = time.time() + 300
        while g["verdict"] is None and time.time() < deadline:
            time.sleep(1)
            g = http.get(f"/projects/dash/gates/{g['gate_id']}").json()
        assert g["verdict"] is not None, json.dumps(g)[:2000]
        s = http.post("/projects/dash/silences", json={"matchers": [{"name": "config", "value": "int8"}],
                                                       "duration_minutes": 120, "author": "ana",
                                                       "comment": "int8 is being re-calibrated"})
        assert s.status_code == 201
        yield {"url": base, "env": env, "tmp": tmp, "gate": g}
