"""One project's backlog cannot starve another's (security round 3, M4): past
CANARY_FAIR_SHARE_QUEUED_CONFIG_RUNS queued config-runs a project's new ones are sent one priority
step behind (gates excepted), and past CANARY_MAX_QUEUED_CONFIG_RUNS_PER_PROJECT a new run is
refused, naming the setting, while other projects and retries of an existing run go on. The
dispatcher records what it would enqueue, so the config-runs stay queued."""

from __future__ import annotations

import pytest
from app.config_file import parse_config
from app.db import session_scope
from app.repo import QueueFull
from app.services import apply_config_file, start_run


class Recorder:
    def __init__(self):
        self.sent = []

    def send(self, task, *args, priority=3):
        self.sent.append((args[0], priority))


def project(name: str) -> dict:
    return {"project": name, "model": {"name": "tiny", "path": "builtin:pydoc-target"},
            "configs": [{"name": "fp16", "baseline": True}, {"name": "int8", "weights": "int8"}],
            "suites": [{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 4}]}


def test_a_backlog_waits_behind_other_projects_and_is_capped(sqlite_env, monkeypatch):
    from app.settings import get_settings

    monkeypatch.setenv("CANARY_FAIR_SHARE_QUEUED_CONFIG_RUNS", "2")
    monkeypatch.setenv("CANARY_MAX_QUEUED_CONFIG_RUNS_PER_PROJECT", "6")
    get_settings.cache_clear()
    with session_scope() as s:
        apply_config_file(s, parse_config(project("noisy")))
        apply_config_file(s, parse_config(project("quiet")))
    d = Recorder()
    start_run("noisy", "s", None, d)  # 0 queued before: priority 3
    start_run("noisy", "s", None, d)  # 2 queued: one step behind, 6
    start_run("noisy", "s", None, d, trigger="gate")  # a gate keeps its priority 0
    assert [p for _, p in d.sent] == [3, 3, 6, 6, 0, 0]
    with pytest.raises(QueueFull, match=r"project 'noisy' has 6 config-runs queued; 2 more would pass its limit of 6 "
                                        r"\(CANARY_MAX_QUEUED_CONFIG_RUNS_PER_PROJECT\)"):
        start_run("noisy", "s", None, d)
    quiet = Recorder()
    start_run("quiet", "s", None, quiet)
    assert [p for _, p in quiet.sent] == [3, 3]  # the other project is not held back
    get_settings.cache_clear()


def test_a_retry_of_an_existing_run_is_not_refused_by_the_cap(sqlite_env, monkeypatch):
    from app.settings import get_settings

    monkeypatch.setenv("CANARY_MAX_QUEUED_CONFIG_RUNS_PER_PROJECT", "2")
    get_settings.cache_clear()
    with session_scope() as s:
        apply_config_file(s, parse_config(project("noisy")))
    first, created = start_run("noisy", "s", None, Recorder(), idempotency_key="k")
    again, created_again = start_run("noisy", "s", None, Recorder(), idempotency_key="k")
    assert (again, created, created_again) == (first, True, False)
    with pytest.raises(QueueFull):
        start_run("noisy", "s", None, Recorder())
    get_settings.cache_clear()
