"""Model and draft paths stay under the operator's model root (CANARY_MODEL_ROOT), per project
with CANARY_MODEL_ROOT_PER_PROJECT: a path outside it, a symlink out, `..` and
/proc/self/root forms all get the same 422 over the API and one error line from `canary run -f`;
a served model's URL is for engine openai only. Without a root, production reads builtin models
only."""

from __future__ import annotations

import shutil

import pytest
import yaml
from engines.zoo import resolve_model_path

from tests.unit.test_cli_pipe import canary

USABLE = "is not a usable path to a model directory on the server"


@pytest.fixture
def tree(tmp_path):
    """<tmp>/models/{alpha,beta,_shared}/… and a private model outside the root."""
    target, draft = resolve_model_path("builtin:pydoc-target"), resolve_model_path("builtin:pydoc-draft")
    root = tmp_path / "models"
    for folder, src in (("alpha/m", target), ("alpha/draft", draft), ("beta/private", target), ("_shared/base", target),
                        ("../outside/m", target)):
        shutil.copytree(src, root / folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (root / "alpha" / "link-out").symlink_to(tmp_path / "outside" / "m")
    (root / "alpha" / "link-beta").symlink_to(root / "beta" / "private")
    return root


@pytest.fixture
def api(sqlite_env, monkeypatch, tree):
    from app.api.main import app
    from app.settings import get_settings
    from fastapi.testclient import TestClient

    monkeypatch.setenv("CANARY_MODEL_ROOT", str(tree))
    monkeypatch.setenv("CANARY_MODEL_ROOT_PER_PROJECT", "true")
    get_settings.cache_clear()
    http = TestClient(app)
    assert http.post("/api/v1/projects", json={"name": "alpha"}).status_code == 201
    yield http
    get_settings.cache_clear()


def refused_paths(root) -> dict[str, str]:
    outside = root.parent / "outside" / "m"
    alpha = root / "alpha"
    return {"outside the root": str(outside), "another project's folder": str(root / "beta" / "private"),
            "a symlink out": str(alpha / "link-out"), "a symlink to another project": str(alpha / "link-beta"),
            "..": str(alpha / ".." / ".." / "outside" / "m"), ".. to beta": str(alpha / ".." / "beta" / "private"),
            "/proc/self/root": f"/proc/self/root{outside}", "/proc/self/root inside": f"/proc/self/root{alpha}/m",
            "/proc/self/cwd": "/proc/self/cwd/m", "the root itself": str(root), "missing": str(alpha / "nope")}


def test_model_paths_outside_the_projects_folder_are_refused_alike(api, tree):
    answers = {}
    for what, path in refused_paths(tree).items():
        r = api.post("/api/v1/projects/alpha/models", json={"name": "m", "path": path})
        assert r.status_code == 422, (what, r.text)
        shown = path if len(path) <= 80 else path[:77] + "..."
        answers[what] = r.json()["detail"].replace(f"'{shown}'", "'<path>'")
    assert len(set(answers.values())) == 1, answers
    assert answers["missing"] == (f"path: '<path>' {USABLE} (a Hugging Face directory with config.json under "
                                  f"{tree}/alpha/, {tree}/_shared/); give one, or builtin:pydoc-target")
    for path in (str(tree / "alpha" / "m"), str(tree / "_shared" / "base"), "builtin:pydoc-target"):
        r = api.post("/api/v1/projects/alpha/models", json={"name": f"ok{len(path)}", "path": path})
        assert r.status_code == 201, (path, r.text)


def test_draft_paths_get_the_same_answer_and_urls_need_engine_openai(api, tree):
    p = "/api/v1/projects/alpha"
    assert api.post(f"{p}/models", json={"name": "m", "path": str(tree / "alpha" / "m")}).status_code == 201

    def draft(path: str):
        return api.post(f"{p}/configs", json={"name": "d", "model": "m", "engine": "reference",
                                              "speculative": {"method": "draft", "draft_model": path, "k": 2}})

    for path in [*refused_paths(tree).values(), "http://169.254.169.254/latest/", "https://models.example.com/x"]:
        r = draft(path)
        assert r.status_code == 422, (path, r.text)
        assert r.json()["detail"].startswith("config.speculative.draft_model: '") and USABLE in r.json()["detail"]
    ok = draft(str(tree / "alpha" / "draft"))
    assert ok.status_code == 201, ok.text
    # a URL is a served model's name: its host passes the outbound policy, and only engine openai takes it
    metadata = api.post(f"{p}/models", json={"name": "meta", "path": "http://169.254.169.254/latest/"})
    assert metadata.status_code == 422 and "link-local" in metadata.text
    assert api.post(f"{p}/models", json={"name": "served", "path": "http://127.0.0.1:8000/v1"}).status_code == 201
    r = api.post(f"{p}/configs", json={"name": "ref", "model": "served", "engine": "reference"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith("config.model: the model's path is a served model's URL, which only engine "
                                         "'openai' runs"), r.text


def test_canary_run_f_gives_one_error_line(tmp_path, tree):
    db = f"sqlite:///{tmp_path / 'c.db'}"
    refused = refused_paths(tree)
    for path in (refused["a symlink out"], refused[".."], refused["/proc/self/root"]):
        (tmp_path / "canary.yaml").write_text(yaml.safe_dump({
            "project": "alpha", "model": {"name": "m", "path": path},
            "configs": [{"name": "fp32", "baseline": True, "engine": "reference", "weights": "fp32"}],
            "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 4, "scorers": ["perplexity"]}]}))
        r = canary("run", "-f", str(tmp_path / "canary.yaml"), cwd=tmp_path, db=db, timeout=120,
                   CANARY_MODEL_ROOT=str(tree), CANARY_MODEL_ROOT_PER_PROJECT="true")
        assert r.returncode == 2, (path, r.stdout, r.stderr[-2000:])
        [line] = r.stderr.strip().splitlines()
        shown = path if len(path) <= 80 else path[:77] + "..."
        assert line.startswith(f"error: model.path: '{shown}' {USABLE}"), line


def test_production_without_a_root_reads_builtin_models_only(monkeypatch, tree):
    from app.model_paths import model_dir
    from app.settings import get_settings

    monkeypatch.setenv("CANARY_ENVIRONMENT", "production")
    monkeypatch.delenv("CANARY_MODEL_ROOT", raising=False)
    get_settings.cache_clear()
    try:
        assert model_dir("builtin:pydoc-target", "model.path").name == "pydoc-target"
        with pytest.raises(ValueError, match="CANARY_MODEL_ROOT is not set on this server"):
            model_dir(str(tree / "alpha" / "m"), "model.path", "alpha")
        monkeypatch.setenv("CANARY_ENVIRONMENT", "dev")  # dev and test: any local directory, as before
        get_settings.cache_clear()
        assert model_dir(str(tree / "beta" / "private"), "model.path", "alpha") == tree / "beta" / "private"
    finally:
        get_settings.cache_clear()


def test_the_worker_checks_again_at_use(sqlite_env, monkeypatch, tree):
    """A model stored before the root was set (or behind a symlink moved since) fails its
    config-runs with the same answer, before any weights are read."""
    from app import repo
    from app.config_file import parse_config
    from app.db import session_scope
    from app.dispatch import InlineDispatcher
    from app.schemas import jsonable
    from app.services import apply_config_file, run_summary, start_run
    from app.settings import get_settings

    with session_scope() as session:  # no root yet (dev): any local directory
        apply_config_file(session, parse_config({
            "project": "alpha", "model": {"name": "m", "path": str(tree / "beta" / "private")},
            "configs": [{"name": "fp32", "baseline": True, "engine": "reference", "weights": "fp32"}],
            "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 4, "scorers": ["perplexity"],
                        "perplexity": {"window": 64}}]}))
    monkeypatch.setenv("CANARY_MODEL_ROOT", str(tree))
    monkeypatch.setenv("CANARY_MODEL_ROOT_PER_PROJECT", "true")
    get_settings.cache_clear()
    run_id, _ = start_run("alpha", "s", None, InlineDispatcher())
    with session_scope() as session:
        summary = jsonable(run_summary(session, repo.get_run(session, repo.get_project(session, "alpha"), run_id)))
    [config] = summary["configs"]
    assert config["status"] == "failed" and config["error"].startswith("ValueError: model.path: '"), config
    assert USABLE in config["error"] and "safetensors" not in config["error"]
    get_settings.cache_clear()


def test_the_worker_loads_the_draft_it_checked_by_its_real_path(sqlite_env, monkeypatch, tree):
    """The draft is checked at use like the model, and the engine gets the real path the check
    resolved: a symlink swapped after the check cannot change what loads (security round 3, M3)."""
    import os

    from app.settings import get_settings
    from engines.spec import OptimizationSpec
    from vocabulary.suite import SuiteSpec
    from workers.job import Job, loadable_model

    monkeypatch.setenv("CANARY_MODEL_ROOT", str(tree))
    monkeypatch.setenv("CANARY_MODEL_ROOT_PER_PROJECT", "true")
    get_settings.cache_clear()
    alpha = tree / "alpha"
    (alpha / "draft-link").symlink_to(alpha / "draft")

    def job(draft: str) -> Job:
        spec = OptimizationSpec.model_validate({"engine": "reference", "weights": "fp32",
                                                "speculative": {"method": "draft", "draft_model": draft, "k": 4}})
        return Job(run_id=1, config_id=1, project="alpha", trigger="manual", is_baseline=False, spec=spec,
                   baseline_spec=OptimizationSpec(engine="reference", weights="fp32"), calibration=None,
                   suite_version="v", model_path=str(alpha / "m"), suite=SuiteSpec(), samples=(), prompts=0)

    model, spec = loadable_model(job(str(alpha / "draft-link")))
    assert model == alpha / "m" and spec.speculative.draft_model == os.path.realpath(alpha / "draft")
    (alpha / "draft-link").unlink()  # pointed at another project's folder after the check: the next check refuses it
    (alpha / "draft-link").symlink_to(tree / "beta" / "private")
    with pytest.raises(ValueError, match="speculative.draft_model: '.*' " + USABLE):
        loadable_model(job(str(alpha / "draft-link")))
    get_settings.cache_clear()
